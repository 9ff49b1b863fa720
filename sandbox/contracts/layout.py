"""Where a test run's files live, on the host and inside the containers.

One place names every path so no module builds one by hand. The run root
(`runs/test-<id>/`) holds the record and the action log and is never mounted
writable into the step. While the step runs, its writable folders are folders of
the run's own disk (`.disk/`, see `sandbox.stepfs.disk`), and the workflow folder it sees
is the run's view of it (`.view/`, see `sandbox.stepfs.view`); after the run the
group folder and the DB copy are in the run root (`<group>/`, `db/`).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from sandbox.contracts.status import ACTIONS_FILE, RECORD_FILE, REPORT_FILE, VERIFICATION_FILE

TEST_RUN_PREFIX = "test-"
# The verification history's folder: under a test-run name so everything test mode
# writes is below `runs/test-*` (Pulse skips those), yet no run: `is_test_run` is False.
HISTORY_DIR = "test-verifications"
# In the run root, while the step runs (see RunLayout).
DISK_IMAGE = ".disk.img"
DISK_MOUNT = ".disk"
WORKFLOW_VIEW = ".view"
VIEW_LAYER = ".view-hidden"
# In the run root, beside the group folder (see RunLayout).
DB_DIR = "db"
BASELINE_DIR = ".baseline"
PROMPT_FILE = "prompt.md"
CA_BUNDLE_FILE = "ca-bundle.pem"
GUARD_DIR = "guard"
MCP_DIR = "mcp"
MCP_STDERR_DIR = "mcp-stderr"
STEPS_DIR = "steps"  # in a workflow run's root: one run root per step

# Inside the step container.
C_WORKFLOW = "/workflow"
C_TEST = "/test"
C_DB_DIR = "/test/db"
C_DB_PATH = "/test/db/db.sqlite"
C_TMP = "/tmp"
C_PROMPT = "/test/prompt.md"
C_CA_BUNDLE = "/test/ca-bundle.pem"
C_CREW = "/crew"

# Fixed, distinct ids (created in the step image): the firewall tells the
# guard's traffic from the step's by uid.
STEP_UID = 10001
GUARD_UID = 10002
# Each stdio MCP server runs as its own uid (and gid): MCP_UID_BASE + its index.
MCP_UID_BASE = 10100

# Inside a stdio MCP server's container: its own folder of the run (read-only),
# holding the guard's sockets for it.
C_MCP_DIR = "/run/mcp"
MCP_SOCKET = "mcp.sock"  # the server's stdio
MCP_EGRESS_SOCKET = "egress.sock"  # its egress proxy (only with an egress allow list)
# Where a server's relay listens for its proxy, on loopback: the first server's port
# and one more per index. On Docker each server has a loopback of its own; the
# containers of a Pod share one, so each server needs a port of its own there.
MCP_PROXY_PORT = 3128
C_MCP_CA_BUNDLE = "/run/ca-bundle.pem"  # system CAs plus the run's (TLS inspection)


def is_test_run(name: str) -> bool:
    """A name in `runs/` that is a test run's folder (not the verification history's)."""
    return name.startswith(TEST_RUN_PREFIX) and name != HISTORY_DIR


def mcp_uid(index: int) -> int:
    return MCP_UID_BASE + index


def mcp_proxy_port(index: int) -> int:
    """The relay's proxy port of the server at `index` (below the guard's 87xx ports)."""
    return MCP_PROXY_PORT + index


def new_run_id(now: datetime | None = None) -> str:
    """Sortable by time, unique without coordination."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S")
    return f"{TEST_RUN_PREFIX}{stamp}-{secrets.token_hex(3)}"


def new_step_run_id(workflow_run_id: str, index: int) -> str:
    """A chain step's own run id: its workflow run's, and its place in the chain."""
    return f"{workflow_run_id}-s{index}"


@dataclass(frozen=True)
class RunLayout:
    """One test run's paths. `root_dir` places a chain step's run root inside its
    workflow run (`runs/test-<id>/steps/<n>-<step>/`); unset, it is `runs/<run_id>/`."""

    workflow_dir: Path
    run_id: str
    group: str
    root_dir: Path | None = None

    @property
    def runs_dir(self) -> Path:
        return self.workflow_dir / "runs"

    @property
    def root(self) -> Path:
        return self.root_dir if self.root_dir is not None else self.runs_dir / self.run_id

    @property
    def group_dir(self) -> Path:
        return self.root / self.group

    @property
    def db_dir(self) -> Path:
        return self.root / DB_DIR

    @property
    def db_path(self) -> Path:
        return self.db_dir / "db.sqlite"

    @property
    def baseline_db(self) -> Path:
        """A pristine second copy for the end-of-run diff; never mounted."""
        return self.root / BASELINE_DIR / "db.sqlite"

    @property
    def record(self) -> Path:
        return self.root / RECORD_FILE

    @property
    def actions(self) -> Path:
        return self.root / ACTIONS_FILE

    @property
    def prompt(self) -> Path:
        return self.root / PROMPT_FILE

    @property
    def ca_bundle(self) -> Path:
        """System CAs plus this run's egress CA (when some allow-list entry is inspected)."""
        return self.root / CA_BUNDLE_FILE

    @property
    def guard_dir(self) -> Path:
        """The guard's own writable folder (logs, MCP servers' stderr)."""
        return self.root / GUARD_DIR

    # -- while the step runs (mounts the runner makes and removes) ---------------

    @property
    def disk_image(self) -> Path:
        """The sparse file holding the step's disk (as large as the disk quota)."""
        return self.root / DISK_IMAGE

    @property
    def disk_mount(self) -> Path:
        return self.root / DISK_MOUNT

    @property
    def disk_group(self) -> Path:
        """The step's group folder on its disk (`/test/<group>` inside)."""
        return self.disk_mount / "group"

    @property
    def disk_db(self) -> Path:
        """The DB copy's folder on the step's disk (`/test/db` inside)."""
        return self.disk_mount / "db"

    @property
    def disk_tmp(self) -> Path:
        """The step's /tmp on its disk."""
        return self.disk_mount / "tmp"

    @property
    def workflow_view(self) -> Path:
        """The workflow folder as every container of the run sees it (`/workflow`)."""
        return self.root / WORKFLOW_VIEW

    @property
    def view_layer(self) -> Path:
        """What the view leaves out (`db/`, every `runs/test-*`), as overlay whiteouts."""
        return self.root / VIEW_LAYER

    @property
    def mcp_dir(self) -> Path:
        """The guard's sockets for stdio MCP servers, one folder per server (guard uid)."""
        return self.root / MCP_DIR

    def mcp_server_dir(self, name: str) -> Path:
        return self.mcp_dir / name

    @property
    def mcp_stderr_dir(self) -> Path:
        """The servers' stderr, as the host read it back at the end (root only)."""
        return self.root / MCP_STDERR_DIR

    @property
    def container_workdir(self) -> str:
        return f"{C_TEST}/{self.group}"


@dataclass(frozen=True)
class WorkflowRunLayout:
    """A whole-workflow test run: one `runs/test-<id>/` for the chain.

    Its root holds the workflow record and the chain's action log (every step's
    lines, in order, each naming its step); each step's own run (its record, its
    guard's folder, its group folder and DB copy as the step left them) is a run
    root under `steps/`. What a step leaves is what the next step of the same group
    (and every later step, for the DB copy) starts from."""

    workflow_dir: Path
    run_id: str

    @property
    def runs_dir(self) -> Path:
        return self.workflow_dir / "runs"

    @property
    def root(self) -> Path:
        return self.runs_dir / self.run_id

    @property
    def record(self) -> Path:
        return self.root / RECORD_FILE

    @property
    def actions(self) -> Path:
        return self.root / ACTIONS_FILE

    @property
    def steps_dir(self) -> Path:
        return self.root / STEPS_DIR

    def step(self, index: int, step_id: str, group: str) -> RunLayout:
        """The run layout of the chain's `index`-th step (1-based)."""
        return RunLayout(
            self.workflow_dir,
            new_step_run_id(self.run_id, index),
            group,
            root_dir=self.steps_dir / f"{index}-{step_id}",
        )


# Every name a run root (a step's or a chain's) holds besides the group folder: a
# group folder of one of these names would be the run's own file or folder
# (`sandbox.contracts.config` refuses such a group at load).
RUN_ROOT_NAMES: Final = frozenset(
    {
        RECORD_FILE,
        ACTIONS_FILE,
        VERIFICATION_FILE,
        REPORT_FILE,
        DB_DIR,
        BASELINE_DIR,
        PROMPT_FILE,
        CA_BUNDLE_FILE,
        GUARD_DIR,
        MCP_DIR,
        MCP_STDERR_DIR,
        STEPS_DIR,
        DISK_IMAGE,
        DISK_MOUNT,
        WORKFLOW_VIEW,
        VIEW_LAYER,
    }
)


def make_private_dir(path: Path, mode: int = 0o755) -> None:
    """mkdir that refuses to work through a symlink planted at the path."""
    os.mkdir(path, mode)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        raise OSError(f"{path} is not a directory we created")
