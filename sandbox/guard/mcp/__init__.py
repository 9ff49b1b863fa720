"""The MCP subsystem of the guard: the step's only way to the workflow's MCP servers
(mcp.spec.md says what it guarantees)."""
