"""The firewall rules (pure): what the guard's entry script installs and reads back."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from sandbox.contracts.guardprocess import (
    FIREWALL_GATE_FD_ENV,
    FIREWALL_GATE_READ_FD,
    FIREWALL_GATE_WRITE_FD,
)
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
from tests.paths import REPO


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


def _install_part(entry: str) -> list[str]:
    """The lines the entry's install subshell runs (between its open and its `) &`)."""
    lines = entry.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("( exec "))
    return lines[start + 1 : lines.index(") &", start)]


def test_script_installs_reads_back_then_drops_to_the_guard() -> None:
    script = guard_entry_script(["guard", "--x"])
    entry = script.splitlines()
    assert entry[0] == "set -eu"
    lines = _install_part(script)
    for tool, args in rules().items():
        restore = lines.index(f"{tool}-restore -w <<'RULES'")
        table = lines[restore + 1 : lines.index("RULES", restore)]
        assert table[0] == "*filter" and table[-1] == "COMMIT"
        assert ":OUTPUT DROP [0:0]" in table
        assert [ln for ln in table if ln.startswith("-A")] == [
            a for a in args if a.startswith("-A")
        ]
    readback = lines.index('got="$(iptables -w -S OUTPUT; ip6tables -w -S OUTPUT)"')
    # The guard's gate opens only if the rules read back exactly as expected.
    expected = lines.index("expected=$(cat <<'EXPECTED'")
    assert readback < expected
    assert lines[expected + 1 : lines.index("EXPECTED", expected)] == expected_readback()
    check = lines.index('[ "$got" = "$expected" ] || { echo "FIREWALL-MISMATCH"; exit 1; }')
    assert lines[check + 1 :] == [f"echo {READY_MARK}", f"echo ok >&{FIREWALL_GATE_WRITE_FD}"]
    # The install runs beside the drop; the entry hands the gate's read end to the guard,
    # then binds the log group while NET_ADMIN is held, then the drop.
    assert entry[-3:-1] == [
        'rm -r "$gate_dir"',
        f"export {FIREWALL_GATE_FD_ENV}={FIREWALL_GATE_READ_FD}",
    ]
    assert entry[-1].startswith("exec guard -m sandbox.guard.nflogbind setpriv ")
    assert entry[-1].endswith("-- tini -- guard --x")
    subprocess.run(["sh", "-n"], input=script, text=True, check=True)
    assert len(expected_readback()) == sum(len(a) for a in rules().values())


def test_without_install_the_script_still_reads_back_and_drops() -> None:
    """The test-only open namespace: no rules, the same drop (the preflight must catch it)."""
    script = guard_entry_script(["guard"], install=False)
    assert "-restore" not in script and "exec setpriv " in script
    assert "gate" not in script and "nflogbind" not in script


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


# The drop's stand-in: what the guard does with its gate, said in a file.
DROP = (
    "import os, sys\n"
    "from sandbox.guard.__main__ import _firewall_in\n"
    "open(sys.argv[1], 'w').write('open' if _firewall_in() else 'closed')\n"
)


def _run_entry_script(
    tmp_path: Path, readback_v4: list[str], nat_v4: list[str] | None = None
) -> tuple[str, str]:
    """The entry script under `sh`, with stand-ins for ip, the iptables tools and setpriv
    on PATH (the real ones need NET_ADMIN), and the guard's own reading of its gate as
    the drop: the install's output, and what the gate said ("open", "closed"). `nat_v4`: what the nat chain reads back (default: its rules as
    written)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gate = tmp_path / "gate"
    v4, v6 = rules().values()
    python = shlex.quote(sys.executable)
    stand_ins = {
        "ip": "exit 0",
        "iptables-restore": "cat > /dev/null",
        "ip6tables-restore": "cat > /dev/null",
        "iptables": _read_back(readback_v4, nat_rules() if nat_v4 is None else nat_v4),
        "ip6tables": _read_back(expected_readback()[len(v4) :], nat6_rules()),
        "setpriv": f"exec {python} -c {shlex.quote(DROP)} {shlex.quote(str(gate))}",
        "guard": 'shift 2; exec "$@"',  # the guard's Python binding the log group
    }
    assert len(v6) == len(expected_readback()) - len(v4)
    for name, body in stand_ins.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    done = subprocess.run(
        ["/bin/sh", "-c", guard_entry_script(["guard"])],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, gate.read_text()


def test_the_guards_gate_opens_only_after_the_rules_read_back_right(tmp_path: Path) -> None:
    out, gate = _run_entry_script(tmp_path, expected_readback()[: len(rules()["iptables"])])
    assert gate == "open", out
    assert out.splitlines()[-1] == READY_MARK


def test_a_wrong_readback_closes_the_gate_before_the_guard_listens(tmp_path: Path) -> None:
    """The step's executor starts the step only once the guard listens: a guard whose
    gate closes without `ok` never binds (`tests/guard/test_process.py`), which keeps
    the step from ever running."""
    wrong = expected_readback()[: len(rules()["iptables"]) - 1]  # the last rule missing
    out, gate = _run_entry_script(tmp_path, wrong)
    assert gate == "closed", out
    assert "FIREWALL-MISMATCH" in out and READY_MARK not in out


def test_a_nat_chain_that_reads_back_with_a_rule_more_closes_the_gate(
    tmp_path: Path,
) -> None:
    """Every rule present is not enough: a rule more in the chain (one that lets a
    connection past the redirect) reads back wrong and the gate never opens."""
    more = [*nat_rules()[:2], f"-A {NAT_CHAIN} -p tcp -j ACCEPT", *nat_rules()[2:]]
    out, gate = _run_entry_script(tmp_path, expected_readback()[: len(rules()["iptables"])], more)
    assert gate == "closed", out
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
