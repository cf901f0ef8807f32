"""Each sandboxed program's own process and memory budget, for its whole process tree.

RLIMIT_NPROC is counted per user, and every sandbox runs as the same user: with one shared
counter a fork-bombing sample made its honest neighbours in the same step fail to start their
worker, so one sample's reward depended on another's. RLIMIT_AS bounds each process, not the
program: six children of 400 MB drew 1.9 GB under a 512 MB limit. So each program gets a budget
that no other program shares, by the best mechanism the machine allows (`mode`):

  cgroup v2 / cgroup v1  a fresh cgroup per program (where this process may create them: root
         with a writable cgroupfs, or a delegated subtree) with `pids.max` = the process limit and
         a memory limit (swap included) = the program's total memory; the program joins it
         before it starts (a `sh` trampoline writes itself into `cgroup.procs`, then execs), and
         at the end every process still in it is killed and the group removed.
  uid    root without usable cgroups (a container with a read-only cgroupfs): the program runs
         as a uid of its own from a reserved range (`UID_BASE`; a slot is held by an flock on a
         file, so concurrent programs of several processes never share one), and RLIMIT_NPROC,
         counted per uid, is its own. Memory: RLIMIT_AS per process only (at most
         max_procs x memory_mb for the tree).
  userns  bwrap as an unprivileged user makes a user namespace per sandbox; since Linux 5.14
         RLIMIT_NPROC is counted per (namespace, user), so it is per program too. Memory as for
         `uid`.
  shared  the unconfined backend as a non-root user (or an older kernel): RLIMIT_NPROC counts
         every process and thread of the user, the trainer's own included. It cannot hold; the
         runner warns with the numbers (`user_task_count`).
  none   the unconfined backend as root without cgroups: RLIMIT_NPROC is not enforced for root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import itertools
import os
import platform
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator

UID_BASE = 2_000_000_000  # far above any account's uid; UID_SLOTS of them are the sandbox's
UID_SLOTS = 1024
_CONTROLLERS = ("pids", "memory")
_COUNTER = itertools.count()  # next() on it is atomic under the GIL: names and slots per thread

# Joins the cgroups named before "--" (writing 0 to cgroup.procs moves the writer), then execs
# the rest: the program starts inside its budget, so nothing it forks escapes it.
JOIN = ('while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; exec "$@"')


@dataclasses.dataclass(frozen=True)
class CgroupLayout:
  """Where this process may create per-program cgroups: `parents` maps each controller to the
  directory new groups go under (one directory for both with cgroup v2)."""

  version: int
  parents: tuple[tuple[str, str], ...]  # (controller, directory)


@dataclasses.dataclass(frozen=True)
class Budget:
  """How one program is held to its limits: cgroup.procs files its trampoline joins, the uid it
  runs as (None: the caller decides), and the RLIMIT_NPROC to set (None: none, cgroups count)."""

  join: tuple[str, ...] = ()
  uid: int | None = None
  nproc: int | None = None


def mode(backend: str) -> str:
  """The mechanism (module doc) that bounds one program of `backend` ("bwrap"/"rlimit") here."""
  layout = cgroup_layout()
  if layout is not None:
    return f"cgroup v{layout.version}"
  if os.geteuid() == 0:
    return "uid" if backend == "bwrap" else "none"
  return "userns" if backend == "bwrap" and _per_namespace_nproc() else "shared"


@contextlib.contextmanager
def program_budget(backend: str, *, max_procs: int, memory_mb: int) -> Iterator[Budget]:
  """The budget of one program for the duration of the block (cleaned up after it)."""
  layout = cgroup_layout()
  if layout is not None:
    with _program_cgroup(layout, max_procs=max_procs, memory_mb=memory_mb) as join:
      yield Budget(join=join)
  elif os.geteuid() == 0 and backend == "bwrap":
    with _uid_slot() as uid:
      yield Budget(uid=uid, nproc=max_procs)
  else:
    yield Budget(nproc=max_procs)


def kill_members(budget: Budget) -> None:
  """SIGKILLs every process in the program's cgroups (none without cgroups)."""
  for procs in budget.join:
    for pid in _members(procs):
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _members(procs_file: str) -> list[int]:
  try:
    with open(procs_file, encoding="ascii") as f:
      return [int(p) for p in f.read().split()]
  except (OSError, ValueError):
    return []


def user_task_count(uid: int) -> int:
  """Processes and threads whose real uid is `uid`: what RLIMIT_NPROC compares with (shared
  mode), read from /proc."""
  total = 0
  for entry in os.scandir("/proc"):
    if not entry.name.isdigit():
      continue
    try:
      with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
      if int(fields["Uid"].split()[0]) == uid:
        total += int(fields["Threads"])
    except (OSError, KeyError, ValueError, IndexError):
      continue  # exited while read, or a kernel thread
  return total


@functools.cache
def cgroup_layout() -> CgroupLayout | None:
  """A cgroup hierarchy where this process can create, limit and join groups, probed once by
  doing so; None where it cannot (not root, read-only cgroupfs, controllers not delegated)."""
  for layout in (_v2_layout(), _v1_layout()):
    if layout is not None and _probe(layout):
      return layout
  return None


def _mounts() -> list[tuple[str, str, set[str]]]:
  out = []
  try:
    with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
      for line in f:
        parts = line.split()
        if len(parts) >= 4:
          out.append((parts[1], parts[2], set(parts[3].split(","))))
  except OSError:
    pass
  return out


def _own_cgroups() -> dict[str, str]:
  """Controller ("" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
  own = {}
  try:
    with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as f:
      for line in f:
        parts = line.rstrip("\n").split(":", 2)
        if len(parts) == 3:
          for controller in parts[1].split(",") if parts[1] else [""]:
            own[controller] = parts[2]
  except OSError:
    pass
  return own


def _v2_layout() -> CgroupLayout | None:
  own = _own_cgroups().get("")
  for mountpoint, fstype, _ in _mounts():
    if fstype != "cgroup2" or own is None:
      continue
    base = os.path.join(mountpoint, own.lstrip("/"))
    try:
      with open(os.path.join(base, "cgroup.controllers"), encoding="ascii") as f:
        if not set(_CONTROLLERS) <= set(f.read().split()):
          return None
      with open(os.path.join(base, "cgroup.subtree_control"), encoding="ascii") as f:
        enabled = set(f.read().split())
      if not set(_CONTROLLERS) <= enabled:  # refused (EBUSY) where this cgroup holds processes
        with open(os.path.join(base, "cgroup.subtree_control"), "w", encoding="ascii") as f:
          f.write(" ".join(f"+{c}" for c in _CONTROLLERS))
    except OSError:
      return None
    return CgroupLayout(2, tuple((c, base) for c in _CONTROLLERS))
  return None


def _v1_layout() -> CgroupLayout | None:
  own = _own_cgroups()
  parents = []
  for controller in _CONTROLLERS:
    found = [m for m, fstype, opts in _mounts() if fstype == "cgroup" and controller in opts]
    if not found or controller not in own:
      return None
    parents.append((controller, os.path.join(found[0], own[controller].lstrip("/"))))
  return CgroupLayout(1, tuple(parents))


def _probe(layout: CgroupLayout) -> bool:
  """Creates a group, limits it and has a child join it, as every program will."""
  try:
    with _program_cgroup(layout, max_procs=4, memory_mb=64) as join:
      probe = subprocess.run(["/bin/sh", "-c", JOIN, "sh", *join, "--", "/bin/true"],
                             capture_output=True, timeout=10)
      return probe.returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


@contextlib.contextmanager
def _program_cgroup(layout: CgroupLayout, *, max_procs: int,
                    memory_mb: int) -> Iterator[tuple[str, ...]]:
  name = f"marl_sandbox_{os.getpid()}_{next(_COUNTER)}"
  dirs = sorted({os.path.join(parent, name) for _, parent in layout.parents})
  made = []
  try:
    for directory in dirs:
      os.mkdir(directory)
      made.append(directory)
    limit = str(memory_mb << 20)
    for controller, parent in layout.parents:
      directory = os.path.join(parent, name)
      if controller == "pids":
        _write(directory, "pids.max", str(max_procs))
      elif layout.version == 2:
        _write(directory, "memory.max", limit)
        _write(directory, "memory.swap.max", "0", optional=True)
      else:
        _write(directory, "memory.limit_in_bytes", limit)
        _write(directory, "memory.memsw.limit_in_bytes", limit, optional=True)
    yield tuple(os.path.join(d, "cgroup.procs") for d in dirs)
  finally:
    for directory in made:
      _empty_and_remove(directory)


def _write(directory: str, name: str, value: str, optional: bool = False) -> None:
  path = os.path.join(directory, name)
  if optional and not os.path.exists(path):
    return  # no swap accounting on this kernel: there is no swap to bound
  with open(path, "w", encoding="ascii") as f:
    f.write(value)


def _empty_and_remove(directory: str) -> None:
  """Kills whatever the program left in its group (a daemon that left the session too) and
  removes the group; a group still busy after a second is left behind, empty of our work."""
  deadline = time.monotonic() + 1.0
  while True:
    kill_members(Budget(join=(os.path.join(directory, "cgroup.procs"),)))
    try:
      os.rmdir(directory)
      return
    except FileNotFoundError:
      return
    except OSError:  # EBUSY: a killed process has not left yet
      if time.monotonic() > deadline:
        return
      time.sleep(0.01)


@contextlib.contextmanager
def _uid_slot() -> Iterator[int]:
  """A uid from the reserved range that no other program (of any process) holds meanwhile."""
  directory = os.path.join(tempfile.gettempdir(), "marl_sandbox_uids")
  os.makedirs(directory, mode=0o700, exist_ok=True)
  start = (os.getpid() * 7 + next(_COUNTER)) % UID_SLOTS
  for i in range(UID_SLOTS):
    uid = UID_BASE + (start + i) % UID_SLOTS
    fd = os.open(os.path.join(directory, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      continue
    try:
      yield uid
    finally:
      os.close(fd)  # releases the flock
    return
  raise RuntimeError(f"all {UID_SLOTS} sandbox uids from {UID_BASE} are in use; expected fewer "
                     "concurrent sandboxed programs on this machine")


@functools.cache
def _per_namespace_nproc() -> bool:
  """Linux >= 5.14 counts RLIMIT_NPROC per user namespace (ucounts)."""
  try:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
  except ValueError:
    return False
  return (major, minor) >= (5, 14)
