"""The host-level exchanges of a multi-host run: problem slices, agreed shapes, global metrics,
process-local params.

A multi-host run is SPMD (`parallel/distributed.py`). Every process rolls out its own contiguous
slice of a step's problems (`process_slice`), so problem, trajectory and node ids stay globally
dense and the estimators' `GroupSpace` keeps its global counts; each process builds its rows of
the batch padded to sizes all processes agree on (`agree_max`), and
`distributed.process_local_batch_to_global` assembles the global arrays of the train step.
Host-side metrics are reduced as (sum, count) pairs (`global_means`) so process 0 logs the values
of the whole step, and the sampler runs on a process-local view of the sharded params
(`process_local`).

`agree_max` and `global_means` are collectives (one `process_allgather` of a few numbers, i.e. one
round trip through the distributed runtime): every process must call them in the same order with
the same names. With one process every function here is the identity and exchanges nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from marl_jax.parallel.mesh import AXES, DATA, FSDP


def process_slice(count: int, process_index: int | None = None,
                  process_count: int | None = None) -> range:
  """The contiguous ids in [0, count) a process owns; the first `count % processes` get one more.

  Contiguous slices keep every group (all samples of a problem) on one process and the global
  order of samples equal to the order of a single-process run.
  """
  index = jax.process_index() if process_index is None else process_index
  procs = jax.process_count() if process_count is None else process_count
  if not 0 <= index < procs:
    raise ValueError(f"process_index {index}; expected 0 <= process_index < {procs}")
  base, extra = divmod(count, procs)
  start = index * base + min(index, extra)
  return range(start, start + base + (index < extra))


def process_key(key: jax.Array) -> jax.Array:
  """This process's sampling stream: `key` itself for one process (single-process runs keep
  their streams), `fold_in(key, process_index)` with several, so no two hosts draw the same
  random numbers for the rows at the same positions of their sampler calls."""
  return key if jax.process_count() == 1 else jax.random.fold_in(key, jax.process_index())


def agree_max(values: Sequence[int]) -> tuple[int, ...]:
  """Element-wise maximum of `values` over processes (e.g. bucketed rows and token widths)."""
  local = np.asarray(values, np.int32)
  if jax.process_count() == 1:
    return tuple(int(v) for v in local)
  return tuple(int(v) for v in np.asarray(multihost_utils.process_allgather(local)).max(0))


def sum_count(values: Sequence[float]) -> tuple[float, int]:
  """(sum, count) of `values` for `global_means`; the sum is NumPy's pairwise float64 sum, the
  one `np.mean` takes, so a single process reproduces `np.mean(values)` exactly."""
  return float(np.sum(np.asarray(values, np.float64))), len(values)


def _allgather_f64(x: np.ndarray) -> np.ndarray:
  """[processes, ...] float64 values of every process. Without jax_enable_x64 a float64 array
  would be rounded to float32 on its way through jax, so its bits travel as uint32 pairs."""
  bits = np.ascontiguousarray(x, np.float64).view(np.uint32)
  gathered = np.asarray(multihost_utils.process_allgather(bits))
  return np.ascontiguousarray(gathered).view(np.float64)


def global_means(parts: Mapping[str, tuple[float, float]]) -> dict[str, float]:
  """name -> (sum, count) on this process  ->  name -> sum / count over all processes.

  Names whose count is 0 on every process are left out. Every process must pass the same names.
  With one process the value is `sum / count`, bit for bit what `np.mean` returns.
  """
  names = sorted(parts)
  local = np.asarray([parts[k] for k in names], np.float64).reshape(len(names), 2)
  total = local if jax.process_count() == 1 else _allgather_f64(local).sum(0)
  return {k: float(s / n) for k, (s, n) in zip(names, total) if n > 0}


def _local_block(mesh: Mesh) -> Mesh | None:
  """This process's devices as a mesh with the same axes, if they are whole ('fsdp', 'tensor')
  planes of `mesh` (only 'data' crosses hosts, as launch/README.md recommends); else None."""
  mine = np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices)
  rows = np.flatnonzero(mine.all(axis=(1, 2)))
  if rows.size == 0 or mine.sum() != rows.size * mesh.devices[0].size:
    return None
  return Mesh(mesh.devices[rows], mesh.axis_names, axis_types=mesh.axis_types)


def _alias(x: jax.Array, block: Mesh | None) -> jax.Array | None:
  """`x` over `block` without copying, when the local shards hold all of it; else None."""
  s = x.sharding
  if block is None or not isinstance(s, NamedSharding):
    return None
  used = {a for entry in s.spec if entry is not None
          for a in (entry if isinstance(entry, tuple) else (entry,))}
  if DATA in used:  # the local shards hold only part of the leaf
    return None
  return jax.make_array_from_single_device_arrays(
      x.shape, NamedSharding(block, s.spec), [shard.data for shard in x.addressable_shards])


def _local_spec(x: jax.Array, size: int) -> P:
  """The leaf's own spec over a local ('fsdp' = all local devices) mesh when it is sharded along
  'fsdp' only and the dimension divides; else replicated."""
  spec = getattr(x.sharding, "spec", P())
  entries = tuple(spec)
  if any(e not in (None, FSDP) for e in entries):
    return P()
  if any(e == FSDP and x.shape[i] % size for i, e in enumerate(entries)):
    return P()
  return spec


def process_local(tree: Any, mesh: Mesh) -> Any:
  """`tree` (arrays on the global `mesh`) as arrays on this process's devices only, so host code
  such as the sampler runs jitted programs on them without the other processes.

  Per leaf, one of:
    * already fully addressable: returned as is (always the case with one process);
    * alias (no copy): when this process's devices are whole ('fsdp', 'tensor') planes of the
      mesh and the leaf is not split along 'data' (params never are), the local shards already
      hold the whole leaf; they are re-wrapped as an array with the same spec over a mesh of the
      local devices. The view shares the buffers of `tree`, so it dies with them: the train step
      donates the old state, so derive a fresh view after every step.
    * gather: otherwise ('fsdp' spans hosts) the leaf is all-gathered with `process_allgather`,
      one leaf at a time (the reshard puts the whole leaf on every device for a moment), copied
      to host memory and placed on the local devices, FSDP-sharded over them where it divides.
      Cost per call: every host receives the full param bytes over the network (one leaf at a
      time passes through host memory) and its devices then hold one more copy of the params,
      sharded over them; derive it once per step, not per sampler call.
  Every process must call this with the same tree and mesh (the gather is a collective).
  """
  if jax.process_count() == 1:
    return tree
  block = _local_block(mesh)
  local = Mesh(np.asarray(jax.local_devices()).reshape(1, -1, 1), AXES,
               axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))

  def leaf(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    view = _alias(x, block)
    if view is not None:
      return view
    host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.device_put(host, NamedSharding(local, _local_spec(x, jax.local_device_count())))

  return jax.tree.map(leaf, tree)
