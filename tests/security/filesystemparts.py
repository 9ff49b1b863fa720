"""The file, mount, /proc, privilege and device escape battery's step and what each of
its attempts must end in: run on Docker by `test_escape_filesystem_process.py` and on a
Pod by `tests/kubernetes/battery.py`, from here so that neither imports the other's
test module."""

from __future__ import annotations

HOST_SECRET = "HOST-SECRET-0f9e2c41"

STEP = r"""
import glob, mmap, shutil, socket, sqlite3, stat, subprocess

RUN_ROOT = "/workflow/runs/" + os.environ["AGENTWORKS_TEST_RUN_ID"]
HOST_SECRET_PATH = "@@HOST_SECRET_PATH@@"


def write_to(path, mode="a"):
    def go():
        with open(path, mode) as handle:
            handle.write("ESCAPED")
    return go


# --- writes to every read-only mount ----------------------------------------
for name, path, mode in [
    ("write /workflow/workflow.toml", "/workflow/workflow.toml", "a"),
    ("create /workflow/new.txt", "/workflow/new.txt", "w"),
    ("write /workflow/code/step.py", "/workflow/code/step.py", "a"),
    ("write /workflow/runs/run-1 (real run)", "/workflow/runs/run-1/g/execution/keep.txt", "a"),
    ("write /workflow/db/db.sqlite", "/workflow/db/db.sqlite", "a"),
    ("write /workflow/db/db.sqlite-wal", "/workflow/db/db.sqlite-wal", "a"),
    ("write /workflow/db/db.sqlite-shm", "/workflow/db/db.sqlite-shm", "a"),
    ("write /crew/a/crew.txt", "/crew/a/crew.txt", "a"),
    ("create /crew/a/new.txt", "/crew/a/new.txt", "w"),
    ("write /test/prompt.md", "/test/prompt.md", "a"),
    ("write /etc/passwd", "/etc/passwd", "a"),
    ("create /etc/evil", "/etc/evil", "w"),
    ("create /usr/bin/evil", "/usr/bin/evil", "w"),
    ("create /usr/local/lib/python3.11/evil.pth", "/usr/local/lib/python3.11/evil.pth", "w"),
    ("forge the record test_mode.json", RUN_ROOT + "/test_mode.json", "w"),
    ("forge the action log", RUN_ROOT + "/test_mode_actions.jsonl", "a"),
    ("create a file in the run root", RUN_ROOT + "/forged.json", "w"),
]:
    attempt(name, write_to(path, mode))


def rename_over_record():
    with open("fake-record.json", "w") as handle:
        handle.write('{"status": "passed", "forged": "ESCAPED"}')
    os.rename("fake-record.json", RUN_ROOT + "/test_mode.json")


attempt("rename a fake record over test_mode.json", rename_over_record)


def sqlite_write_real_db():
    con = sqlite3.connect("/workflow/db/db.sqlite", timeout=1)
    con.execute("INSERT INTO t VALUES (666, 'escaped')")
    con.commit()


attempt("sqlite INSERT into the real DB", sqlite_write_real_db)
attempt("unlink the real DB", lambda: os.unlink("/workflow/db/db.sqlite"))
attempt("rename workflow.toml", lambda: os.rename("/workflow/workflow.toml", "/workflow/w.bak"))
attempt("rmtree /workflow/code", lambda: shutil.rmtree("/workflow/code"))
attempt("chmod workflow.toml 777", lambda: os.chmod("/workflow/workflow.toml", 0o777))
attempt("truncate the real DB", lambda: os.truncate("/workflow/db/db.sqlite", 0))

# --- links out of the rw group folder ------------------------------------------------


def symlink_then_write():
    os.symlink("/workflow/db/db.sqlite", "link-real-db")
    with open("link-real-db", "r+b") as handle:
        handle.write(b"ESCAPED")


def dir_symlink_then_create():
    os.symlink("/workflow/db", "link-db-dir")
    with open("link-db-dir/planted.sqlite", "w") as handle:
        handle.write("ESCAPED")


def symlink_then_sqlite():
    os.symlink("/workflow/db/db.sqlite", "link-real-db-2")
    con = sqlite3.connect("link-real-db-2", timeout=1)
    con.execute("INSERT INTO t VALUES (667, 'escaped')")
    con.commit()


attempt("symlink to the real DB, write through it", symlink_then_write)
attempt("dir symlink to /workflow/db, create through it", dir_symlink_then_create)
attempt("symlink to the real DB, sqlite INSERT through it", symlink_then_sqlite)
attempt("hard link the real DB into the group folder", lambda: os.link("/workflow/db/db.sqlite", "hard-db"))
attempt("hard link the real DB into /test/db", lambda: os.link("/workflow/db/db.sqlite", "/test/db/hard-db"))
attempt("hard link the real WAL into the group folder", lambda: os.link("/workflow/db/db.sqlite-wal", "hard-wal"))
attempt("hard link /test/prompt.md into the group folder", lambda: os.link("/test/prompt.md", "hard-prompt"))
attempt("hard link /etc/passwd into /tmp", lambda: os.link("/etc/passwd", "/tmp/passwd"))
attempt("hard link read-only root-owned /etc/shadow beside itself", lambda: os.link("/etc/shadow", "/etc/shadow2"))

# --- /proc root tricks ------------------------------------------------------------------
attempt("write via /proc/self/root/workflow/db/db.sqlite", write_to("/proc/self/root/workflow/db/db.sqlite"))
attempt("write via /proc/1/root/workflow/workflow.toml", write_to("/proc/1/root/workflow/workflow.toml"))
attempt("write via /proc/1/cwd/../../workflow/workflow.toml", write_to("/proc/1/cwd/../../workflow/workflow.toml"))


def proc1_root_is_ours():
    mine, theirs = os.stat("/"), os.stat("/proc/1/root/")
    if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
        return "DIFFERENT ROOT", sorted(os.listdir("/proc/1/root/"))[:20]
    return "the container's own root"


attempt("/proc/1/root leads outside the container", proc1_root_is_ours)

# --- secrets of other processes ------------------------------------------------------
NEEDLE = b"AGENTWORKS_EXEC_" + b"TOKEN="
ME = os.getpid()


def other_pids():
    return sorted(int(p.rsplit("/", 1)[1]) for p in glob.glob("/proc/[0-9]*") if int(p.rsplit("/", 1)[1]) != ME)


def environ_scan(needles):
    def go():
        found = []
        for pid in [ME, *other_pids()]:
            try:
                with open("/proc/%d/environ" % pid, "rb") as handle:
                    entries = handle.read().split(b"\0")
            except OSError:
                continue
            for entry in entries:
                for needle in needles:
                    if entry.startswith(needle) and len(entry) > len(needle):
                        found.append("%s in pid %d" % (needle.decode().rstrip("="), pid))
        return ("FOUND", "; ".join(found)) if found else "absent"
    return go


def memory_scan():
    found, unreadable = [], []
    for pid in other_pids():
        try:
            with open("/proc/%d/maps" % pid) as handle:
                maps = handle.read().splitlines()
            mem = os.open("/proc/%d/mem" % pid, os.O_RDONLY)
        except OSError as exc:
            unreadable.append("%d:%s" % (pid, errname(exc)))
            continue
        try:
            for line in maps:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if not fields[1].startswith("r") or end - start > 64 << 20:
                    continue
                try:
                    data = os.pread(mem, end - start, start)
                except OSError:
                    continue
                if NEEDLE in data:
                    found.append(pid)
                    break
        finally:
            os.close(mem)
    if found:
        return "FOUND", "exec token in the memory of pid(s) %s" % found, {"unreadable": unreadable}
    return "absent", "", {"unreadable": unreadable}


attempt("exec token in any /proc/*/environ", environ_scan([NEEDLE]))
attempt("exec token in another process's memory (/proc/<pid>/mem)", memory_scan)
attempt("guard config or its tokens in any /proc/*/environ", environ_scan([b"SANDBOX_GUARD_CONFIG="]))
attempt("own environment holds the exec token", lambda: "FOUND" if NEEDLE.decode().rstrip("=") in os.environ else "absent")

EXEC_PID = next(
    (p for p in other_pids() if open("/proc/%d/cmdline" % p, "rb").read().startswith(b"python3\0-m\0agentworks_exec")),
    None,
)
report("executor process found", "yes" if EXEC_PID else "no", EXEC_PID)
attempt("read the executor's /proc/<pid>/environ", lambda: open("/proc/%d/environ" % EXEC_PID, "rb").read(64))
attempt("open the executor's /proc/<pid>/mem", lambda: os.close(os.open("/proc/%d/mem" % EXEC_PID, os.O_RDONLY)))

# --- the guard must be invisible -------------------------------------------------------


def foreign_processes():
    uids = {}
    for path in glob.glob("/proc/[0-9]*"):
        try:
            uids[int(path.rsplit("/", 1)[1])] = os.stat(path).st_uid
        except OSError:
            pass
    foreign = {pid: uid for pid, uid in uids.items() if uid != os.getuid()}
    return ("none", "", {"pids": sorted(uids)}) if not foreign else ("FOUND", foreign, {"pids": sorted(uids)})


def signal_scan():
    visible = {int(p.rsplit("/", 1)[1]) for p in glob.glob("/proc/[0-9]*")}
    alive, foreign = [], []
    for pid in range(1, 70000):
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except PermissionError:
            foreign.append(pid)
        except ProcessLookupError:
            pass
    hidden = []
    for pid in alive:  # threads answer kill() too: their thread group must be one of ours
        try:
            status = open("/proc/%d/status" % pid).read()
            tgid = int(status.split("Tgid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            tgid = None
        if tgid not in visible:
            hidden.append(pid)
    if foreign or hidden:
        return "FOUND", "signalable but not ours: %s %s" % (foreign[:10], hidden[:10])
    return "only own processes", "", {"alive": alive}


attempt("processes of another uid (the guard's 10002) in /proc", foreign_processes)
attempt("kill(pid, 0) over pids 1..70000 reaches a foreign process", signal_scan)
attempt("the guard's files (/guard) are visible", lambda: "present" if os.path.exists("/guard") else "absent")

# --- privileged syscalls (each in a child, so a surprise success changes nothing) -----
MS_REMOUNT, MS_BIND = 32, 4096
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x00020000, 0x10000000, 0x40000000, 17


def clone_newuser():
    ret = sys_call(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
    if ret == 0:
        os._exit(0)
    os.waitpid(ret, 0)


def setns_user():
    fd = os.open("/proc/self/ns/user", os.O_RDONLY)
    sys_call(308, fd, 0)


def ptrace_attach_init():
    sys_call(101, 16, 1, 0, 0)  # PTRACE_ATTACH pid 1 (docker-init, same uid)


def process_vm_readv_init():
    with open("/proc/1/maps") as handle:
        start = int(handle.readline().split("-")[0], 16)
    buf = ctypes.create_string_buffer(8)

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    local, remote = Iovec(ctypes.addressof(buf), 8), Iovec(start, 8)
    sys_call(310, 1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)


def finit_module():
    fd = os.open("/dev/null", os.O_RDONLY)
    sys_call(313, fd, b"", 0)


def int80_getpid():
    # i386 `mov eax, 20 (getpid); int 0x80; ret`: the compat ABI is not in the filter.
    code = b"\xb8\x14\x00\x00\x00\xcd\x80\xc3"
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    return "returned %d" % ctypes.CFUNCTYPE(ctypes.c_int)(address)()


SYSCALLS = [
    ("mount tmpfs on /tmp", lambda: sys_call(165, b"none", b"/tmp", b"tmpfs", 0, None)),
    ("remount /workflow read-write", lambda: sys_call(165, None, b"/workflow", None, MS_REMOUNT | MS_BIND, None)),
    ("umount2 /workflow", lambda: sys_call(166, b"/workflow", 2)),
    ("unshare(CLONE_NEWUSER)", lambda: sys_call(272, CLONE_NEWUSER)),
    ("unshare(CLONE_NEWNET)", lambda: sys_call(272, CLONE_NEWNET)),
    ("unshare(CLONE_NEWNS)", lambda: sys_call(272, CLONE_NEWNS)),
    ("clone(CLONE_NEWUSER)", clone_newuser),
    ("setns(/proc/self/ns/user)", setns_user),
    ("chroot /tmp", lambda: sys_call(161, b"/tmp")),
    ("pivot_root", lambda: sys_call(155, b"/tmp", b"/tmp")),
    ("ptrace(PTRACE_TRACEME)", lambda: sys_call(101, 0, 0, 0, 0)),
    ("ptrace(PTRACE_ATTACH, 1)", ptrace_attach_init),
    ("process_vm_readv(pid 1)", process_vm_readv_init),
    ("keyctl(GET_KEYRING_ID)", lambda: sys_call(250, 0, -3, 0)),
    ("add_key(user)", lambda: sys_call(248, b"user", b"sbx", b"v", 1, -3)),
    ("request_key(user)", lambda: sys_call(249, b"user", b"sbx", None, 0)),
    ("bpf(BPF_MAP_CREATE)", lambda: sys_call(321, 0, None, 0)),
    ("init_module", lambda: sys_call(175, None, 0, b"")),
    ("finit_module(/dev/null)", finit_module),
    ("delete_module", lambda: sys_call(176, b"ext4", 0)),
    ("perf_event_open", lambda: sys_call(298, None, 0, -1, -1, 0)),
    ("userfaultfd", lambda: sys_call(323, 0)),
    ("io_uring_setup", lambda: sys_call(425, 1, None)),
    ("open_by_handle_at (shocker)", lambda: sys_call(304, -100, None, 0)),
    ("kexec_load", lambda: sys_call(246, 0, 0, None, 0)),
    ("reboot", lambda: sys_call(169, 0xFEE1DEAD, 672274793, 0x4321FEDC, None)),
    ("setuid(0)", lambda: os.setuid(0)),
    ("int 0x80 (32-bit syscall)", int80_getpid),
]
for name, fn in SYSCALLS:
    attempt(name, lambda fn=fn: in_child(fn))


def capabilities():
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    keys = ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"]
    # gVisor's status has no CapAmb, NoNewPrivs or Seccomp line: the kernel's own
    # answers (prctl PR_GET_NO_NEW_PRIVS 39, PR_GET_SECCOMP 21) stand in for those two.
    caps = {k: status[k].strip() for k in keys if k in status or k != "CapAmb"}
    extra = {
        "NoNewPrivs": status.get("NoNewPrivs", str(LIBC.prctl(39, 0, 0, 0, 0))).strip(),
        "Seccomp": status.get("Seccomp", str(LIBC.prctl(21, 0, 0, 0, 0))).strip(),
    }
    if set(caps.values()) == {"0000000000000000"} and extra == {"NoNewPrivs": "1", "Seccomp": "2"}:
        return "none, no-new-privs, seccomp filter"
    return "PRIVILEGED", {**caps, **extra}


def lower_oom_score():
    with open("/proc/self/oom_score_adj", "w") as handle:
        handle.write("-1000")


attempt("capabilities held", capabilities)
attempt("oom_score_adj -1000 (unkillable)", lambda: in_child(lower_oom_score))

# --- setuid binaries, su/sudo, the Docker socket -----------------------------------------


def setuid_files():
    found = []
    for top in ["/bin", "/sbin", "/usr", "/etc", "/lib", "/lib64", "/opt", "/var", "/root", "/home", "/srv", "/run", "/mnt", "/media", "/tmp"]:
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                try:
                    mode = os.lstat(os.path.join(dirpath, name)).st_mode
                except OSError:
                    continue
                if stat.S_ISREG(mode) and mode & (stat.S_ISUID | stat.S_ISGID):
                    found.append(os.path.join(dirpath, name))
    return ("FOUND", found[:10]) if found else "none"


def su_root():
    run = subprocess.run(["su", "-c", "id -u", "root"], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    if run.returncode == 0 or run.stdout.strip() == "0":
        return "BECAME ROOT", run.stdout
    return "failed", run.stderr.strip()


def sudo():
    path = shutil.which("sudo")
    if path is None:
        return "absent"
    run = subprocess.run([path, "-n", "id", "-u"], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    return ("BECAME ROOT" if run.stdout.strip() == "0" else "failed"), run.stderr.strip()


def docker_socket():
    for path in ["/var/run/docker.sock", "/run/docker.sock", "/docker.sock", "/run/containerd/containerd.sock"]:
        if os.path.lexists(path):
            return "PRESENT", path
    return "absent"


def socket_files():
    found = []
    for top in ["/run", "/var/run", "/tmp", "/dev", "/workflow", "/test", "/crew", "/etc", "/root", "/home"]:
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                try:
                    if stat.S_ISSOCK(os.lstat(os.path.join(dirpath, name)).st_mode):
                        found.append(os.path.join(dirpath, name))
                except OSError:
                    pass
    return ("FOUND", found[:10]) if found else "none"


def abstract_sockets():
    names = [line.split()[-1] for line in open("/proc/net/unix").read().splitlines()[1:] if line.split()[-1].startswith("@")]
    return ("FOUND", names[:10]) if names else "none"


attempt("setuid/setgid files in the image", setuid_files)
attempt("su root", su_root)
attempt("sudo", sudo)
attempt("Docker/containerd socket reachable", docker_socket)
attempt("unix socket files anywhere", socket_files)
attempt("abstract unix sockets in the namespace", abstract_sockets)

# --- devices, /sys, /proc/sys ---------------------------------------------------------------
SAFE_DEV = {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm", "mqueue", "fd", "stdin", "stdout", "stderr", "core", "console"}


def dev_listing():
    names = set(os.listdir("/dev"))
    blocks = [n for n in names if stat.S_ISBLK(os.lstat("/dev/" + n).st_mode)]
    if names - SAFE_DEV or blocks:
        return "UNUSUAL", sorted(names - SAFE_DEV) + blocks
    return "only the usual safe nodes", sorted(names)


attempt("mknod /tmp/mem (char 1,1)", lambda: os.mknod("/tmp/mem", stat.S_IFCHR | 0o666, os.makedev(1, 1)))
attempt("mknod block device in the group folder", lambda: os.mknod("sda", stat.S_IFBLK | 0o666, os.makedev(8, 0)))
attempt("/dev contents", dev_listing)
attempt("create a node in /dev", write_to("/dev/evil", "w"))
attempt("write /proc/sys/kernel/core_pattern", write_to("/proc/sys/kernel/core_pattern", "w"))
attempt("write /proc/sysrq-trigger", write_to("/proc/sysrq-trigger", "w"))
attempt("write cgroup release_agent", write_to("/sys/fs/cgroup/memory/release_agent", "w"))
attempt("raise cgroup pids.max", write_to("/sys/fs/cgroup/pids/pids.max", "w"))
attempt("write /sys/kernel/uevent_helper", write_to("/sys/kernel/uevent_helper", "w"))

# --- traps for the host-side collector (not attempts: the host must survive them) ---------
os.mkfifo("trap-fifo")
os.symlink(HOST_SECRET_PATH, "trap-secret-link")
os.unlink("/test/db/db.sqlite")
os.mkfifo("/test/db/db.sqlite")
os.symlink(HOST_SECRET_PATH, "/test/db/db.sqlite-wal")
os.mkfifo("/test/db/db.sqlite-journal")
report("host-side traps planted", "planted")
"""


EROFS = {"EROFS"}
EPERM = {"EPERM"}
EXDEV = {"EXDEV"}
EACCES = {"EACCES"}
ENOENT = {"ENOENT"}

SAFE: dict[str, set[str]] = {
    "write /workflow/workflow.toml": EROFS,
    "create /workflow/new.txt": EROFS,
    "write /workflow/code/step.py": EROFS,
    "write /workflow/runs/run-1 (real run)": EROFS,
    # The view of the workflow folder has no db/ and no runs/test-* at all.
    "write /workflow/db/db.sqlite": ENOENT,
    "write /workflow/db/db.sqlite-wal": ENOENT,
    "write /workflow/db/db.sqlite-shm": ENOENT,
    "write /crew/a/crew.txt": EROFS,
    "create /crew/a/new.txt": EROFS,
    # root-owned files written by the runner / the image: EACCES may come first
    "write /test/prompt.md": EROFS | EACCES,
    "write /etc/passwd": EROFS | EACCES,
    "create /etc/evil": EROFS,
    "create /usr/bin/evil": EROFS,
    "create /usr/local/lib/python3.11/evil.pth": EROFS,
    "forge the record test_mode.json": ENOENT,
    "forge the action log": ENOENT,
    "create a file in the run root": ENOENT,
    "rename a fake record over test_mode.json": ENOENT,
    "sqlite INSERT into the real DB": {"OperationalError"},
    "unlink the real DB": ENOENT,
    "rename workflow.toml": EROFS,
    "rmtree /workflow/code": EROFS,
    "chmod workflow.toml 777": EROFS | EPERM,
    "truncate the real DB": ENOENT,
    "symlink to the real DB, write through it": ENOENT,
    "dir symlink to /workflow/db, create through it": ENOENT,
    "symlink to the real DB, sqlite INSERT through it": {"OperationalError"},
    "hard link the real DB into the group folder": ENOENT,
    "hard link the real DB into /test/db": ENOENT,
    "hard link the real WAL into the group folder": ENOENT,
    "hard link /test/prompt.md into the group folder": EXDEV,
    "hard link /etc/passwd into /tmp": EXDEV,
    "hard link read-only root-owned /etc/shadow beside itself": EROFS | EPERM,
    "write via /proc/self/root/workflow/db/db.sqlite": ENOENT,
    # pid 1 is the non-dumpable executor: its /proc/1/{root,cwd} are closed to the step.
    "write via /proc/1/root/workflow/workflow.toml": EROFS | {"EACCES"},
    "write via /proc/1/cwd/../../workflow/workflow.toml": EROFS | {"EACCES"},
    "/proc/1/root leads outside the container": {"the container's own root", "EACCES"},
    "exec token in any /proc/*/environ": {"absent"},
    "exec token in another process's memory (/proc/<pid>/mem)": {"absent"},
    "guard config or its tokens in any /proc/*/environ": {"absent"},
    "own environment holds the exec token": {"absent"},
    "executor process found": {"yes"},
    "read the executor's /proc/<pid>/environ": {"EACCES", "EPERM"},
    "open the executor's /proc/<pid>/mem": {"EACCES", "EPERM"},
    "processes of another uid (the guard's 10002) in /proc": {"none"},
    "kill(pid, 0) over pids 1..70000 reaches a foreign process": {"only own processes"},
    "the guard's files (/guard) are visible": {"absent"},
    "mount tmpfs on /tmp": EPERM,
    "remount /workflow read-write": EPERM,
    "umount2 /workflow": EPERM,
    "unshare(CLONE_NEWUSER)": EPERM,
    "unshare(CLONE_NEWNET)": EPERM,
    "unshare(CLONE_NEWNS)": EPERM,
    "clone(CLONE_NEWUSER)": EPERM,
    "setns(/proc/self/ns/user)": EPERM,
    "chroot /tmp": EPERM,
    "pivot_root": EPERM,
    "ptrace(PTRACE_TRACEME)": EPERM,
    "ptrace(PTRACE_ATTACH, 1)": EPERM,
    # EACCES: pid 1 (the non-dumpable executor) hides even its maps; EPERM: seccomp.
    "process_vm_readv(pid 1)": EPERM | {"EACCES"},
    "keyctl(GET_KEYRING_ID)": EPERM,
    "add_key(user)": EPERM,
    "request_key(user)": EPERM,
    "bpf(BPF_MAP_CREATE)": EPERM,
    "init_module": EPERM,
    "finit_module(/dev/null)": EPERM,
    "delete_module": EPERM,
    "perf_event_open": EPERM,
    "userfaultfd": EPERM,
    "io_uring_setup": EPERM,
    "open_by_handle_at (shocker)": EPERM,
    "kexec_load": EPERM,
    "reboot": EPERM,
    "setuid(0)": EPERM,
    "int 0x80 (32-bit syscall)": {"SIGSYS"},
    "capabilities held": {"none, no-new-privs, seccomp filter"},
    "oom_score_adj -1000 (unkillable)": {"EACCES", "EPERM"},
    "setuid/setgid files in the image": {"none"},
    "su root": {"failed"},
    "sudo": {"absent", "failed"},
    "Docker/containerd socket reachable": {"absent"},
    "unix socket files anywhere": {"none"},
    "abstract unix sockets in the namespace": {"none"},
    "mknod /tmp/mem (char 1,1)": EPERM,
    "mknod block device in the group folder": EPERM,
    "/dev contents": {"only the usual safe nodes"},
    "create a node in /dev": {"EACCES"},
    "write /proc/sys/kernel/core_pattern": EROFS,
    "write /proc/sysrq-trigger": EROFS | {"ENOENT", "EACCES"},
    # EACCES under userns-remap: the files belong to the host's root, unmapped there.
    "write cgroup release_agent": EROFS | {"ENOENT", "EACCES"},
    "raise cgroup pids.max": EROFS | {"EACCES"},
    "write /sys/kernel/uevent_helper": EROFS | {"ENOENT", "EACCES"},
    "host-side traps planted": {"planted"},
}
