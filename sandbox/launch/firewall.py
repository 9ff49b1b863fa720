"""The run's firewall: the step's only way out is its guard.

Pure text: the rules the guard container's entry script installs, as root
holding NET_ADMIN for a moment before it drops to the guard's uid with no
capabilities at all, in the network namespace the guard owns, before the step
joins it. Everything the guard's uid sends may leave; the step
may talk to loopback (its guard, its own local servers) but not to the
engine's embedded DNS, and every other packet is REJECTed so a blocked
connection fails at once instead of hanging. IPv4 and IPv6 alike.
"""

from __future__ import annotations

import shlex

from sandbox.contracts.layout import GUARD_UID

# Docker's embedded resolver lives on loopback and would resolve outside names.
ENGINE_DNS_V4 = "127.0.0.11"
LOOPBACK_LOCAL = "-A OUTPUT -o lo -m addrtype --dst-type LOCAL -j ACCEPT"
LOOPBACK_SOURCE = "127.0.0.2"


def rules(guard_uid: int = GUARD_UID) -> dict[str, list[str]]:
    """iptables / ip6tables arguments for the OUTPUT chain, in order.

    Only the guard's uid is let out, and never uid 0: under gVisor every socket of
    the step belongs to the sentry, whose host uid is 0, so a rule accepting root
    would let the step out (and the guard itself runs as root for a moment)."""
    if guard_uid == 0:
        raise ValueError("the firewall never lets uid 0 out (the gVisor sentry is uid 0)")
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
            # Loopback to the namespace's own addresses, so the kernel's own TCP resets
            # and ICMP errors for a rejected connect reach the step at once. A packet
            # forced onto lo towards any other address (SO_BINDTODEVICE) would be
            # dropped at lo's far end and hang the client: it is reset here instead.
            LOOPBACK_LOCAL,
            *common_tail,
            "-A OUTPUT -j REJECT --reject-with icmp-port-unreachable",
        ],
        "ip6tables": [
            *common_head,
            # Neighbour discovery is sent by the kernel, not by any uid: without these
            # the guard's every IPv6 connect waits 3 s for a neighbour and fails. The
            # step cannot send them (no raw sockets; ICMP sockets are closed to it).
            "-A OUTPUT -p ipv6-icmp -m icmp6 --icmpv6-type 135 -j ACCEPT",
            "-A OUTPUT -p ipv6-icmp -m icmp6 --icmpv6-type 136 -j ACCEPT",
            LOOPBACK_LOCAL,
            *common_tail,
            "-A OUTPUT -j REJECT --reject-with icmp6-port-unreachable",
        ],
    }


# The guard's entry prints this after the rules are in and read back; the runner
# starts the step only once it has seen it.
READY_MARK = "FIREWALL-READY"


def restore_input(args: list[str]) -> str:
    """The rules as one `iptables-restore` table: one call installs them all at once.

    It replaces the whole filter table, which is right here: the namespace is the
    guard's own and new, so the table holds nothing else."""
    policy = {a.split()[1]: a.split()[2] for a in args if a.startswith("-P")}
    chains = [
        f":{chain} {policy.get(chain, 'ACCEPT')} [0:0]" for chain in ("INPUT", "FORWARD", "OUTPUT")
    ]
    return "\n".join(["*filter", *chains, *(a for a in args if a.startswith("-A")), "COMMIT"])


def _install_lines(guard_uid: int, *, install: bool) -> list[str]:
    """Shell lines that put the rules in the current network namespace in one go."""
    if not install:
        return []
    # A socket bound to lo (SO_BINDTODEVICE) connecting to an address not on lo gets
    # a source address of lo's link scope: with only 127.0.0.1 (host scope) there is
    # none, and the reset the rules send to 0.0.0.0 never arrives (the connect would
    # hang for its timeout). This address is the source such packets get instead.
    lines = [f"ip -4 addr add {LOOPBACK_SOURCE}/32 dev lo scope link"]
    for tool, args in rules(guard_uid).items():
        lines.append(f"{tool}-restore -w <<'RULES'")
        lines.append(restore_input(args))
        lines.append("RULES")
    return lines


def guard_entry_script(
    guard_command: list[str], guard_uid: int = GUARD_UID, *, install: bool = True
) -> str:
    """Shell the guard container starts with, as root holding NET_ADMIN for a moment.

    It installs the rules in the namespace the guard owns, prints them back, then
    drops to the guard's uid with every capability gone from all sets, the bounding
    set included, so neither the guard nor anything it starts (stdio MCP servers) can
    ever regain NET_ADMIN. tini stays pid 1 after the drop, reaping orphans.

    `install=False` exists only so tests can prove the preflight catches an open
    namespace; a real run always installs."""
    lines = ["set -eu", *_install_lines(guard_uid, install=install)]
    drop = [
        "setpriv",
        f"--reuid={guard_uid}",
        f"--regid={guard_uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--bounding-set=-all",
        "--",
        "tini",
        "--",
        *guard_command,
    ]
    lines += [
        "echo '--- rules ---'",
        "iptables -w -S OUTPUT",
        "ip6tables -w -S OUTPUT",
        f"echo {READY_MARK}",
        "exec " + " ".join(shlex.quote(part) for part in drop),
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


def init_container_script(guard_uid: int = GUARD_UID, *, install: bool = True) -> str:
    """Shell for a Pod's init container (root with NET_ADMIN and nothing else), in the
    network namespace the Pod's containers share: install the rules, print them back,
    and fail (so no container of the Pod ever starts) unless they read back exactly as
    `expected_readback()`. It ends there: the guard starts later as its own uid.

    `install=False` (tests of the preflight only) installs nothing and checks nothing."""
    expected = "\n".join(expected_readback())
    lines = ["set -eu", *_install_lines(guard_uid, install=install)]
    lines += [
        "echo '--- rules ---'",
        'got="$(iptables -w -S OUTPUT; ip6tables -w -S OUTPUT)"',
        "printf '%s\\n' \"$got\"",
    ]
    if install:
        lines += [
            "expected=$(cat <<'EXPECTED'",
            expected,
            "EXPECTED",
            ")",
            '[ "$got" = "$expected" ] || { echo "FIREWALL-MISMATCH"; exit 1; }',
        ]
    lines.append(f"echo {READY_MARK}")
    return "\n".join(lines) + "\n"
