"""Collect: what the step did, read back on the host once it stopped.

The group folder's changes, the row-level DB diff, and the action log's summary.
Every input is the step's (or the guard's) to choose, so all of it is read as
untrusted: fd-based, capped, validated.
"""
