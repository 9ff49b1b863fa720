"""The firewall rules (pure): what the init container installs and reads back."""

from __future__ import annotations

from sandbox.firewall import expected_readback, install_script, rules
from sandbox.layout import GUARD_UID


def test_only_the_guard_uid_leaves_and_everything_else_is_rejected() -> None:
    for family, args in rules().items():
        assert args[0] == "-P OUTPUT DROP", family
        assert args[1] == f"-A OUTPUT -m owner --uid-owner {GUARD_UID} -j ACCEPT"
        assert args[-1].startswith("-A OUTPUT -j REJECT"), family  # fail fast, never hang
        assert "-A OUTPUT -p tcp -j REJECT --reject-with tcp-reset" in args


def test_engine_dns_is_rejected_before_loopback_is_accepted() -> None:
    v4 = rules()["iptables"]
    dns = v4.index("-A OUTPUT -d 127.0.0.11/32 -j REJECT --reject-with icmp-port-unreachable")
    assert dns < v4.index("-A OUTPUT -o lo -j ACCEPT")


def test_script_installs_reads_back_and_waits_for_the_guard() -> None:
    script = install_script("http://127.0.0.1:8790/v1/health")
    assert script.startswith("set -eu\n")
    assert "iptables -w -S OUTPUT" in script and "ip6tables -w -S OUTPUT" in script
    assert "curl -fsS --noproxy '*'" in script and script.rstrip().endswith("echo READY")
    assert len(expected_readback()) == sum(len(a) for a in rules().values())
