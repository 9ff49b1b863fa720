"""Derive the step-container seccomp profile from Docker's default profile.

Reads ``seccomp/default.json`` (Docker's default profile, copied unmodified from
upstream), applies the annotated list of changes in :data:`CHANGES` and writes
``seccomp/step.json``. It also refreshes the generated table in
``seccomp/README.md`` (between the ``BEGIN/END GENERATED`` markers).

Usage::

    python -m sandbox.launch.seccomp_tighten             # regenerate step.json (+ README table)
    python -m sandbox.launch.seccomp_tighten --check     # exit 1 if step.json / README are stale
    python -m sandbox.launch.seccomp_tighten --markdown  # print the table of changes

Standard library only (and the package's data lookup), on purpose: this runs in CI and on
a bare host.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.resources import seccomp_dir

HERE = seccomp_dir()
DEFAULT_PATH = HERE / "default.json"
STEP_PATH = HERE / "step.json"
README_PATH = HERE / "README.md"
BEGIN_MARK = "<!-- BEGIN GENERATED: python -m sandbox.launch.seccomp_tighten --markdown -->"
END_MARK = "<!-- END GENERATED -->"

Profile = dict[str, Any]
Rule = dict[str, Any]

#: Actions that do not let the syscall run. Every other action (ALLOW, LOG,
#: TRACE, NOTIFY, ...) is treated as granting the syscall.
DENY_ACTIONS = frozenset(
    {
        "SCMP_ACT_ERRNO",
        "SCMP_ACT_KILL",
        "SCMP_ACT_KILL_THREAD",
        "SCMP_ACT_KILL_PROCESS",
        "SCMP_ACT_TRAP",
    }
)

#: Socket address families are small integers: the kernel rejects any family
#: >= AF_MAX (46 as of Linux 7.x) with EAFNOSUPPORT. Allowed families are
#: computed over [0, FAMILY_LIMIT) only, so no emitted rule ever matches a value
#: whose upper 32 bits are set (the kernel truncates the argument to ``int``,
#: so an open-ended "arg0 > 40" rule would let 0x1_0000_0011 through as 17).
FAMILY_LIMIT = 64

AF_PACKET = 17
AF_VSOCK = 40
ENOSYS = 38
SANDBOX_COMMENT = "sandbox step profile (sandbox/launch/seccomp_tighten.py)"


def grants(rule: Rule) -> bool:
    """True if the rule lets its syscalls run (under some condition)."""
    return rule["action"] not in DENY_ACTIONS


def describe(rule: Rule) -> str:
    """Short human description of the condition attached to a rule."""
    parts: list[str] = []
    for key in ("includes", "excludes"):
        filt = rule.get(key) or {}
        for field_name, value in sorted(filt.items()):
            shown = "/".join(value) if isinstance(value, list) else value
            parts.append(f"{key}.{field_name}={shown}")
    if rule.get("args"):
        parts.append("arg-filtered")
    return ", ".join(parts) if parts else "unconditional"


def fmt_names(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


@dataclass(frozen=True, kw_only=True)
class Change:
    """One annotated edit to the profile. ``apply`` edits in place and returns a
    note on what it found and did in the upstream file (used in the table)."""

    title: str
    reason: str

    def apply(self, profile: Profile) -> str:
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class RemoveSyscalls(Change):
    """Remove ``names`` from every granting rule (unconditional, arch-, kernel-
    or capability-gated alike); rules left without names are dropped. Names
    upstream never allowed are fine: they stay denied by ``defaultAction``."""

    names: tuple[str, ...]

    def summary(self) -> str:
        return "remove " + fmt_names(self.names)

    def apply(self, profile: Profile) -> str:
        found: dict[str, list[str]] = {}
        kept: list[Rule] = []
        for rule in profile["syscalls"]:
            if grants(rule):
                hit = [n for n in rule["names"] if n in self.names]
                for name in hit:
                    found.setdefault(name, []).append(describe(rule))
                rule["names"] = [n for n in rule["names"] if n not in self.names]
                if not rule["names"]:
                    continue
            kept.append(rule)
        profile["syscalls"] = kept
        notes = [f"`{n}` ({'; '.join(found[n])})" for n in self.names if n in found]
        absent = [n for n in self.names if n not in found]
        out = ""
        if notes:
            out += "removed from: " + ", ".join(notes) + ". "
        if absent:
            out += "not allowed upstream (stays denied): " + fmt_names(absent) + "."
        return out.strip()


def _matches(arg: dict[str, Any], value: int) -> bool:
    op = arg["op"]
    a = int(arg["value"])
    if op == "SCMP_CMP_EQ":
        return value == a
    if op == "SCMP_CMP_NE":
        return value != a
    if op == "SCMP_CMP_LT":
        return value < a
    if op == "SCMP_CMP_LE":
        return value <= a
    if op == "SCMP_CMP_GT":
        return value > a
    if op == "SCMP_CMP_GE":
        return value >= a
    if op == "SCMP_CMP_MASKED_EQ":
        return (value & a) == int(arg.get("valueTwo", 0))
    raise ValueError(f"unknown seccomp comparison {op!r}")


def socket_families(rules: Iterable[Rule]) -> set[int]:
    """Families in [0, FAMILY_LIMIT) that some granting ``socket`` rule allows.

    Rules are ORed (each rule is a separate libseccomp rule). A rule with one
    condition is evaluated directly. Several conditions on the *same* argument
    are also treated as OR, which is what runc does with them (it splits them
    into separate rules, opencontainers/runc#2735), not AND."""
    allowed: set[int] = set()
    for rule in rules:
        if "socket" not in rule["names"] or not grants(rule):
            continue
        args = rule.get("args") or []
        if not args:
            return set(range(FAMILY_LIMIT))
        if any(int(a["index"]) != 0 for a in args):
            raise ValueError(f"socket rule filters an argument other than the family: {rule}")
        for arg in args:
            allowed |= {f for f in range(FAMILY_LIMIT) if _matches(arg, f)}
    return allowed


def socket_rules(families: set[int]) -> list[Rule]:
    """Rules allowing exactly ``families``: one "< n" rule for a run starting at
    0, then one "== f" rule per other family. Never two conditions in one rule
    (runc would OR them) and never an open-ended upper bound (see FAMILY_LIMIT)."""
    todo = sorted(families)
    rules: list[Rule] = []

    def rule(value: int, op: str) -> Rule:
        return {
            "names": ["socket"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": value, "op": op}],
            "comment": SANDBOX_COMMENT,
        }

    run = 0
    while run in families:
        run += 1
    if run >= 2:
        rules.append(rule(run, "SCMP_CMP_LT"))
        todo = [f for f in todo if f >= run]
    rules.extend(rule(f, "SCMP_CMP_EQ") for f in todo)
    return rules


@dataclass(frozen=True, kw_only=True)
class DenySocketFamilies(Change):
    """Rebuild the ``socket`` rules as an allowlist: whatever upstream allows,
    minus ``deny``. The rules go where upstream's socket rules were."""

    deny: tuple[int, ...]

    def summary(self) -> str:
        return "`socket(family)` denied for families " + ", ".join(map(str, self.deny))

    def apply(self, profile: Profile) -> str:
        rules: list[Rule] = profile["syscalls"]
        sock = [r for r in rules if "socket" in r["names"] and grants(r)]
        for r in sock:
            if r["names"] != ["socket"] or r.get("includes") or r.get("excludes"):
                raise ValueError(f"unsupported upstream socket rule shape: {r}")
        before = socket_families(sock)
        after = before - set(self.deny)
        at = rules.index(sock[0]) if sock else len(rules)
        rest = [r for r in rules if not any(r is s for s in sock)]
        profile["syscalls"] = rest[:at] + socket_rules(after) + rest[at:]
        already = sorted(set(self.deny) - before)
        note = (
            f"upstream had {len(sock)} socket rule(s) allowing families "
            f"{_ranges(before)}; now {_ranges(after)}."
        )
        if already:
            note += f" Already denied upstream: {', '.join(map(str, already))}."
        return note


def _ranges(values: set[int]) -> str:
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return "{" + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "}"


@dataclass(frozen=True, kw_only=True)
class NativeAbiOnly(Change):
    """Drop every ``subArchitectures`` list from ``archMap``: the filter then
    only accepts the host's native ABI and the kernel kills (SIGSYS) any
    syscall made through a compat ABI (i386 ``int 0x80``, x32, AArch32, ...)."""

    def summary(self) -> str:
        return "`archMap`: no `subArchitectures` (native ABI only)"

    def apply(self, profile: Profile) -> str:
        if "architectures" in profile:
            raise ValueError("profile lists 'architectures' directly; review by hand")
        dropped: list[str] = []
        for entry in profile["archMap"]:
            subs = entry.get("subArchitectures")
            if subs:
                dropped.append(f"{entry['architecture']}: {'/'.join(subs)}")
            entry["subArchitectures"] = None
        return ("dropped " + "; ".join(dropped) + ".") if dropped else "none upstream."


@dataclass(frozen=True, kw_only=True)
class PinCloneFilters(Change):
    """``clone``: only the namespace-flag-filtered rules remain, for every
    capability set. ``clone3``: always ENOSYS (glibc then falls back to
    ``clone``; any other errno would make thread/process creation fail)."""

    def summary(self) -> str:
        return "`clone` always namespace-filtered; `clone3` always ENOSYS"

    def apply(self, profile: Profile) -> str:
        notes: list[str] = []
        kept: list[Rule] = []
        for rule in profile["syscalls"]:
            names = [n for n in rule["names"] if n in ("clone", "clone3")]
            if names and grants(rule) and not rule.get("args"):
                notes.append(f"dropped {fmt_names(names)} from rule ({describe(rule)})")
                rule["names"] = [n for n in rule["names"] if n not in names]
                if not rule["names"]:
                    continue
            elif names and "caps" in (rule.get("excludes") or {}):
                del rule["excludes"]["caps"]
                if not rule["excludes"]:
                    del rule["excludes"]
                notes.append(
                    f"{fmt_names(names)} rule ({describe(rule)}) applies regardless of caps"
                )
            kept.append(rule)
        profile["syscalls"] = kept
        for rule in kept:
            if "clone3" in rule["names"] and (
                rule["action"] != "SCMP_ACT_ERRNO" or rule.get("errnoRet") != ENOSYS
            ):
                raise ValueError(f"clone3 rule is not ERRNO(ENOSYS): {rule}")
            if "clone" in rule["names"] and grants(rule) and not rule.get("args"):
                raise ValueError(f"clone is allowed unfiltered: {rule}")
        if not any("clone3" in r["names"] for r in kept):
            kept.append(
                {
                    "names": ["clone3"],
                    "action": "SCMP_ACT_ERRNO",
                    "errnoRet": ENOSYS,
                    "comment": SANDBOX_COMMENT,
                }
            )
            notes.append("added `clone3` ERRNO(ENOSYS) rule")
        return "; ".join(notes) + "." if notes else "already as required."


@dataclass(frozen=True, kw_only=True)
class RequireArgFiltered(Change):
    """No edit: fail if ``names`` are granted anywhere without an arg filter."""

    names: tuple[str, ...]

    def summary(self) -> str:
        return fmt_names(self.names) + " only with upstream's argument filter"

    def apply(self, profile: Profile) -> str:
        values: list[str] = []
        for rule in profile["syscalls"]:
            if set(self.names) & set(rule["names"]) and grants(rule):
                if not rule.get("args"):
                    raise ValueError(f"{self.names} allowed without argument filter: {rule}")
                values += [f"{a['value']:#x}" for a in rule["args"]]
        return "kept as upstream: arg0 in {" + ", ".join(values) + "}."


@dataclass(frozen=True, kw_only=True)
class DropCapabilityGatedRules(Change):
    """Drop every rule that only applies when the container holds a capability
    (``includes.caps``)."""

    def summary(self) -> str:
        return "drop all remaining `includes.caps` rules"

    def apply(self, profile: Profile) -> str:
        dropped: list[str] = []
        kept: list[Rule] = []
        for rule in profile["syscalls"]:
            caps = (rule.get("includes") or {}).get("caps")
            if caps:
                dropped.append(f"{'/'.join(caps)}: {fmt_names(rule['names'])}")
                continue
            kept.append(rule)
        profile["syscalls"] = kept
        return ("dropped " + "; ".join(dropped) + ".") if dropped else "none left."


CHANGES: tuple[Change, ...] = (
    RemoveSyscalls(
        title="No io_uring",
        names=("io_uring_setup", "io_uring_enter", "io_uring_register"),
        reason="Large, frequently exploited kernel attack surface that also bypasses "
        "per-syscall seccomp filtering of the operations it performs; steps do not need it.",
    ),
    RemoveSyscalls(
        title="No cross-process inspection",
        names=(
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "kcmp",
            "pidfd_getfd",
            "process_madvise",
        ),
        reason="Upstream allows ptrace/process_vm_* with no capability (kernel >= 4.8). "
        "With all caps dropped a step could still trace or read the memory and "
        "environment (secrets) of any same-uid process in the container, or steal "
        "its file descriptors.",
    ),
    DenySocketFamilies(
        title="No AF_PACKET / AF_VSOCK sockets",
        deny=(AF_PACKET, AF_VSOCK),
        reason="AF_VSOCK reaches host/VM services outside the network namespace "
        "(`--network none` does not stop it); AF_PACKET is raw link-layer access. "
        "Built as one rule per allowed range/family because runc turns several "
        "conditions on the same argument into separate ORed rules "
        "(opencontainers/runc#2735): `[!= 17, != 40]` in one rule would allow everything.",
    ),
    NativeAbiOnly(
        title="Native 64-bit ABI only",
        reason="Any x86_64 process can make 32-bit syscalls with `int 0x80`. On that ABI "
        "`socketcall(SYS_SOCKET, ptr)` hides the family behind a pointer seccomp cannot "
        "read, and libseccomp turns every allowed `socket` rule into an allowed "
        "`socketcall(SYS_SOCKET)` there, so AF_VSOCK stays reachable even with "
        "`socketcall` denied (verified with Docker 20.10 / runc 1.1.5 / libseccomp 2.5.4). "
        "Without compat ABIs in the filter such calls are killed with SIGSYS. "
        "This also removes the whole compat-syscall surface. "
        "Cost: 32-bit binaries cannot run in steps.",
    ),
    RemoveSyscalls(
        title="No socketcall multiplexer",
        names=("socketcall",),
        reason="Belt and braces only: `socketcall` does not exist on x86_64/aarch64, and on "
        "x86 libseccomp re-adds `socketcall(SYS_SOCKET)` for each allowed `socket` rule "
        "anyway (see the native-ABI change, which is what closes that path).",
    ),
    RemoveSyscalls(
        title="No kernel-exploit helpers",
        names=("userfaultfd", "perf_event_open", "bpf"),
        reason="Classic exploitation primitives (race widening, kernel info leaks, "
        "in-kernel code); only ever allowed upstream under CAP_SYS_ADMIN/CAP_PERFMON/CAP_BPF.",
    ),
    RemoveSyscalls(
        title="No kernel keyring",
        names=("keyctl", "add_key", "request_key"),
        reason="Keyrings are a kernel attack surface with a history of bugs, and some "
        "upstream versions allow them unconditionally; steps do not need them.",
    ),
    RemoveSyscalls(
        title="No namespace manipulation",
        names=("unshare", "setns"),
        reason="Creating/joining namespaces (notably user namespaces) opens a large "
        "kernel surface; upstream allows these only under CAP_SYS_ADMIN.",
    ),
    RemoveSyscalls(
        title="No mounts or root switching",
        names=(
            "mount",
            "umount",
            "umount2",
            "pivot_root",
            "chroot",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "move_mount",
            "open_tree",
            "mount_setattr",
        ),
        reason="Filesystem layout is fixed by the runner; old and new mount APIs are "
        "removed even where upstream gates them on CAP_SYS_ADMIN/CAP_SYS_CHROOT.",
    ),
    RemoveSyscalls(
        title="No file-handle syscalls",
        names=("open_by_handle_at", "name_to_handle_at"),
        reason="open_by_handle_at can open files outside the container's mount tree "
        "(the 'shocker' escape) and needs CAP_DAC_READ_SEARCH upstream; "
        "name_to_handle_at (allowed upstream for everyone) is only useful with it.",
    ),
    RemoveSyscalls(
        title="No kernel modules, kexec or reboot",
        names=(
            "init_module",
            "finit_module",
            "delete_module",
            "kexec_load",
            "kexec_file_load",
            "reboot",
        ),
        reason="Host-global; upstream gates them on CAP_SYS_MODULE/CAP_SYS_BOOT or "
        "never allows them.",
    ),
    RemoveSyscalls(
        title="No host-global admin syscalls",
        names=("syslog", "acct", "swapon", "swapoff"),
        reason="Kernel log (address leaks), process accounting and swap are host-global.",
    ),
    PinCloneFilters(
        title="clone / clone3 filtered for every capability set",
        reason="Upstream lifts the clone namespace-flag filter and the clone3 ENOSYS rule "
        "under CAP_SYS_ADMIN. Keep both unconditional. clone3 must fail with ENOSYS "
        "(not EPERM): glibc only falls back to clone on ENOSYS, so Python threads and "
        "subprocess keep working.",
    ),
    RequireArgFiltered(
        title="personality stays filtered",
        names=("personality",),
        reason="Only PER_LINUX, PER_LINUX32, UNAME26 and the query value are allowed "
        "(no ADDR_NO_RANDOMIZE, no READ_IMPLIES_EXEC); checked, not changed.",
    ),
    DropCapabilityGatedRules(
        title="No capability-gated rules at all",
        reason="Steps run with `--cap-drop ALL`, so Docker never applies these rules; "
        "removing them keeps a mistaken `--cap-add` from also widening the syscall set "
        "(defence in depth).",
    ),
)


def tighten(default: Profile, changes: Sequence[Change] = CHANGES) -> tuple[Profile, list[str]]:
    """Return the tightened copy of ``default`` and one note per change."""
    profile = copy.deepcopy(default)
    if profile.get("defaultAction") != "SCMP_ACT_ERRNO":
        raise ValueError("upstream defaultAction is no longer SCMP_ACT_ERRNO; review by hand")
    notes = [change.apply(profile) for change in changes]
    return profile, notes


def render_json(profile: Profile) -> str:
    # Same layout as upstream (Go's json.MarshalIndent with a tab), plus a newline.
    return json.dumps(profile, indent="\t") + "\n"


def render_markdown(changes: Sequence[Change], notes: Sequence[str]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        "| # | Change | What | Found in default.json / done | Why |",
        "|---|---|---|---|---|",
    ]
    for i, (change, note) in enumerate(zip(changes, notes, strict=True), start=1):
        lines.append(
            f"| {i} | {cell(change.title)} | {cell(change.summary())} | "
            f"{cell(note)} | {cell(change.reason)} |"
        )
    return "\n".join(lines) + "\n"


def load(path: Path) -> Profile:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def readme_with_table(readme: str, table: str) -> str:
    start = readme.find(BEGIN_MARK)
    end = readme.find(END_MARK)
    if start < 0 or end < start:
        return readme
    return readme[: start + len(BEGIN_MARK)] + "\n\n" + table + "\n" + readme[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if outputs are stale")
    mode.add_argument("--markdown", action="store_true", help="print the table of changes")
    args = parser.parse_args(argv)

    profile, notes = tighten(load(DEFAULT_PATH))
    text = render_json(profile)
    table = render_markdown(CHANGES, notes)
    if args.markdown:
        sys.stdout.write(table)
        return 0

    readme = README_PATH.read_text(encoding="utf-8") if README_PATH.exists() else None
    new_readme = readme_with_table(readme, table) if readme is not None else None
    if args.check:
        stale = []
        if not STEP_PATH.exists() or STEP_PATH.read_text(encoding="utf-8") != text:
            stale.append(str(STEP_PATH))
        if readme is not None and new_readme != readme:
            stale.append(f"{README_PATH} (generated table)")
        if stale:
            print("stale: " + ", ".join(stale), file=sys.stderr)
            print("run: python -m sandbox.launch.seccomp_tighten", file=sys.stderr)
            return 1
        return 0

    STEP_PATH.write_text(text, encoding="utf-8")
    if new_readme is not None and new_readme != readme:
        README_PATH.write_text(new_readme, encoding="utf-8")
    print(f"wrote {STEP_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
