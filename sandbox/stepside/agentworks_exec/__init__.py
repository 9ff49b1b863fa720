"""The step container's executor (`python3 -m agentworks_exec`), standard library only."""
