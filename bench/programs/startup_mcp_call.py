# One tools/call to the time server through the guard, then exit.
import agentworks_mcp

with agentworks_mcp.connect("time") as time_server:
    time_server.call_tool("get_current_time", {"timezone": "UTC"})
