"""The firewall rules (pure): what the guard's entry script installs and reads back."""

from __future__ import annotations

from sandbox.contracts.layout import GUARD_UID
from sandbox.launch.firewall import READY_MARK, expected_readback, guard_entry_script, rules


def test_only_the_guard_uid_leaves_and_everything_else_is_rejected() -> None:
    for family, args in rules().items():
        assert args[0] == "-P OUTPUT DROP", family
        assert args[1] == f"-A OUTPUT -m owner --uid-owner {GUARD_UID} -j ACCEPT"
        assert args[-1].startswith("-A OUTPUT -j REJECT"), family  # fail fast, never hang
        assert "-A OUTPUT -p tcp -j REJECT --reject-with tcp-reset" in args


def test_engine_dns_is_rejected_before_loopback_is_accepted() -> None:
    v4 = rules()["iptables"]
    dns = v4.index("-A OUTPUT -d 127.0.0.11/32 -j REJECT --reject-with icmp-port-unreachable")
    assert dns < v4.index("-A OUTPUT -o lo -m addrtype --dst-type LOCAL -j ACCEPT")


def test_script_installs_reads_back_then_drops_to_the_guard() -> None:
    script = guard_entry_script(["guard", "--x"])
    lines = script.splitlines()
    assert lines[0] == "set -eu"
    for tool, args in rules().items():
        restore = lines.index(f"{tool}-restore -w <<'RULES'")
        table = lines[restore + 1 : lines.index("RULES", restore)]
        assert table[0] == "*filter" and table[-1] == "COMMIT"
        assert ":OUTPUT DROP [0:0]" in table
        assert [ln for ln in table if ln.startswith("-A")] == [
            a for a in args if a.startswith("-A")
        ]
    readback = lines.index("iptables -w -S OUTPUT")
    assert lines[readback + 1] == "ip6tables -w -S OUTPUT"
    assert lines[readback + 2] == f"echo {READY_MARK}"
    assert lines[-1].startswith("exec setpriv ") and lines[-1].endswith("-- tini -- guard --x")
    assert len(expected_readback()) == sum(len(a) for a in rules().values())


def test_without_install_the_script_still_reads_back_and_drops() -> None:
    """The test-only open namespace: no rules, the same drop (the preflight must catch it)."""
    script = guard_entry_script(["guard"], install=False)
    assert "-restore" not in script and "exec setpriv " in script
