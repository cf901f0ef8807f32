"""One writer per workdir: an exclusive lock that `train` holds for its whole run.

Two trainers on one workdir corrupted it without a word: two fresh ones both died at their first
checkpoint save, and two resumes each rewrote `metrics.jsonl` at start, losing a row. Every
process that writes a run's checkpoints and metrics (`trainer.train`, so also `reproduce`'s
cells) takes this lock first; a second writer is refused in one line naming the holder (pid,
host, command, since when). Readers (`evaluate`, `traces`, `grad_spikes`) do not take it: they
open checkpoints read-only (`checkpoint.Checkpointer(read_only=True)`) and write only files of
their own.

The lock is `flock(LOCK_EX | LOCK_NB)` on `<workdir>/writer.lock`, so the kernel releases it when
the holder dies however it dies (no stale lock to clean up); the file's text names the holder.
A cloud workdir (`gs://...`) cannot be flocked and is not locked (orbax coordinates the hosts of
one run there). In a multi-host run only process 0 locks (`enabled`).
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
_MAX_COMMAND = 300


class WorkdirBusy(UserInputError):
  """Another process writes this workdir; the message names it."""


@contextlib.contextmanager
def exclusive(workdir: str | os.PathLike[str], *, enabled: bool = True) -> Iterator[None]:
  """Holds the workdir's writer lock for the block; raises WorkdirBusy if another process holds
  it. Creates the workdir if needed."""
  if not enabled or "://" in str(workdir):
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
