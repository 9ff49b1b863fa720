"""The step container's executor: runs local and DB tools as the step's own user.

The step container's command is wrapped as::

    python3 -m agentworks_exec -- <step argv...>

(in the step image this package is ``agentworks_exec``; in this repository it is
``sandbox.stepside.agentworks_exec``).
The guard decides policy; this wrapper only *executes* what the guard allowed,
inside the step container, with exactly the step's uid, mounts and limits. It
therefore never grants more than the step already has: the container is the
boundary, the checks here keep tool calls inside the group folder and make
every failure a readable tool result.

Standard library only: the ``sandbox`` package (and pydantic) are not in the
step image. The JSON shapes are those of ``sandbox.contracts.wire.ExecRequest`` (request)
and ``sandbox.contracts.wire.ToolResult`` (reply), written by hand.

Modules by job: ``supervisor`` (PID 1: start-up, the step as a child, reaping),
``server`` (the HTTP API), ``executor`` (tools by name), ``filetools``, ``shell``,
``db``, with ``results``, ``toolargs``, ``pathsafety`` and ``preflight`` beside them.

Start-up (``supervisor.main``):

* ``AGENTWORKS_EXEC_PORT`` and ``AGENTWORKS_EXEC_TOKEN`` are read and removed
  from the environment, so the step command never inherits them, and the
  process makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``) so
  same-uid processes cannot read its ``/proc/<pid>/environ`` or memory.
* No port: the step command is ``exec``-ed in place (no server).
* Port but no token: refuse to start (exit 2); an unauthenticated executor is
  a configuration bug, and we fail closed.
* Otherwise an HTTP server is bound to ``127.0.0.1:<port>`` *before* the step
  command starts; the step runs as a child (stdin/stdout/stderr inherited),
  SIGTERM/SIGINT/SIGHUP are forwarded to it, and the wrapper exits with its
  exit code (``128 + signal`` when it died of a signal; 127 when it cannot be
  found, 126 when it cannot be executed).

The executor is the container's PID 1 and reaps orphaned grandchildren itself
(``supervisor.reap_until_exit``); the step container runs without ``--init``, since
an init process would keep the container's environment, executor token included,
readable by the step in ``/proc/1/environ``.

HTTP API (quiet: nothing is logged, stderr belongs to the step):

* ``GET /v1/health`` -> ``200 {"ok": true}`` (no auth).
* ``POST /v1/exec`` with ``Authorization: Bearer <token>`` and a JSON body
  ``{"tool": str, "arguments": {...}}`` (at most 4 MiB) -> ``200`` with
  ``{"text": str, "data": any, "is_error": bool}``. Bad or missing token: 401;
  body too big: 413; malformed body: 400; all as ``{"error": "..."}``. A tool
  call never fails at the HTTP level: refusals, errors and exceptions are
  ``is_error: true`` results with a clear text.

Tools (every path is relative to ROOT = the start-up cwd, i.e. the group
folder, or ``$AGENTWORKS_EXEC_ROOT``; it goes through
:func:`check_tool_path` and must still be inside ROOT after resolving
symlinks):

* ``read_file {path, offset=0, limit=2000}``: raw text of lines
  ``[offset, offset+limit)`` (0-based), at most 256 KiB.
* ``write_file {path, content}``: creates parent folders; never writes through
  a symlink (``O_NOFOLLOW``).
* ``edit_file {path, old, new}``: ``old`` must occur exactly once.
* ``list_dir {path="."}``: sorted; folders end in ``/``; links are
  ``name -> target``; at most 1000 entries.
* ``search_files {pattern, path=".", glob?}``: Python regex; ``relpath:lineno:
  line`` (path relative to ROOT); skips ``.git``, symlinks, binary files and
  files over 2 MiB; at most 500 matches. ``glob`` is matched (fnmatch) against
  the file name, or against the ROOT-relative path when it contains ``/``.
* ``execute_shell_command {command, timeout_s=120}``: ``/bin/sh -c`` in ROOT,
  in its own session/process group; timeout clamped to [1, 600] s. The call
  ends when the shell has exited *and* its output is closed, or at the
  deadline, when the whole process group is killed (SIGKILL). Background
  processes that detach their output (``cmd > log 2>&1 &``) keep running.
  ``data = {"exit_code", "timed_out", "timeout_s"}`` (exit code ``128 + sig``
  when killed by a signal); ``text`` is the last 8,000 characters of the
  combined stdout+stderr; ``is_error`` when it timed out or exited non-zero.
* ``query_workflow_db {sql, params=[]}``: one statement on ``$DB_PATH``
  (read at call time) opened read-only (``mode=ro`` and ``query_only``);
  ``data = {"columns", "rows", "truncated"}`` (1000 rows at most, blobs as
  hex).
* ``mutate_workflow_db`` / ``agentworks_db {sql, params=[]}``: one statement,
  read-write, committed; ``data = {"rowcount", "lastrowid"}`` plus
  ``"columns"``/``"rows"`` when the statement returns rows.

Both DB connections use a 10 s busy timeout, refuse ``ATTACH`` (only the DB
copy is reachable) and interrupt a statement after 60 s. Which SQL is allowed
at all is the guard's decision, not this module's.

Known limits: paths are checked and then used, so a step that swaps a folder
for a symlink at the same moment can race the check; that gains it nothing it
could not do itself (same uid, same mounts). A pathological regular
expression can keep one server thread busy.
"""
