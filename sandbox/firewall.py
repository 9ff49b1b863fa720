"""The run's firewall: the step's only way out is its guard.

Pure text: the rules a short-lived init container (the only holder of
NET_ADMIN, for a moment) installs in the network namespace the guard owns,
before the step joins it. Everything the guard's uid sends may leave; the step
may talk to loopback (its guard, its own local servers) but not to the
engine's embedded DNS, and every other packet is REJECTed so a blocked
connection fails at once instead of hanging. IPv4 and IPv6 alike.
"""

from __future__ import annotations

from sandbox.layout import GUARD_UID

# Docker's embedded resolver lives on loopback and would resolve outside names.
ENGINE_DNS_V4 = "127.0.0.11"


def rules(guard_uid: int = GUARD_UID) -> dict[str, list[str]]:
    """iptables / ip6tables arguments for the OUTPUT chain, in order."""
    common_head = [
        "-P OUTPUT DROP",
        f"-A OUTPUT -m owner --uid-owner {guard_uid} -j ACCEPT",
    ]
    common_tail = [
        "-A OUTPUT -p tcp -j REJECT --reject-with tcp-reset",
    ]
    return {
        "iptables": [
            *common_head,
            f"-A OUTPUT -d {ENGINE_DNS_V4}/32 -j REJECT --reject-with icmp-port-unreachable",
            # All loopback, so the kernel's own TCP resets and ICMP errors for a
            # rejected connect reach the step at once instead of being dropped.
            "-A OUTPUT -o lo -j ACCEPT",
            *common_tail,
            "-A OUTPUT -j REJECT --reject-with icmp-port-unreachable",
        ],
        "ip6tables": [
            *common_head,
            "-A OUTPUT -o lo -j ACCEPT",
            *common_tail,
            "-A OUTPUT -j REJECT --reject-with icmp6-port-unreachable",
        ],
    }


def install_script(guard_health_url: str, deadline_s: float = 30.0, *, install: bool = True) -> str:
    """Shell run by the init container: install, read back, wait for the guard.

    `install=False` exists only so tests can prove the preflight catches an open
    namespace; a real run always installs."""
    lines = ["set -eu"]
    for tool, args in rules().items() if install else ():
        lines.append(f"{tool} -w -F OUTPUT")
        lines.extend(f"{tool} -w {a}" for a in args)
    lines += [
        "echo '--- rules ---'",
        "iptables -w -S OUTPUT",
        "ip6tables -w -S OUTPUT",
        # The guard answers health on loopback once it is ready to serve.
        f"end=$(( $(date +%s) + {int(deadline_s)} ))",
        f"until curl -fsS --noproxy '*' -o /dev/null {guard_health_url}; do",
        '  [ "$(date +%s)" -lt "$end" ] || { echo "guard not ready" >&2; exit 3; }',
        "  sleep 0.05",
        "done",
        "echo READY",
    ]
    return "\n".join(lines) + "\n"


def expected_readback() -> list[str]:
    """The `-S OUTPUT` lines a correct install prints (both families, in order).

    The rule texts above are written in the canonical order `iptables -S` prints."""
    out: list[str] = []
    for args in rules().values():
        policy = [a for a in args if a.startswith("-P")]
        out.extend(policy)
        out.extend(a for a in args if a.startswith("-A"))
    return out
