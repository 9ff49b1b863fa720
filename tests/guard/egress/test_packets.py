"""The step's refused packets: the firewall's log read back (the kernel's wire format,
built here by hand), the guard's capped lines, and the record's list."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import struct
from pathlib import Path

from sandbox.collect.actionsummary import read
from sandbox.guard import nflog
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.egress import packets
from sandbox.guard.egress.packets import PacketRecorder
from sandbox.launch.firewall import guard_entry_script, nat6_rules


def _attr(kind: int, value: bytes) -> bytes:
    size = 4 + len(value)
    return struct.pack("=HH", size, kind) + value + b"\0" * (-size % 4)


def _message(packet: bytes, uid: int | None) -> bytes:
    """One NFULNL_MSG_PACKET as the kernel sends it: netlink head, nfgenmsg, attributes."""
    body = struct.pack("=BBH", socket.AF_INET, 0, socket.htons(34))
    body += _attr(1, b"\x08\x00\x03\x00")  # NFULA_PACKET_HDR: skipped
    if uid is not None:
        body += _attr(nflog.NFULA_UID, struct.pack("!I", uid))
    body += _attr(nflog.NFULA_PAYLOAD, packet)
    kind = (nflog.NFNL_SUBSYS_ULOG << 8) | nflog.NFULNL_MSG_PACKET
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0) + body


def _udp4(destination: str, port: int, payload: bytes) -> bytes:
    head = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 0, 0, 64, 17, 0,
                       socket.inet_aton("10.0.0.2"), socket.inet_aton(destination))  # fmt: skip
    return head + struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload


def _tcp6(destination: str, port: int) -> bytes:
    head = struct.pack("!IHBB", 6 << 28, 20, 6, 64)
    head += ipaddress.IPv6Address("fd00::2").packed + ipaddress.IPv6Address(destination).packed
    return head + struct.pack("!HH", 40000, port) + b"\0" * 16


def test_the_log_socket_reads_where_each_packet_was_aimed() -> None:
    data = _message(_udp4("10.9.8.7", 9999, b"secret"), 10001)
    data += _message(_tcp6("fd12:3456::5", 8080), 10001)
    data += _message(b"\x45short", None)  # not an IP packet: skipped
    got = nflog.packets(data)
    assert got == [
        nflog.Packet("udp", "10.9.8.7", 9999, 10001, b"secret"),
        nflog.Packet("tcp", "fd12:3456::5", 8080, 10001, b""),
    ]
    assert nflog.packets(data[:-3]) == got  # a cut message is not read
    assert nflog.packets(b"\xff" * 40) == []


def _recorded(tmp_path: Path, sent: list[nflog.Packet], canaries: list[str]) -> Path:
    path = tmp_path / "actions.jsonl"
    path.touch()
    log = ActionLog(str(path), secrets=())
    recorder = PacketRecorder(log, canaries)

    async def step() -> None:
        for packet in sent:
            await recorder.add(packet)

    asyncio.run(step())
    log.close()
    return path


def test_a_flood_is_counted_in_few_lines_and_the_record_lists_each_destination(
    tmp_path: Path,
) -> None:
    udp = nflog.Packet("udp", "10.9.8.7", 9999, 10001, b"secret")
    sent = [udp] * 100
    sent += [nflog.Packet("tcp", "fd12::5", 8080, 10001, b"")]
    sent += [nflog.Packet("icmp", "10.9.8.7", 0, 10001, b"")]
    sent += [nflog.Packet("icmp", "10.9.8.1", 0, None, b"")]  # the kernel's own error
    # The preflight's first datagram to its canary is its own; a second is the step's.
    sent += [nflog.Packet("udp", "10.0.0.9", 1, 10001, b"preflight")] * 2
    path = _recorded(tmp_path, sent, ["10.0.0.9:1"])
    lines = [json.loads(raw) for raw in path.read_text().splitlines()]
    flood = [ln for ln in lines if ln["arguments"]["destination"] == "10.9.8.7"]
    assert [ln["detail"]["count"] for ln in flood if ln["arguments"]["protocol"] == "udp"] == [
        1,
        2,
        4,
        8,
        16,
        32,
        64,
    ]
    assert all(ln["tool"] == "packet" and ln["decision"] == "refuse" for ln in lines)
    assert flood[0]["detail"]["first_bytes"] == 6
    summary = read(path)
    listed = {(p.protocol, p.destination, p.port): p.count for p in summary.packets.destinations}
    assert listed == {
        ("udp", "10.9.8.7", 9999): 64,
        ("tcp", "fd12::5", 8080): 1,
        ("icmp", "10.9.8.7", 0): 1,
        ("udp", "10.0.0.9", 1): 1,
    }
    assert summary.packets.attempts == 67


def test_destinations_past_the_cap_are_counted_under_one_key(tmp_path: Path) -> None:
    sent = [
        nflog.Packet("udp", f"10.1.{i // 250}.{i % 250}", 53000, 10001, b"")
        for i in range(packets.MAX_KEYS + 3)
    ]
    summary = read(_recorded(tmp_path, sent, []))
    assert len(summary.packets.destinations) == 200
    # 1000 destinations, then one `*` key for the rest: 1001 in the log.
    assert summary.packets.not_listed == packets.MAX_KEYS + 1 - 200
    # The `*` key's 3rd attempt is not a power of two: its count says 2 (at least).
    assert summary.packets.attempts == packets.MAX_KEYS + 2


def test_ipv6_is_logged_for_everyone_but_the_guard_and_never_accepted() -> None:
    rules = nat6_rules()
    assert rules[0] == "-A SANDBOX-STEP-OUT -m owner --uid-owner 10002 -j RETURN"
    assert rules[-1].endswith("-j NFLOG --nflog-group 34 --nflog-size 128")
    assert "! -d ::1/128" in rules[-1]
    assert not any("ACCEPT" in r or "REDIRECT" in r for r in rules)
    assert nat6_rules(redirect_root=True) == [rules[0], rules[-1]]
    script = guard_entry_script(["/opt/guard/bin/python", "-m", "sandbox.guard"])
    assert "ip6tables-restore -w --noflush <<'NAT'" in script
    assert "ip6tables -w -t nat -C OUTPUT -j SANDBOX-STEP-OUT" in script
    assert "sandbox.guard.nflogbind" not in guard_entry_script(["guard"], install=False)
