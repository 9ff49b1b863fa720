"""Prepare: what a test run needs before any container exists.

The workflow's lock, the copy of the newest real run's execution tree, the consistent
DB copy (and its snapshot helper), and the step's prompt with its TEST MODE section.
"""
