"""Launch: what the run's containers are, as pure data.

The containers' specs from a `RunPlan`, their mounts, the firewall's rules and the
seccomp profile. Nothing here calls an engine: a backend (`sandbox.backends`) turns
the specs into containers.
"""
