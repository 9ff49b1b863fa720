"""What the runner and the guard's process agree on before any config is read.

The ports, the config file and the ready line. Standard library only: the guard
imports this before it binds its ports, and the step waits for those.
"""

BRIDGE_PORT = 8790
EGRESS_PORT = 8792
# Where the firewall redirects the step's direct TCP connections and its DNS queries
# (unprivileged ports: the guard holds no capability to bind port 53).
TRANSPARENT_PORT = 8793
DNS_PORT = 8753
EXEC_PORT = 8799  # the step executor's, inside the step; listed so the ports stay apart
CONFIG_FILE_ENV = "SANDBOX_GUARD_CONFIG_FILE"
CONFIG_FILE_NAME = "config.json"  # in the guard's folder (DATA_DIR), 0600, guard uid
READY_MARK = "GUARD-READY"  # on stdout once the guard serves (not just listens)
# One bridge request body at most (the wire's cap, `sandbox.contracts.wire`; the guard's,
# `sandbox.guard.limits`): here so the runner sizes the guard without the wire's models.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# The replies the guard reads before it answers the step, the forwarded calls whose
# reply it may hold at once, and the memory limit they add up to: here so the runner
# sizes the guard's container without the guard's asyncio code (`sandbox.guard.limits`
# names them for the guard, with the other sizes it accepts).
MiB = 1024 * 1024
MAX_MCP_MESSAGE_BYTES = 8 * MiB  # one JSON-RPC message from an MCP server
MAX_UPSTREAM_REPLY_BYTES = 8 * MiB  # the real bridge's reply body
MAX_EXEC_REPLY_BYTES = 8 * MiB  # the step executor's reply body
FORWARD_SLOTS = 4
# A reply in memory exists several times over while it is parsed and relayed
# (bytes read, parsed objects, the reply serialized for the step, its body):
# measured at about 5x its size for an MCP result (the guard container's
# cgroup peak: 60 MiB idle, 97 MiB with one 7 MB result, 139 MiB with sixteen
# at once); 8x leaves room.
_COPIES = 8
_GUARD_BASE_BYTES = 160 * MiB  # the guard's own RSS (~50-70 MB) with headroom
_LARGEST_REPLY = max(MAX_MCP_MESSAGE_BYTES, MAX_UPSTREAM_REPLY_BYTES, MAX_EXEC_REPLY_BYTES)
GUARD_MEMORY_BYTES = _GUARD_BASE_BYTES + FORWARD_SLOTS * _COPIES * _LARGEST_REPLY
# The netfilter log group the firewall copies the step's refused packets to, and the
# variable that names the guard's socket bound to it (`sandbox.guard.nflog`).
NFLOG_GROUP = 34
NFLOG_FD_ENV = "SANDBOX_GUARD_NFLOG_FD"
# The firewall's gate (`sandbox.launch.firewall.guard_entry_script`): a pipe from the
# entry's install script, which writes "ok" to it (its fd FIREWALL_GATE_WRITE_FD) once
# the rules are in and read back right and otherwise ends without; the guard gets the
# read end (its number in FIREWALL_GATE_FD_ENV) and binds nothing before "ok".
FIREWALL_GATE_FD_ENV = "SANDBOX_GUARD_FIREWALL_GATE_FD"
FIREWALL_GATE_OK = b"ok\n"
FIREWALL_GATE_WRITE_FD = 9
FIREWALL_GATE_READ_FD = 8
