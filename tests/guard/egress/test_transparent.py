"""The pure parts of transparent egress: the firewall's nat rules, the first-bytes sniff,
the SNI peek, and the guard's DNS answers (no engine: the engine tests are in
tests/scenarios/test_transparent_engine.py)."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from dnslib import QTYPE, RCODE, DNSRecord

from sandbox.collect.actionsummary import read
from sandbox.contracts.record import RunStatus, TestRunRecord
from sandbox.contracts.wire import ActionLine
from sandbox.guard.actionlog import ActionLog
from sandbox.guard.egress.dns import PREFLIGHT_ZONE, DnsServer, Names, clean_name, preflight_proof
from sandbox.guard.egress.transparent import classify, server_name
from sandbox.guard.listeners import DNS_PORT, TRANSPARENT_PORT
from sandbox.launch.firewall import guard_entry_script, nat_rules
from sandbox.verify import html
from sandbox.verify.evidence import Call
from tests.guard.actionlogparts import write_line


def test_nat_redirects_everyone_but_the_guard_and_never_accepts() -> None:
    rules = nat_rules()
    assert rules[0] == "-A SANDBOX-STEP-OUT -m owner --uid-owner 10002 -j RETURN"
    # Under runc root's sockets are the engine's (its resolver forwarding a name it does
    # not know): left to the filter, which never lets root out. Under gVisor the step's
    # sockets are the sentry's, root's: redirected like the step's.
    assert rules[1] == "-A SANDBOX-STEP-OUT -m owner --uid-owner 0 -j RETURN"
    gvisor = nat_rules(redirect_root=True)
    assert gvisor == [rules[0], *rules[2:]]
    assert "--uid-owner 0 -j RETURN" in guard_entry_script(["guard"])
    assert "--uid-owner 0 " not in guard_entry_script(["guard"], redirect_root=True)
    assert not any("ACCEPT" in rule for rule in rules)
    assert any(
        f"--dport 53 -j REDIRECT --to-ports {DNS_PORT}" in r and "-p udp" in r for r in rules
    )
    assert any(
        f"--dport 53 -j REDIRECT --to-ports {DNS_PORT}" in r and "-p tcp" in r for r in rules
    )
    assert rules[-2].endswith(f"! -d 127.0.0.0/8 -p tcp -j REDIRECT --to-ports {TRANSPARENT_PORT}")
    # What is left (UDP but DNS, ICMP, ...) is copied to the guard's log group, then
    # meets the filter's REJECT.
    assert rules[-1].endswith("! -d 127.0.0.0/8 -j NFLOG --nflog-group 34 --nflog-size 128")
    with pytest.raises(ValueError):
        nat_rules(0)
    script = guard_entry_script(["guard"])
    assert "iptables-restore -w --noflush <<'NAT'" in script
    assert "-I OUTPUT 1 -j SANDBOX-STEP-OUT" in script
    assert "NAT" not in guard_entry_script(["guard"], install=False)


def _client_hello(name: str | None) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_the_first_bytes_say_what_a_connection_is() -> None:
    assert classify(b"GET / HTTP/1.1\r\n") == "http"
    assert classify(b"GE") is None  # still arriving
    hello = _client_hello("outside.test")
    assert classify(hello) == "tls"
    assert classify(hello[:20]) is None
    assert classify(b"SSH-2.0-OpenSSH_9.2\r\n") == "other"
    assert classify(b"\x00\x01binary") == "other"
    assert classify(b"AGENTWORKS-PREFLIGHT abc\n") == "probe"


def test_sni_is_read_from_a_real_client_hello() -> None:
    assert server_name(_client_hello("Outside.Test")) == "outside.test"
    assert server_name(_client_hello(None)) is None
    with pytest.raises(ValueError):
        server_name(b"\x16\x03\x01\x00\x05\x01\x00")
    with pytest.raises(ValueError):
        server_name(b"GET / HTTP/1.1\r\n")


class _NoLog:
    def __init__(self) -> None:
        self.lines: list[dict[str, object]] = []

    async def write(self, **fields: object) -> None:
        self.lines.append(fields)


def _ask(server: DnsServer, name: str, qtype: str) -> DNSRecord:
    reply, _ = server.answer(DNSRecord.question(name, qtype).pack(), "udp")
    assert reply is not None
    return DNSRecord.parse(reply)


def test_every_name_gets_a_guard_address_and_nothing_else_is_answered() -> None:
    names = Names()
    server = DnsServer(_NoLog(), names, "k" * 32)  # type: ignore[arg-type]
    first = _ask(server, "outside.test", "A")
    address = str(first.rr[0].rdata)
    assert address.startswith("198.18.") and names.name_of(address) == "outside.test"
    assert str(_ask(server, "OUTSIDE.test.", "A").rr[0].rdata) == address  # one per name
    secret = _ask(server, "s3cr3t.anything", "A")
    assert names.name_of(str(secret.rr[0].rdata)) == "s3cr3t.anything"
    assert _ask(server, "outside.test", "AAAA").rr == []
    for qtype in ("TXT", "MX", "ANY", "NS"):
        assert _ask(server, "s3cr3t.anything", qtype).header.rcode == RCODE.REFUSED
    assert _ask(server, "bad!name.test", "A").header.rcode == RCODE.REFUSED
    assert clean_name("a" * 64 + ".test") is None and clean_name("x." * 127 + "y") is None
    assert server.answer(b"\x00\x01garbage", "udp")[0] is None


def test_the_preflight_proof_is_answered_only_for_the_right_key() -> None:
    server = DnsServer(_NoLog(), Names(), "the-key-0123456789")  # type: ignore[arg-type]
    reply = _ask(server, f"nonce1.{PREFLIGHT_ZONE}", "TXT")
    assert reply.rr[0].rtype == QTYPE.TXT
    assert str(reply.rr[0].rdata).strip('"') == preflight_proof("the-key-0123456789", "nonce1")
    assert preflight_proof("other", "nonce1") != preflight_proof("the-key-0123456789", "nonce1")


def test_the_record_counts_every_lookup_and_how_each_host_was_reached(tmp_path: Path) -> None:
    """The guard's DNS lines and its egress lines (written by the real action log) become
    the record's DNS list and the per-host direct/proxy counts; a long name is cut and
    hashed, and a repeated (name, type) is listed once."""
    path = tmp_path / "actions.jsonl"
    path.touch()
    log = ActionLog(str(path), secrets=())
    server = DnsServer(log, Names(), "k" * 32)
    long_name = ".".join(["a" * 60] * 3) + ".test"

    async def step() -> None:
        for name, qtype in (
            ("outside.test", "A"),
            ("outside.test", "A"),
            ("outside.test", "AAAA"),
            ("s3cr3t.anything", "TXT"),
            (long_name, "A"),
        ):
            await server.handle(DNSRecord.question(name, qtype).pack(), "udp")
        for via in ("direct", "direct", "proxy"):
            await write_line(
                log,
                "http",
                session="egress",
                decision="allow",
                reason="a read",
                category="egress",
                arguments={"method": "GET"},
                duration_ms=1.0,
                detail={"host": "outside.test", "via": via},
            )

    asyncio.run(step())
    log.close()
    summary = read(path)
    assert summary.egress["outside.test"].direct == 2
    assert summary.egress["outside.test"].proxy == 1
    dns = summary.dns
    assert (dns.queries, dns.refused, dns.names_not_listed) == (5, 1, 0)
    listed = [(q.name, q.type, q.count) for q in dns.names]
    assert listed[:3] == [
        ("outside.test", "A", 2),
        ("outside.test", "AAAA", 1),
        ("s3cr3t.anything", "TXT", 1),
    ]
    assert dns.names[0].answer.startswith("198.18.") and dns.names[1].answer == "no records"
    assert dns.names[2].answer.startswith("REFUSED")
    cut = dns.names[3].name
    assert len(cut) < len(long_name) + 90 and long_name not in cut
    assert hashlib.sha256(long_name.encode()).hexdigest() in cut
    record = TestRunRecord(
        id="test-x",
        workflow_dir="/wf",
        workflow_name="wf",
        step_id="s",
        group="g",
        command="c",
        status=RunStatus.PASSED,
        started_at=datetime.now(UTC),
        egress=summary.egress,
        dns=dns,
    )
    text = "\n".join(record.summary_lines())
    assert "egress outside.test: 3 passed, 0 stubbed, 0 refused (2 direct, 1 through" in text
    assert "dns: 5 queries answered by the guard, 1 refused: outside.test A -> 198.18." in text


def test_the_html_report_shows_how_each_request_came_and_every_lookup() -> None:
    def call(n: int, **fields: Any) -> Call:
        line = ActionLine.model_validate(
            {"time": "2026-01-01T00:00:00Z", "session": "egress", "reason": "r", **fields}
        )
        return Call(n, line, line.model_dump_json())

    table = html._egress(
        [
            call(
                1,
                tool="http",
                decision="stub",
                arguments={"method": "GET", "url": "u1"},
                detail={"host": "h1", "via": "direct"},
            ),
            call(
                2,
                tool="http",
                decision="allow",
                arguments={"method": "GET", "url": "u2"},
                detail={"host": "h2", "via": "proxy"},
            ),
            call(
                3,
                tool="dns",
                decision="allow",
                arguments={"name": "s3cr3t.x", "type": "A"},
                detail={"answer": "198.18.0.7", "via": "direct"},
            ),
        ]
    )
    rows = table.split("<tr>")[2:]
    assert len(rows) == 3
    assert "direct" in rows[0] and "proxy" in rows[1]
    assert "s3cr3t.x A" in rows[2] and "198.18.0.7" in rows[2] and "DNS" in rows[2]
