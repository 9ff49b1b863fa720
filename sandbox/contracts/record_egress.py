"""What the step tried to reach, as the record holds it: egress per host, the DNS
queries the guard answered, and the packets the firewall refused.

Part of the record's contract (`sandbox.contracts.record` re-exports every model), so
they change only with the record's schema.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from sandbox.contracts.defaults import empty_list


class EgressCounts(BaseModel):
    """Egress requests of one host: passed (allowed), stubbed, refused; and how the step
    reached the guard with them: `proxy` (it used the proxy variables) or `direct` (the
    firewall redirected a connection it opened itself)."""

    passed: int = Field(default=0, description="Requests allowed and forwarded.")
    stubbed: int = Field(default=0, description="Requests stubbed (they never left).")
    refused: int = Field(default=0, description="Requests refused.")
    direct: int = Field(
        default=0, description="Requests that reached the guard straight (redirected)."
    )
    proxy: int = Field(default=0, description="Requests that came through the explicit proxy.")


DNS_MAX_LISTED = 200
DNS_MAX_NAME_CHARS = 120


class DnsQuery(BaseModel):
    """One distinct (name, type) the step asked the guard's DNS, with its first answer
    and how many times it was asked. A name past `DNS_MAX_NAME_CHARS` is cut, with the
    SHA-256 of the whole name, as action-log arguments are."""

    name: str = Field(description="The name asked (cut past 120 characters, with its SHA-256).")
    type: str = Field(description="The record type asked (A, AAAA, TXT, ...).")
    answer: str = Field(default="", description="The guard's first answer to it.")
    count: int = Field(default=0, description="How many times it was asked.")


class DnsQueries(BaseModel):
    """Every DNS query of the step: all answered by the guard's own DNS (none leaves the
    run). `queries` counts them, `refused` those refused; `names` lists the first
    `DNS_MAX_LISTED` distinct (name, type) pairs, `names_not_listed` how many more there were."""

    queries: int = Field(default=0, description="Every query the step made.")
    refused: int = Field(default=0, description="Queries refused.")
    names: list[DnsQuery] = Field(
        default_factory=empty_list, description="The first 200 distinct (name, type) pairs asked."
    )
    names_not_listed: int = Field(
        default=0, description="Distinct (name, type) pairs past the listed ones."
    )


PACKETS_MAX_LISTED = 200


class RefusedPacket(BaseModel):
    """Where the step aimed packets the firewall refused at once: one protocol,
    destination and port (0: a protocol without ports), and how many."""

    protocol: str = Field(description="udp, icmp, icmpv6, tcp (over IPv6), ...")
    destination: str = Field(description="The address aimed at (`*`: past the guard's cap).")
    port: int = Field(default=0, description="The port aimed at (0: the protocol has none).")
    count: int = Field(
        default=0,
        description=(
            "Attempts counted: exact up to 2, then at least this many (the guard logs"
            " the 1st, 2nd, 4th, 8th... attempt)."
        ),
    )


class RefusedPackets(BaseModel):
    """What the step sent that is neither TCP over IPv4 nor DNS (UDP, ICMP, anything over
    IPv6): refused by the firewall at once, nothing of it left the run or was answered,
    and each (protocol, destination, port) is listed here with its count."""

    attempts: int = Field(default=0, description="Every refused packet counted.")
    destinations: list[RefusedPacket] = Field(
        default_factory=empty_list,
        description="The first 200 distinct (protocol, destination, port) aimed at.",
    )
    not_listed: int = Field(default=0, description="Distinct destinations past the listed ones.")
    counts_short: bool = Field(
        default=False,
        description="Packets came faster than the guard read them: counts are too low.",
    )
