"""One writer per workdir, any number of readers beside it: the two roles of a run's workdir.

Writer: an exclusive lock that `train` holds for its whole run. Two trainers on one workdir
corrupted it without a word: two fresh ones both died at their first checkpoint save, and two
resumes each rewrote `metrics.jsonl` at start, losing a row. Every process that writes a run's
checkpoints and metrics (`trainer.train`, so also `reproduce`'s cells) takes this lock first; a
second writer is refused in one line naming the holder (pid, host, command, since when).

Readers (`evaluate`, `export`, `export_check`, the lm-eval `harness`, `init_from`) run beside a
live writer and never stop it: they open checkpoints read-only
(`checkpoint.Checkpointer(read_only=True)`: no clean-up of the writer's in-progress saves, which
killed a trainer when `export` opened its store read-write), write only files of their own, and
hold the step they read (`reading`), which the writer's rotation then keeps until they let go
(`held_steps`), so a slow export is not deleted from under itself.

The writer's lock is `flock(LOCK_EX | LOCK_NB)` on `<workdir>/writer.lock`; a reader's is
`flock(LOCK_SH)` on `<workdir>/readers/STEP.lock`. The kernel releases either when its holder
dies however it dies (no stale lock to clean up); the writer's file names the holder. A cloud
workdir (`gs://...`) cannot be flocked and is not locked (orbax coordinates the hosts of one run
there). In a multi-host run only process 0 locks (`enabled`).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator

from marl_jax.errors import UserInputError

LOCK_FILE = "writer.lock"
READERS_DIR = "readers"
_MAX_COMMAND = 300


class WorkdirBusy(UserInputError):
  """Another process writes this workdir; the message names it."""


@contextlib.contextmanager
def exclusive(workdir: str | os.PathLike[str], *, enabled: bool = True) -> Iterator[None]:
  """Holds the workdir's writer lock for the block; raises WorkdirBusy if another process holds
  it. Creates the workdir if needed."""
  if not enabled or _is_cloud(workdir):
    yield
    return
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise WorkdirBusy(f"workdir {str(workdir)!r} is being written by {_holder(fd)}; expected "
                        "one writer per workdir: wait for it to end, or use another "
                        "--workdir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_me()).encode(), 0)
    yield
  finally:
    os.close(fd)  # releases the lock; the file stays, naming the last holder


@contextlib.contextmanager
def reading(workdir: str | os.PathLike[str], step: int) -> Iterator[None]:
  """Holds checkpoint `step` of the workdir's run for the block, as a reader: the writer keeps it
  through its rotation meanwhile (`held_steps`). Never waits on, nor refuses, the writer."""
  if _is_cloud(workdir):
    yield
    return
  directory = os.path.join(workdir, READERS_DIR)
  try:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, f"{step}.lock"), os.O_RDONLY | os.O_CREAT, 0o644)
  except OSError:  # a workdir this reader cannot write (another user's run): read it unheld
    yield
    return
  try:
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a writer probes this step (a moment)
    yield
  finally:
    os.close(fd)


def held_steps(workdir: str | os.PathLike[str]) -> set[int]:
  """The checkpoint steps readers hold now (`reading`): a step's lock file that an exclusive
  probe cannot take."""
  directory = os.path.join(workdir, READERS_DIR)
  if _is_cloud(workdir) or not os.path.isdir(directory):
    return set()
  held = set()
  for name in os.listdir(directory):
    stem = name.removesuffix(".lock")
    if not (name.endswith(".lock") and stem.isdigit()):
      continue
    try:
      fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    except FileNotFoundError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      held.add(int(stem))
    finally:
      os.close(fd)
  return held


def _is_cloud(workdir: str | os.PathLike[str]) -> bool:
  return "://" in str(workdir)


def _me() -> dict[str, object]:
  command = " ".join([os.path.basename(sys.executable)] + sys.argv)
  return {"pid": os.getpid(), "host": socket.gethostname(), "command": command[:_MAX_COMMAND],
          "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def _holder(fd: int) -> str:
  """The holder as its lock file names it (one line)."""
  try:
    info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
    return (f"pid {int(info['pid'])} on {info['host']} since {info['since']} "
            f"({' '.join(str(info['command']).split())})")
  except (OSError, ValueError, KeyError, TypeError):
    return "a process that is starting (its lock file names no holder yet)"
