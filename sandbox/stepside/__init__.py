"""What runs inside our images, standard library only: the step image installs this folder.

The step image copies this folder's contents (all but this file) into its Python path,
so each part is imported by its own name there: `agentworks_bridge` and `agentworks_mcp`
(the step's clients), `agentworks_exec` (the executor, the step container's pid 1) and
`agentworks_relay` (the MCP servers' entry point, in the MCP image built on the step
image). On the host the same code is `sandbox.stepside.<name>`; nothing here imports
`sandbox`, and the modules of `agentworks_exec` import each other relatively, so the
same files work in both places.
"""
