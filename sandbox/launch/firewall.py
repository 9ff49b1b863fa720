"""The run's firewall: the step's only way out is its guard.

Pure text: the rules the guard container's entry script installs, as root
holding NET_ADMIN for a moment before it drops to the guard's uid with no
capabilities at all, in the network namespace the guard owns, before the step
joins it. Everything the guard's uid sends may leave; the step
may talk to loopback (its guard, its own local servers) but not to the
engine's embedded DNS, and every other packet is REJECTed so a blocked
connection fails at once instead of hanging. IPv4 and IPv6 alike.

In a Pod every container shares the one namespace (and its loopback), so a run with
stdio MCP servers there adds rules per uid (`PodPeers`): the step may open
connections only to the guard's ports, each server only to its own relay's proxy
port, and nothing else of either uid leaves or crosses loopback; replies of an
accepted connection pass by conntrack. Unix sockets are not packets: the guard's
are paths in folders only their server mounts, never abstract names.

Transparent egress (`nat_rules`, Docker runs and Pods alike): before any filter rule sees them,
every new TCP connection of any uid but the guard's to a non-loopback address is
REDIRECTed to the guard's interception port, and every DNS query (UDP or TCP port
53, to any address, the engine's resolver included) to the guard's DNS port. The
nat table only rewrites where a packet goes: nothing is ACCEPTed there; uid 0 is
redirected like the step when the step runs under gVisor (its sentry is uid 0), and
left to the filter rules under runc (see `nat_rules`); what is not redirected (UDP,
other protocols, root under runc) still meets the REJECT rules below. The last nat
rule of each family (IPv6 has no redirect at all) copies what the step sends and the
filter will reject to the netfilter log group the guard reads
(`sandbox.guard.nflog`), so every refused packet is on the record; the entry binds
that group while it still holds NET_ADMIN.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from sandbox.contracts.guardprocess import (
    DNS_PORT,
    FIREWALL_GATE_FD_ENV,
    FIREWALL_GATE_OK,
    FIREWALL_GATE_READ_FD,
    FIREWALL_GATE_WRITE_FD,
    NFLOG_GROUP,
    TRANSPARENT_PORT,
)
from sandbox.contracts.layout import GUARD_UID

# Docker's embedded resolver lives on loopback and would resolve outside names.
ENGINE_DNS_V4 = "127.0.0.11"
LOOPBACK_LOCAL = "-A OUTPUT -o lo -m addrtype --dst-type LOCAL -j ACCEPT"
LOOPBACK_SOURCE = "127.0.0.2"


@dataclass(frozen=True)
class PodPeers:
    """Who else shares the guard's network namespace (a Pod with stdio MCP servers).

    `servers` holds each server's uid and its relay's proxy port (None: the server
    has no egress list, so nothing of its uid may connect anywhere)."""

    step_uid: int
    guard_ports: tuple[int, ...]
    servers: tuple[tuple[int, int | None], ...]


# The guard's DNS hands out addresses from this range (RFC 2544's benchmark range,
# never a real host); a route on lo makes them reachable in a namespace with no
# other network, and the redirect below sends every connection to one to the guard.
SYNTHETIC_V4 = "198.18.0.0/15"
NAT_CHAIN = "SANDBOX-STEP-OUT"
# How much of each refused packet the log rule copies to the guard (headers and a
# datagram's first bytes): sandbox.guard.nflogbind.COPY_BYTES.
NFLOG_BYTES = 128
NFLOG = f"-j NFLOG --nflog-group {NFLOG_GROUP} --nflog-size {NFLOG_BYTES}"


def nat_rules(
    guard_uid: int = GUARD_UID, *, redirect_root: bool = False, only_uid: int | None = None
) -> list[str]:
    """iptables nat rules (own chain, jumped to first from OUTPUT): the guard's uid
    goes where it asked; everyone else's DNS goes to the guard's DNS port and every TCP
    connection to a non-loopback address to the guard's interception port.

    Root's sockets are redirected only with `redirect_root` (the step under gVisor,
    whose sentry is root). Under runc no process of the step is root; root's sockets
    in the namespace are the engine's own, above all its resolver forwarding a name it
    does not know (the guard's lookup of an upstream): redirected, that would come back
    with the guard's own synthetic answer and be recorded as the step's query. Not
    redirected, root meets the filter rules, which never let it out.

    `only_uid` (a Pod with stdio MCP servers): only the step's uid is redirected; each
    server's uid is left to its own filter rules (its relay's proxy, or nothing)."""
    if guard_uid == 0:
        raise ValueError("the firewall never exempts uid 0 (the gVisor sentry is uid 0)")
    chain = NAT_CHAIN
    return [
        f"-A {chain} -m owner --uid-owner {guard_uid} -j RETURN",
        *([] if redirect_root else [f"-A {chain} -m owner --uid-owner 0 -j RETURN"]),
        *([] if only_uid is None else [f"-A {chain} -m owner ! --uid-owner {only_uid} -j RETURN"]),
        f"-A {chain} -p udp -m udp --dport 53 -j REDIRECT --to-ports {DNS_PORT}",
        f"-A {chain} -p tcp -m tcp --dport 53 -j REDIRECT --to-ports {DNS_PORT}",
        f"-A {chain} ! -d 127.0.0.0/8 -p tcp -j REDIRECT --to-ports {TRANSPARENT_PORT}",
        # Whatever is left (UDP but DNS, ICMP, any other protocol) meets the filter's
        # REJECT; a copy of it goes to the guard first, which records the attempt.
        f"-A {chain} ! -d 127.0.0.0/8 {NFLOG}",
    ]


def nat6_rules(
    guard_uid: int = GUARD_UID, *, redirect_root: bool = False, only_uid: int | None = None
) -> list[str]:
    """ip6tables nat rules of the same shape: nothing is redirected over IPv6 (the
    filter resets TCP and REJECTs the rest at once); every packet of the step to a
    non-loopback address is copied to the guard's log group first, so the attempt is
    on the record. The conntrack match turns IPv6 connection tracking on, without
    which the nat table sees no packet; a refused packet is never confirmed, so each
    one is new."""
    if guard_uid == 0:
        raise ValueError("the firewall never exempts uid 0 (the gVisor sentry is uid 0)")
    chain = NAT_CHAIN
    return [
        f"-A {chain} -m owner --uid-owner {guard_uid} -j RETURN",
        *([] if redirect_root else [f"-A {chain} -m owner --uid-owner 0 -j RETURN"]),
        *([] if only_uid is None else [f"-A {chain} -m owner ! --uid-owner {only_uid} -j RETURN"]),
        f"-A {chain} ! -d ::1/128 -m conntrack --ctstate NEW {NFLOG}",
    ]


def _nat_lines(guard_uid: int, *, redirect_root: bool, only_uid: int | None = None) -> list[str]:
    """Shell lines that add the nat rules beside the engine's own (its resolver's DNAT
    for the guard stays: `--noflush`), then check that OUTPUT jumps to their chain
    (`-C`) and that the chain reads back exactly as written (`-S`: the rule texts are
    in the canonical form it prints). One read-back per family, not one `-C` per rule:
    each is a process on the way to the guard's start."""
    v4 = nat_rules(guard_uid, redirect_root=redirect_root, only_uid=only_uid)
    v6 = nat6_rules(guard_uid, redirect_root=redirect_root, only_uid=only_uid)
    table = ["*nat", f":{NAT_CHAIN} - [0:0]", f"-I OUTPUT 1 -j {NAT_CHAIN}", *v4]
    lines = [f"ip route add {SYNTHETIC_V4} dev lo", "iptables-restore -w --noflush <<'NAT'"]
    lines += [*table, "COMMIT", "NAT"]
    table6 = ["*nat", f":{NAT_CHAIN} - [0:0]", f"-I OUTPUT 1 -j {NAT_CHAIN}", *v6]
    lines += ["ip6tables-restore -w --noflush <<'NAT'", *table6, "COMMIT", "NAT"]
    for tool, chain in (("iptables", v4), ("ip6tables", v6)):
        lines.append(f"{tool} -w -t nat -C OUTPUT -j {NAT_CHAIN}")
        expected = shlex.quote("\n".join([f"-N {NAT_CHAIN}", *chain]))
        lines.append(
            f'[ "$({tool} -w -t nat -S {NAT_CHAIN})" = {expected} ]'
            ' || { echo "FIREWALL-MISMATCH"; exit 1; }'
        )
    return lines


NAMESERVER_ROUTES = (
    "for ns in $(awk '/^nameserver/ {print $2}' /etc/resolv.conf 2>/dev/null); do"
    ' ip route get "$ns" >/dev/null 2>&1 || ip route add "$ns" dev lo; done'
)


REDIRECTED = [
    f"-A OUTPUT -d 127.0.0.1/32 -p {proto} -m conntrack --ctstate DNAT -m {proto} --dport {port}"
    " -j ACCEPT"
    for proto, port in (("tcp", TRANSPARENT_PORT), ("udp", DNS_PORT), ("tcp", DNS_PORT))
]


ESTABLISHED = "-A OUTPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"


def _to_port(uid: int, port: int) -> str:
    # The order `iptables -S` prints: the protocol before the owner match.
    return f"-A OUTPUT -o lo -p tcp -m owner --uid-owner {uid} -m tcp --dport {port} -j ACCEPT"


def _reject_uid(uid: int, unreachable: str) -> list[str]:
    return [
        f"-A OUTPUT -p tcp -m owner --uid-owner {uid} -j REJECT --reject-with tcp-reset",
        f"-A OUTPUT -m owner --uid-owner {uid} -j REJECT --reject-with {unreachable}",
    ]


def _peer_rules(peers: PodPeers | None, unreachable: str) -> list[str]:
    """The per-uid rules of a shared namespace: what each uid may open, then nothing."""
    if peers is None:
        return []
    uids = [peers.step_uid, *(uid for uid, _ in peers.servers)]
    if 0 in uids or len(set(uids)) != len(uids):
        raise ValueError(f"the Pod's uids must be distinct and not root: {uids}")
    out = [ESTABLISHED]
    out += [_to_port(peers.step_uid, port) for port in peers.guard_ports]
    out += _reject_uid(peers.step_uid, unreachable)
    for uid, port in peers.servers:
        out += [_to_port(uid, port)] if port is not None else []
        out += _reject_uid(uid, unreachable)
    return out


def rules(guard_uid: int = GUARD_UID, peers: PodPeers | None = None) -> dict[str, list[str]]:
    """iptables / ip6tables arguments for the OUTPUT chain, in order.

    Only the guard's uid is let out, and never uid 0: under gVisor every socket of
    the step belongs to the sentry, whose host uid is 0, so a rule accepting root
    would let the step out (and the guard itself runs as root for a moment).
    With `peers` (a Pod's shared namespace), the per-uid rules come right after the
    guard's: packets no socket owns (the kernel's resets, neighbour discovery) still
    meet the rules below them as today."""
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
            # What the nat rules redirected to the guard's ports (in a Pod only the
            # step's are): before the per-uid rules, which would reject the step's. Not
            # by `-o lo`: a packet first routed out of another interface keeps that one
            # as its output device in this chain, though it now goes to loopback.
            *(REDIRECTED if peers else []),
            *_peer_rules(peers, "icmp-port-unreachable"),
            f"-A OUTPUT -d {ENGINE_DNS_V4}/32 -j REJECT --reject-with icmp-port-unreachable",
            *([] if peers else REDIRECTED),
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
            *_peer_rules(peers, "icmp6-port-unreachable"),
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


# The guard's entry prints this after the rules are in and read back right; the
# runner goes on only once it has seen it. The read-back comes after RULES_MARK.
READY_MARK = "FIREWALL-READY"
RULES_MARK = "--- rules ---"


def installed_rules(output: list[str]) -> list[str]:
    """The rules the entry script printed back: the `-P`/`-A` lines of its last
    read-back block (after the last RULES_MARK, up to the ready mark).

    The engine's attach sends the output printed so far and then the live output, and
    on a loaded engine the two can overlap, so the whole block may come twice (seen
    under `make bench-load`); its last copy is the read-back. A block that is cut short
    or mixed with anything else reads back wrong, and the run fails closed."""
    marks = [i for i, line in enumerate(output) if line == RULES_MARK]
    if not marks:
        return []
    block: list[str] = []
    for line in output[marks[-1] + 1 :]:
        if line == READY_MARK:
            break
        if line.startswith(("-P", "-A")):
            block.append(line)
    return block


def restore_input(args: list[str]) -> str:
    """The rules as one `iptables-restore` table: one call installs them all at once.

    It replaces the whole filter table, which is right here: the namespace is the
    guard's own and new, so the table holds nothing else."""
    policy = {a.split()[1]: a.split()[2] for a in args if a.startswith("-P")}
    chains = [
        f":{chain} {policy.get(chain, 'ACCEPT')} [0:0]" for chain in ("INPUT", "FORWARD", "OUTPUT")
    ]
    return "\n".join(["*filter", *chains, *(a for a in args if a.startswith("-A")), "COMMIT"])


def _install_lines(guard_uid: int, *, install: bool, peers: PodPeers | None = None) -> list[str]:
    """Shell lines that put the rules in the current network namespace in one go."""
    if not install:
        return []
    # A socket bound to lo (SO_BINDTODEVICE) connecting to an address not on lo gets
    # a source address of lo's link scope: with only 127.0.0.1 (host scope) there is
    # none, and the reset the rules send to 0.0.0.0 never arrives (the connect would
    # hang for its timeout). This address is the source such packets get instead.
    lines = [f"ip -4 addr add {LOOPBACK_SOURCE}/32 dev lo scope link"]
    for tool, args in rules(guard_uid, peers).items():
        lines.append(f"{tool}-restore -w <<'RULES'")
        lines.append(restore_input(args))
        lines.append("RULES")
    return lines


def guard_entry_script(
    guard_command: list[str],
    guard_uid: int = GUARD_UID,
    *,
    install: bool = True,
    redirect_root: bool = False,
) -> str:
    """Shell the guard container starts with, as root holding NET_ADMIN for a moment.

    Its install (a subshell) installs the rules in the namespace the guard owns, prints
    them back and checks them against `expected_readback()`, then opens the guard's
    gate. It runs beside the drop, so the guard's interpreter loads its modules
    meanwhile; the guard binds nothing before the gate
    says `ok`, and a mismatch ends the script without it (the guard exits, it never
    listens, and the step's executor, which starts the step only once the guard
    listens, never does). The drop is to the guard's uid with every capability gone
    from all sets, the bounding set included, so neither the guard nor anything it
    starts (stdio MCP servers) can ever regain NET_ADMIN. tini stays pid 1 after the
    drop, reaping orphans (the finished install subshell too).

    `install=False` exists only so tests can prove the preflight catches an open
    namespace; a real run always installs. `redirect_root`: see `nat_rules`."""
    lines = [*_install_lines(guard_uid, install=install)]
    lines += _nat_lines(guard_uid, redirect_root=redirect_root) if install else []
    lines += _checked_readback(install=install, peers=None)
    if not install:
        drop = _drop_line(guard_command, guard_uid, bind_nflog=False)
        return "\n".join(["set -eu", *lines, drop]) + "\n"
    return (
        "\n".join(
            ["set -eu", *_gated(lines), _drop_line(guard_command, guard_uid, bind_nflog=True)]
        )
        + "\n"
    )


def _gated(install: list[str]) -> list[str]:
    """The install (`install`: shell lines) in a subshell beside the drop, joined to the
    guard by a pipe (a FIFO in a private folder, opened at both ends, then deleted): the
    subshell writes `ok` to it last, so only once every line before succeeded; the
    entry keeps the read end alone (it opens it after the subshell holds the write
    end, and no write end) and hands it to the guard."""
    write, read = FIREWALL_GATE_WRITE_FD, FIREWALL_GATE_READ_FD
    opened = shlex.quote(FIREWALL_GATE_OK.decode().strip())
    return [
        'gate_dir="$(mktemp -d)"',
        'mkfifo -m 600 "$gate_dir/gate"',
        f'( exec {write}>"$gate_dir/gate"',
        *install,
        f"echo {opened} >&{write}",
        ") &",
        f'exec {read}<"$gate_dir/gate"',
        'rm -r "$gate_dir"',
        f"export {FIREWALL_GATE_FD_ENV}={read}",
    ]


def pod_guard_entry_script(
    guard_command: list[str], guard_uid: int = GUARD_UID, *, install: bool = True
) -> str:
    """Shell a Pod's guard container starts with, as root holding the same capabilities
    as Docker's guard entry (`specs.GUARD_ENTRY_CAPS`): the init container has already
    installed the rules, so it only binds the refused packets' log group and drops,
    exactly as the end of `guard_entry_script` does (one code path for both)."""
    return "\n".join(["set -eu", _drop_line(guard_command, guard_uid, bind_nflog=install)]) + "\n"


def _drop_line(guard_command: list[str], guard_uid: int, *, bind_nflog: bool) -> str:
    """The entry's last line: (bind the log group, then) drop to the guard's uid with
    every capability gone from all sets and exec tini and the guard."""
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
    if bind_nflog:
        # Bound to the refused packets' log group while NET_ADMIN is still held; the
        # guard inherits the socket (`sandbox.guard.nflogbind`; `sandbox.guard.nflog`
        # reads it). guard_command[0] is the guard image's Python.
        drop = [guard_command[0], "-m", "sandbox.guard.nflogbind", *drop]
    return "exec " + " ".join(shlex.quote(part) for part in drop)


def expected_readback(peers: PodPeers | None = None) -> list[str]:
    """The `-S OUTPUT` lines a correct install prints (both families, in order).

    The rule texts above are written in the canonical order `iptables -S` prints."""
    out: list[str] = []
    for args in rules(GUARD_UID, peers).values():
        policy = [a for a in args if a.startswith("-P")]
        out.extend(policy)
        out.extend(a for a in args if a.startswith("-A"))
    return out


def init_container_script(
    guard_uid: int = GUARD_UID, *, install: bool = True, peers: PodPeers | None = None
) -> str:
    """Shell for a Pod's init container (root with NET_ADMIN and nothing else), in the
    network namespace the Pod's containers share: install the rules, print them back,
    and fail (so no container of the Pod ever starts) unless they read back exactly as
    `expected_readback()`. It ends there: the guard starts later as its own uid.

    The nat rules are Docker's (transparent egress and the guard's DNS), for the
    step's uid only when stdio MCP servers share the Pod. The Pod's guard binds the
    refused packets' log group itself, at its own start (`pod_guard_entry_script`).

    `install=False` (tests of the preflight only) installs nothing and checks nothing."""
    lines = ["set -eu", *_install_lines(guard_uid, install=install, peers=peers)]
    if install:
        only = peers.step_uid if peers is not None else None
        lines += _nat_lines(guard_uid, redirect_root=False, only_uid=only)
        # A query is redirected only once it is routed: a nameserver the Pod has no
        # route to (a cluster without DNS, a Pod without a default route) would fail
        # the step's lookups at once (ENETUNREACH) before the guard's DNS saw them.
        # A route on lo makes it routable; no one listens there but the redirect.
        lines.append(NAMESERVER_ROUTES)
    return "\n".join([*lines, *_checked_readback(install=install, peers=peers)]) + "\n"


def _checked_readback(*, install: bool, peers: PodPeers | None) -> list[str]:
    """Shell lines that print the rules back (the runner compares them too) and, when
    they were installed, end the script unless they read back exactly as expected; the
    ready mark comes last."""
    lines = [
        f"echo {shlex.quote(RULES_MARK)}",
        'got="$(iptables -w -S OUTPUT; ip6tables -w -S OUTPUT)"',
        "printf '%s\\n' \"$got\"",
    ]
    if install:
        lines += [
            "expected=$(cat <<'EXPECTED'",
            *expected_readback(peers),
            "EXPECTED",
            ")",
            '[ "$got" = "$expected" ] || { echo "FIREWALL-MISMATCH"; exit 1; }',
        ]
    lines.append(f"echo {READY_MARK}")
    return lines
