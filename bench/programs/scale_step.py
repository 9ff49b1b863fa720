# The scale benchmark's step: a little of everything a real step does through the guard.
import agentworks_bridge

for i in range(5):
    r = agentworks_bridge.call("generate_text_llm", {"prompt": f"scale {i}"})
    assert r["decision"] == "allow" and r["ok"], r
for i in range(5):
    r = agentworks_bridge.call("notify_user", {"text": f"scale {i}"})
    assert r["decision"] == "stub", r
r = agentworks_bridge.call("query_workflow_db", {"sql": "SELECT count(*) FROM items"})
assert r["decision"] == "redirect" and r["ok"], r
with open("out.txt", "w") as f:
    f.write("done\n")
