"""Backends: the code that turns the run's container specs into running containers.

`docker/` is the Docker Engine backend. A backend consumes the pure `ContainerSpec`s
of `sandbox.launch` and hands back what the run's phases need (exit codes, output,
usage); another backend (Kubernetes) sits beside it with the same inputs.
"""
