"""The local Kubernetes cluster (`cluster/`), its certificates (`pki`), a namespace of
a caller's own (`namespace`) and what the scheduler placement needs on it
(`fleetsetup`): see tests/kubernetes/README.md."""
