"""The firewall rules (pure): what the guard's entry script installs and reads back."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from sandbox.contracts.layout import GUARD_UID
from sandbox.launch.firewall import (
    NAT_CHAIN,
    READY_MARK,
    RULES_MARK,
    expected_readback,
    guard_entry_script,
    installed_rules,
    nat6_rules,
    nat_rules,
    rules,
)


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
    readback = lines.index('got="$(iptables -w -S OUTPUT; ip6tables -w -S OUTPUT)"')
    # The guard starts only if the rules read back exactly as expected.
    expected = lines.index("expected=$(cat <<'EXPECTED'")
    assert readback < expected
    assert lines[expected + 1 : lines.index("EXPECTED", expected)] == expected_readback()
    check = lines.index('[ "$got" = "$expected" ] || { echo "FIREWALL-MISMATCH"; exit 1; }')
    assert lines[check + 1] == f"echo {READY_MARK}"
    # The log group's socket is bound while NET_ADMIN is held, then the drop.
    assert lines[-1].startswith("exec guard -m sandbox.guard.nflogbind setpriv ")
    assert lines[-1].endswith("-- tini -- guard --x")
    assert lines.index(f"echo {READY_MARK}") == len(lines) - 2
    subprocess.run(["sh", "-n"], input=script, text=True, check=True)
    assert len(expected_readback()) == sum(len(a) for a in rules().values())


def test_without_install_the_script_still_reads_back_and_drops() -> None:
    """The test-only open namespace: no rules, the same drop (the preflight must catch it)."""
    script = guard_entry_script(["guard"], install=False)
    assert "-restore" not in script and "exec setpriv " in script


def _read_back(filter_rules: list[str], nat_chain: list[str]) -> str:
    """A stand-in iptables tool: `-C` finds the rule; `-t nat -S` prints the nat chain,
    any other `-S` the filter's OUTPUT."""
    nat = " ".join(shlex.quote(a) for a in [f"-N {NAT_CHAIN}", *nat_chain])
    out = " ".join(shlex.quote(a) for a in filter_rules)
    return (
        'case "$*" in *" -C "*) exit 0;; *"-t nat -S"*) printf \'%s\\n\' '
        + nat
        + ";; *) printf '%s\\n' "
        + out
        + ";; esac"
    )


def _run_entry_script(
    tmp_path: Path, readback_v4: list[str], nat_v4: list[str] | None = None
) -> tuple[int, str, bool]:
    """The entry script under `sh`, with stand-ins for ip, the iptables tools and setpriv
    on PATH (the real ones need NET_ADMIN): its exit code, its output, whether it
    went on to start the guard. `nat_v4`: what the nat chain reads back (default: its
    rules as written)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started = tmp_path / "guard-started"
    v4, v6 = rules().values()
    stand_ins = {
        "ip": "exit 0",
        "iptables-restore": "cat > /dev/null",
        "ip6tables-restore": "cat > /dev/null",
        "iptables": _read_back(readback_v4, nat_rules() if nat_v4 is None else nat_v4),
        "ip6tables": _read_back(expected_readback()[len(v4) :], nat6_rules()),
        "setpriv": f"touch {shlex.quote(str(started))}",
        "guard": 'shift 2; exec "$@"',  # the guard's Python binding the log group
    }
    assert len(v6) == len(expected_readback()) - len(v4)
    for name, body in stand_ins.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    done = subprocess.run(
        ["/bin/sh", "-c", guard_entry_script(["guard"])],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.returncode, done.stdout, started.exists()


def test_the_guard_starts_only_after_the_rules_read_back_right(tmp_path: Path) -> None:
    code, out, started = _run_entry_script(
        tmp_path, expected_readback()[: len(rules()["iptables"])]
    )
    assert (code, started) == (0, True), out
    assert out.splitlines()[-1] == READY_MARK


def test_a_wrong_readback_ends_the_script_before_the_guard(tmp_path: Path) -> None:
    """The step's executor starts the step only once the guard listens: a guard that
    never starts keeps the step from ever running."""
    wrong = expected_readback()[: len(rules()["iptables"]) - 1]  # the last rule missing
    code, out, started = _run_entry_script(tmp_path, wrong)
    assert (code, started) == (1, False), out
    assert "FIREWALL-MISMATCH" in out and READY_MARK not in out


def test_a_nat_chain_that_reads_back_with_a_rule_more_ends_the_script_before_the_guard(
    tmp_path: Path,
) -> None:
    """Every rule present is not enough: a rule more in the chain (one that lets a
    connection past the redirect) reads back wrong and the guard never starts."""
    more = [*nat_rules()[:2], f"-A {NAT_CHAIN} -p tcp -j ACCEPT", *nat_rules()[2:]]
    code, out, started = _run_entry_script(
        tmp_path, expected_readback()[: len(rules()["iptables"])], more
    )
    assert (code, started) == (1, False), out
    assert "FIREWALL-MISMATCH" in out and READY_MARK not in out


def test_the_readback_is_the_last_block_the_guard_printed() -> None:
    """The runner's own check reads the entry script's last block: the engine's attach
    can send the output twice (what was printed so far, then the live output)."""
    block = expected_readback()
    out = ["starting", RULES_MARK, *block, READY_MARK]
    assert installed_rules(out) == block
    assert installed_rules(out + out) == block
    assert installed_rules([*block, READY_MARK]) == []  # no block: nothing was read back
    cut = [RULES_MARK, *block[:-1], READY_MARK]
    assert installed_rules(out + cut) == block[:-1] != block  # a cut block reads back wrong
    assert installed_rules([RULES_MARK, *block, READY_MARK, "-A OUTPUT -j ACCEPT"]) == block
