"""Landlock, from the standard library alone: a process restricts where it (and every
process it starts) may write, and on newer kernels whom it may signal and which
abstract unix sockets it may reach.

Stdlib only (ctypes): the step image installs this file as `landlock` and the step's
executor runs it on the image's system python. Only write-ish file rights are
handled, so reads and execution stay allowed everywhere; a right the kernel's ABI
does not know is simply not handled (older kernels get a coarser wall, never an
error). A domain is inherited across fork and exec and can never be left, so a
restriction made before the step starts binds the step and all it spawns.

The calling thread alone is restricted (the kernel offers no process-wide form on
the ABIs this targets): call `restrict` on the main thread before any thread starts.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

# Not `typing.TYPE_CHECKING`: `typing` alone costs the executor's start-up ~10 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Final

# System call numbers: the same on every architecture (the unified table since 5.13).
SYS_CREATE_RULESET: Final = 444
SYS_ADD_RULE: Final = 445
SYS_RESTRICT_SELF: Final = 446

CREATE_RULESET_VERSION: Final = 1 << 0
RULE_PATH_BENEATH: Final = 1
PR_SET_NO_NEW_PRIVS: Final = 38

# File system rights (ABI 1 unless noted).
WRITE_FILE: Final = 1 << 1
REMOVE_DIR: Final = 1 << 4
REMOVE_FILE: Final = 1 << 5
MAKE_CHAR: Final = 1 << 6
MAKE_DIR: Final = 1 << 7
MAKE_REG: Final = 1 << 8
MAKE_SOCK: Final = 1 << 9
MAKE_FIFO: Final = 1 << 10
MAKE_BLOCK: Final = 1 << 11
MAKE_SYM: Final = 1 << 12
REFER: Final = 1 << 13  # ABI 2: links and renames across rule hierarchies
TRUNCATE: Final = 1 << 14  # ABI 3
IOCTL_DEV: Final = 1 << 15  # ABI 5: ioctl on device files

# Scopes (ABI 6): IPC that leaves the domain.
SCOPE_ABSTRACT_UNIX_SOCKET: Final = 1 << 0
SCOPE_SIGNAL: Final = 1 << 1
SCOPE_NAMES: Final = {SCOPE_ABSTRACT_UNIX_SOCKET: "abstract_unix_socket", SCOPE_SIGNAL: "signal"}

WRITE_ABI1: Final = (
    WRITE_FILE
    | REMOVE_DIR
    | REMOVE_FILE
    | MAKE_CHAR
    | MAKE_DIR
    | MAKE_REG
    | MAKE_SOCK
    | MAKE_FIFO
    | MAKE_BLOCK
    | MAKE_SYM
)
# Rights a rule on a non-directory may carry (the kernel refuses the others there).
FILE_RIGHTS: Final = WRITE_FILE | TRUNCATE | IOCTL_DEV


class LandlockError(OSError):
    """The kernel refused to build or enforce the wall."""


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is packed: u64 then s32, 12 bytes
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


def _syscall(number: int, *args: object) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    function = libc.syscall
    function.restype = ctypes.c_long
    result = int(function(ctypes.c_long(number), *args))
    if result < 0:
        code = ctypes.get_errno()
        raise LandlockError(code, os.strerror(code))
    return result


def abi_version() -> int:
    """The kernel's Landlock ABI; 0 when it has none (not built, disabled at boot,
    refused by a seccomp filter, or a runtime such as gVisor that does not offer it)."""
    try:
        return _syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), CREATE_RULESET_VERSION)
    except (LandlockError, AttributeError):
        return 0


def handled_rights(abi: int) -> int:
    """Every write-ish file right `abi` knows."""
    rights = WRITE_ABI1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def scopes(abi: int) -> int:
    return SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0


def scope_names(scoped: int) -> list[str]:
    return [name for bit, name in SCOPE_NAMES.items() if scoped & bit]


def restrict(writable: Iterable[str], *, abi: int | None = None) -> tuple[int, int]:
    """Restrict this thread (and all it starts): writes only beneath the folders and
    to the files (device nodes and the like) of `writable`; IPC scoped where the ABI can.

    Paths that do not exist are skipped (a folder the run does not have grants
    nothing). Returns (abi, scoped bits). Raises LandlockError when the kernel has
    no Landlock or refuses a step; the thread is then unrestricted."""
    abi = abi_version() if abi is None else abi
    if abi < 1:
        raise LandlockError(errno.EOPNOTSUPP, "the kernel offers no Landlock")
    rights = handled_rights(abi)
    scoped = scopes(abi)
    attr = _RulesetAttr(rights, 0, scoped)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = _syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    try:
        for path in writable:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
                rule = _PathBeneath(rights if is_dir else rights & FILE_RIGHTS, fd)
                _syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), 0)
            finally:
                os.close(fd)
        _no_new_privs()
        _syscall(SYS_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)
    return abi, scoped


def _no_new_privs() -> None:
    """Unprivileged restriction needs no_new_privs (the step's containers set it too)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise LandlockError(code, os.strerror(code))
