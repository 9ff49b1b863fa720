"""Verification: what a step must (and must not) try, checked against one test run.

`expect` parses the expectations (beside the step in `workflow.toml`, or in a
file it names); `check` judges them against a run's record and action log;
`verifystep` runs the step once and keeps the verdict in the workflow's history;
`gate` is the rule Pulse and CI apply to that history; `junit` and `html` are
the verdict in the forms CI and people read.
"""
