"""The multi-host side of checkpoints: process-local leaves and per-process host states.

Orbax writes only global arrays, so a process-local leaf (e.g. an RNG key made with
`jax.random.key` on each process) is saved as a replicated array after checking that every
process holds the same value, and restored to the target's local sharding; the host states of all
processes are gathered into process 0's JSON item. With one process every function here is the
identity (`checkpoint.py`'s module doc has the whole picture).
"""
from __future__ import annotations

import json
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

PyTree = Any


def is_host_local(leaf: Any) -> bool:
  """A leaf that lives on this process only (numpy, single-device...) in a multi-host run."""
  if jax.process_count() == 1:
    return False
  sharding = getattr(leaf, "sharding", None)
  return sharding is None or sharding.is_fully_addressable


def replicated() -> NamedSharding:
  """Replicated over every device of every process."""
  return NamedSharding(Mesh(np.array(jax.devices()), ("devices",)), P())


def replicate_host_local(state: PyTree) -> PyTree:
  """Makes process-local leaves global replicated arrays (orbax saves only global arrays)."""
  if jax.process_count() == 1:
    return state

  def convert(path, leaf):
    if not is_host_local(leaf):
      return leaf
    value = np.asarray(leaf)
    gathered = multihost_utils.process_allgather(value)  # [num_processes, ...]
    if any(row.tobytes() != value.tobytes() for row in gathered):
      raise ValueError(f"state leaf {jax.tree_util.keystr(path)} is process-local and differs "
                       f"between processes; keep per-process values in host_state instead")
    return jax.make_array_from_callback(value.shape, replicated(), lambda index: value[index])

  return jax.tree_util.tree_map_with_path(convert, state)


def to_host_local(state: PyTree, target: PyTree) -> PyTree:
  """Moves leaves restored replicated back to their process-local target sharding."""

  def convert(leaf, target_leaf):
    if not is_host_local(target_leaf):
      return leaf
    value = np.asarray(leaf.addressable_data(0))
    sharding = getattr(target_leaf, "sharding", None)
    return value if sharding is None else jax.device_put(value, sharding)

  return jax.tree.map(convert, state, target)


def gather_host_states(host_state: dict[str, Any]) -> list[dict[str, Any]]:
  """All processes' host states, in process order (JSON bytes all-gathered across hosts)."""
  if jax.process_count() == 1:
    return [host_state]
  data = np.frombuffer(json.dumps(host_state).encode(), dtype=np.uint8)
  lengths = multihost_utils.process_allgather(np.array([data.size], np.int32)).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:data.size] = data
  rows = multihost_utils.process_allgather(padded)  # [num_processes, max_length]
  return [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths)]


def own_host_state(process_states: list[dict[str, Any]]) -> dict[str, Any]:
  if len(process_states) != jax.process_count():
    raise ValueError(f"checkpoint holds host states of {len(process_states)} processes but this "
                     f"run has {jax.process_count()}; resume with the same number of processes")
  return process_states[jax.process_index()]
