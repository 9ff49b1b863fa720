"""Verification: what a step must (and must not) try, checked against one test run.

`expect` parses the expectations (beside the step in `workflow.toml`, or in a
file it names); `finished` reads a finished run folder once (record, action log,
saved verification) into the object every output renders; `check` judges the
expectations against it; `verification` (`workflow_verification` for a chain) is
the verdict and its saved file; `verifystep` runs the step once and keeps the
verdict in the workflow's history; `gate` is the rule Pulse and CI apply to that
history; `junit` and `html` are the verdict in the forms CI and people read;
`diff` compares two finished runs of a step, `chaindiff` two whole-workflow runs step
by step, `compare` loads two run folders for the one or the other; `against` is the
verdict with what changed since the last passing verification (or a named run).
"""
