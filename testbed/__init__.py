"""The local testbeds the suite and the bench both run on: a Kubernetes cluster of two
nodes on this host (`kubernetes/`) and private second Docker engines (`engines/`), each
started and stopped by the process that asked for it, nothing of it outliving that.

Its own package, beside `tests/` and `bench/`, so the bench never imports the suite:
pytest's fixtures stay in `tests/` and build on what is here. Imports nothing of
`tests/` or `bench/` (`tests/repo/test_layout.py`).
"""
