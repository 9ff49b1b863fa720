"""Reading the action log back on the host, for the record's opening summary.

The log is written by the guard alone (the runner makes it 0600 for the guard's
uid, and no other process of the run has that uid or the file), but the host
still reads it as untrusted input: opened without following links,
size-capped, every line validated, and lines that do not parse are counted,
never trusted. Each call counts once: its one `call` line, or the `start` line
of a forwarded call; a `start` with no `outcome` is reported as started,
outcome unknown. Stubbed calls are grouped by tool (`stubgroups`): every one is
counted, and every distinct tool is listed or counted as cut.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from sandbox.collect.stubgroups import StubGrouper
from sandbox.contracts.record import (
    DNS_MAX_LISTED,
    DNS_MAX_NAME_CHARS,
    PACKETS_MAX_LISTED,
    ActionCounts,
    DnsQueries,
    DnsQuery,
    EgressCounts,
    RefusedPacket,
    RefusedPackets,
    StubbedAction,
    StubbedCut,
    UnfinishedCall,
)
from sandbox.contracts.wire import ActionLine

MAX_LOG_BYTES = 64 * 1024 * 1024
# The unfinished calls listed by name (all are counted): only a guard that died
# mid-call leaves any, and it had at most its connection limit in flight.
MAX_UNFINISHED_LISTED = 500


@dataclass
class ActionSummary:
    stubbed: list[StubbedAction] = field(default_factory=list)
    stubbed_cut: StubbedCut = field(default_factory=StubbedCut)
    counts: ActionCounts = field(default_factory=ActionCounts)
    fails_step: str = ""
    egress: dict[str, EgressCounts] = field(default_factory=dict)
    outcome_unknown: list[UnfinishedCall] = field(default_factory=list)
    dns: DnsQueries = field(default_factory=DnsQueries)
    _dns_seen: dict[tuple[str, str], DnsQuery] = field(default_factory=dict)
    packets: RefusedPackets = field(default_factory=RefusedPackets)
    _packet_counts: dict[tuple[str, str, int], int] = field(default_factory=dict)


def _detail(line: ActionLine) -> str:
    """A short, human hint of what the call would have done."""
    args = line.arguments
    for key in ("command", "channel", "to", "job_id", "url", "sql", "text"):
        if key in args:
            return f"{key}={json.dumps(args[key])[:80]}"
    return ""


def read(path: Path) -> ActionSummary:
    summary = ActionSummary()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return summary
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return summary
        data = handle.read(MAX_LOG_BYTES + 1)
    summary.counts.truncated = len(data) > MAX_LOG_BYTES
    summary.counts.redirect_write = 0
    started: dict[str, ActionLine] = {}
    stubs = StubGrouper(_detail)
    for lineno, raw in enumerate(data[:MAX_LOG_BYTES].splitlines(), start=1):
        try:
            line = ActionLine.model_validate_json(raw)
        except ValidationError:
            summary.counts.malformed += 1
            continue
        if line.event == "log_full":
            summary.counts.log_full = True
            unlogged = line.detail.get("stubbed_unlogged")
            if isinstance(unlogged, int) and not isinstance(unlogged, bool):
                summary.counts.stubbed_unlogged = unlogged
            continue
        if line.event == "outcome":
            begun = started.pop(line.call_id or "", None)
            if begun is None or begun.tool != line.tool:
                summary.counts.malformed += 1  # an outcome of no call the log started
            elif line.outcome == "error":
                summary.counts.outcome_error += 1
            continue
        if line.event == "start":
            if not line.call_id or line.call_id in started:
                summary.counts.malformed += 1
                continue
            started[line.call_id] = line
        _count(summary, line)
        if line.decision == "stub":
            stubs.add(lineno, line)
    summary.stubbed, summary.stubbed_cut = stubs.result()
    for line in started.values():
        if len(summary.outcome_unknown) < MAX_UNFINISHED_LISTED:
            summary.outcome_unknown.append(
                UnfinishedCall(
                    call_id=line.call_id or "",
                    tool=line.tool,
                    decision=line.decision,
                    reason=line.reason,
                    started_at=line.time,
                    detail=_detail(line),
                )
            )
    summary.counts.outcome_unknown = len(started)
    return summary


def _count(summary: ActionSummary, line: ActionLine) -> None:
    """One call: its decision, a write into the DB copy, egress per host, a refusal that
    fails the step."""
    summary.counts.add(line.decision)
    if line.decision == "redirect" and _writes(line):
        summary.counts.redirect_write = (summary.counts.redirect_write or 0) + 1
    if line.tool == "http" and line.session == "egress":
        counts = summary.egress.setdefault(str(line.detail.get("host", "")), EgressCounts())
        if line.decision == "allow":
            counts.passed += 1
        elif line.decision == "stub":
            counts.stubbed += 1
        else:
            counts.refused += 1
        if line.detail.get("via") == "direct":
            counts.direct += 1
        else:
            counts.proxy += 1
    if line.tool == "dns" and line.session == "egress":
        _count_dns(summary, line)
    if line.tool == "packet" and line.session == "egress":
        _count_packet(summary, line)
    if line.detail.get("fails_step") and not summary.fails_step:
        summary.fails_step = f"{line.tool} was refused in test mode: {line.reason}"


def _writes(line: ActionLine) -> bool:
    """A redirected call that may write the DB copy: its SQL is not a read (the policy's
    own classifier), or it carries no SQL to tell."""
    from sandbox.policy import SqlKind, classify_sql  # a run loads the policy only if used

    sql = line.arguments.get("sql")
    return not isinstance(sql, str) or classify_sql(sql) is not SqlKind.READ


def _short(value: object) -> str:
    """A name or answer from the log, cut past DNS_MAX_NAME_CHARS with the whole value's
    SHA-256 (the log is read as untrusted input: nothing long goes into the record)."""
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) <= DNS_MAX_NAME_CHARS:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    cut = len(text) - DNS_MAX_NAME_CHARS
    return f"{text[:DNS_MAX_NAME_CHARS]}[... {cut} chars cut; sha256 {digest}]"


def _count_dns(summary: ActionSummary, line: ActionLine) -> None:
    """One query of the step to the guard's DNS: counted, and its (name, type) listed
    once, up to DNS_MAX_LISTED."""
    dns = summary.dns
    dns.queries += 1
    dns.refused += line.decision == "refuse"
    key = (_short(line.arguments.get("name", "")), _short(line.arguments.get("type", "")))
    known = summary._dns_seen.get(key)
    if known is None:
        if len(dns.names) >= DNS_MAX_LISTED:
            dns.names_not_listed += 1
            summary._dns_seen[key] = DnsQuery(name=key[0], type=key[1])  # counted once
            return
        known = DnsQuery(name=key[0], type=key[1], answer=_short(line.detail.get("answer", "")))
        summary._dns_seen[key] = known
        dns.names.append(known)
    known.count += 1


def _count_packet(summary: ActionSummary, line: ActionLine) -> None:
    """A refused packet's line: the guard writes one at each power of two of a
    destination's count, so a destination's highest count is its count, and `attempts`
    gains what that rises by."""
    packets = summary.packets
    if line.detail.get("lost") is True:
        packets.counts_short = True
        return
    port = line.arguments.get("port", 0)
    count = line.detail.get("count", 1)
    key = (
        _short(line.arguments.get("protocol", "")),
        _short(line.arguments.get("destination", "")),
        port if isinstance(port, int) and not isinstance(port, bool) else 0,
    )
    count = count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
    before = summary._packet_counts.get(key)
    if before is None:
        before = 0
        if len(packets.destinations) < PACKETS_MAX_LISTED:
            packets.destinations.append(
                RefusedPacket(protocol=key[0], destination=key[1], port=key[2])
            )
        else:
            packets.not_listed += 1
    if count > before:
        summary._packet_counts[key] = count
        packets.attempts += count - before
        for entry in packets.destinations:
            if (entry.protocol, entry.destination, entry.port) == key:
                entry.count = count
                break
