"""Integrity of saved checkpoints: SHA-256 checksums of every item, checked after a restore.

Orbax restores flipped bytes in a data file without complaint, so `Checkpointer.save` stores
`state_checksums` of the arrays it writes and `json_checksum` of the host item as a third item,
and `verify` recomputes them from what was read back. Hashing the restored values (not the files)
also covers a changed storage layout and is independent of how orbax splits data into files.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from typing import Any

import jax
import numpy as np

from marl_jax.errors import ReportedError


class CheckpointDamagedError(ReportedError, RuntimeError):
  """A checkpoint's items are missing, unreadable or do not match their saved checksums."""


def one_line(e: BaseException) -> str:
  """`Type: first line` of the innermost cause (orbax wraps tensorstore's precise error)."""
  while e.__cause__ is not None or e.__context__ is not None:
    e = e.__cause__ or e.__context__
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return f"{type(e).__name__}: {(lines[0] if lines else '')[:200]}"


def state_checksums(state: Any) -> dict[str, str]:
  """SHA-256 of each array leaf's dtype, shape and bytes, by leaf name.

  Leaves are hashed in threads (hashlib releases the GIL), one leaf on the host per thread at a
  time. Multi-host: leaves no process holds whole are not hashed (orbax's own checks only).
  """
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  # Simple names ("train/params/w") are the same for a namedtuple field and the dict orbax
  # restores it as.
  leaves = [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf) for path, leaf in flat
            if getattr(leaf, "is_fully_addressable", True)]
  with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
    digests = pool.map(_digest, [leaf for _, leaf in leaves])
  return dict(zip([name for name, _ in leaves], digests))


def _digest(leaf: Any) -> str:
  value = np.ascontiguousarray(leaf)
  digest = hashlib.sha256(f"{value.dtype}{value.shape}".encode())
  digest.update(value.reshape(-1).view(np.uint8))  # no copy; works for bfloat16 too
  return digest.hexdigest()


def json_checksum(item: Any) -> str:
  return hashlib.sha256(json.dumps(item, sort_keys=True).encode()).hexdigest()


def verify(restored: Any) -> None:
  """Raises CheckpointDamagedError unless the restored items match their saved checksums."""
  try:
    saved_state, saved_host = restored.checksums["state"], restored.checksums["host"]
  except (KeyError, TypeError) as e:
    raise CheckpointDamagedError(f"its checksums item is malformed ({e!r})") from e
  got = state_checksums(restored.state)
  # A leaf not hashed here (multi-host, not held whole by this process) is not compared.
  bad = sorted(name for name, digest in saved_state.items() if got.get(name, digest) != digest)
  if bad:
    raise CheckpointDamagedError(f"{len(bad)} state array(s) do not match their saved checksums "
                                 f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
  if json_checksum(restored.host) != saved_host:
    raise CheckpointDamagedError("its host item does not match its saved checksum")
