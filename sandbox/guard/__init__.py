"""The guard: the one pre-call check every bridge call of a test run goes through.

It runs in its own container as its own uid (the only one the firewall lets
out), owns the run's network namespace, applies `sandbox.policy` to each call,
appends the call to the action log before it answers, and forwards what is
allowed, with identity fields it sets itself. It holds no Docker access and
never sees the engine.
"""
