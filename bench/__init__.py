"""The benchmarks (`make bench`): how fast test mode is, every figure against a baseline.

Not part of the installed package: they run from a checkout (its fake upstreams, its
`bench/results.json`). `sandbox bench` from a checkout runs them too.
"""
