"""Private second Docker engines (runsc runtimes, userns-remap), started and stopped by
pid, the host's engine never reconfigured: see tests/engines/README.md."""
