"""The egress subsystem of the guard: the step's only way to the outside, and only to
read (egress.spec.md says what it guarantees)."""
