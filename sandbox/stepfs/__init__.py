"""The step's file systems, from prepare to collect: its disk and its view of the workflow.

`lifecycle.StepFs` opens both before the step (prepare), watches the disk while the step
runs, copies the step's folders off the disk (collect) and unmounts both on every way out.
"""
