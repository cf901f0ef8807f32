"""Partition specs for FSDP and the gathers that undo them inside `shard_map`.

A model's params are sharded along the mesh axis 'fsdp' on one dimension per leaf (the largest
one the axis size divides, never the stacked layer axis L so that the layer scan slices stay
local). Inside the shard_map'ed train step, leaves outside the layer stack (embedding, final norm,
LM head) are all-gathered once before use, and each layer's slice is all-gathered inside the scan
by a `layer_hook`, so only one layer is ever whole on a device. Autodiff turns each all-gather into
a reduce-scatter of its gradient. Small leaves (norm scales, LoRA adapters) stay replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from marl_jax.models.decoder import LayerHook, Params
from marl_jax.parallel.mesh import FSDP

SpecTree = Any  # a params-shaped pytree of PartitionSpec

# Leaves with fewer elements than this (per layer for stacked layers) are not worth a collective.
MIN_SHARD_ELEMENTS = 1024


def is_spec(x) -> bool:
  return isinstance(x, P)


def leaf_spec(shape: tuple[int, ...], fsdp_size: int, skip: int = 0,
              min_elements: int = MIN_SHARD_ELEMENTS) -> P:
  """Shards the largest dimension at index >= `skip` that `fsdp_size` divides; else replicates.

  `skip` protects leading stacked axes (policies P, layers L) that must stay whole.
  """
  dims = shape[skip:]
  if fsdp_size == 1 or not dims or int(np.prod(dims)) < min_elements:
    return P()
  candidates = [i for i, n in enumerate(dims) if n % fsdp_size == 0]
  if not candidates:
    return P()
  best = max(candidates, key=lambda i: dims[i])  # ties: the earliest dimension
  spec = [None] * len(shape)
  spec[skip + best] = FSDP
  return P(*spec)


def model_specs(params: Params, fsdp_size: int, min_elements: int = MIN_SHARD_ELEMENTS) -> SpecTree:
  """FSDP specs for one decoder's params (layout in `models/config.py`)."""
  specs = {k: jax.tree.map(lambda x: leaf_spec(x.shape, fsdp_size, 0, min_elements), v)
           for k, v in params.items() if k != "layers"}
  specs["layers"] = jax.tree.map(lambda x: leaf_spec(x.shape, fsdp_size, 1, min_elements),
                                 params["layers"])
  return specs


def replicated(tree: Any) -> SpecTree:
  return jax.tree.map(lambda _: P(), tree)


def _keys(path) -> tuple[Any, ...]:
  return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def state_specs(state: Any, params: Any, specs: SpecTree) -> SpecTree:
  """Specs of an optimizer state over `params` (shapes suffice for both): each moment is split
  like its param.

  optax's mu / nu trees mirror the params they are given, under the optimizer's own keys
  (`optim.by_key` hands each optimizer one entry of the params, `optim.per_policy` one policy's
  slice). So a state leaf gets a param's spec when its key path ends with a suffix of that
  param's path, the rest of the param's path appears in order before it, and its shape is the
  param's or the param's without one unsharded axis (that axis then leaves the spec). The
  longest such suffix wins; a leaf with no match or with matches of different specs (step
  counts, anything ambiguous) is replicated: correct, only larger.
  """
  table: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], tuple[int, ...], P]]] = {}
  flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
  for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], flat_specs):
    keys = _keys(path)
    for i in range(len(keys)):
      table.setdefault(keys[i:], []).append((keys[:i], tuple(leaf.shape), spec))

  def in_order(needles: tuple[Any, ...], hay: tuple[Any, ...]) -> bool:
    rest = iter(hay)
    return all(any(n == h for h in rest) for n in needles)

  def spec_of(path, leaf) -> P:
    keys, shape = _keys(path), tuple(leaf.shape)
    for start in range(len(keys)):  # longest suffix first
      found = set()
      for prefix, p_shape, spec in table.get(keys[start:], ()):
        if not in_order(prefix, keys[:start]):
          continue
        entries = tuple(spec) + (None,) * (len(p_shape) - len(tuple(spec)))
        if p_shape == shape:
          found.add(P(*entries))
        for axis in range(len(p_shape)):
          if entries[axis] is None and p_shape[:axis] + p_shape[axis + 1:] == shape:
            found.add(P(*(entries[:axis] + entries[axis + 1:])))
      if found:
        return found.pop() if len(found) == 1 else P()
    return P()

  return jax.tree_util.tree_map_with_path(spec_of, state)


def stacked(specs: SpecTree, n: int = 1) -> SpecTree:
  """Specs of the same leaves with `n` extra leading (unsharded) axes, e.g. a policy axis."""
  return jax.tree.map(lambda s: P(*((None,) * n + tuple(s))), specs, is_leaf=is_spec)


def _gather_leaf(x: jax.Array, spec: P, drop: int) -> jax.Array:
  """All-gathers `x` along the dimension `spec` shards over FSDP (spec shifted by `drop` axes)."""
  for dim, name in enumerate(tuple(spec)):
    if name == FSDP:
      return jax.lax.all_gather(x, FSDP, axis=dim - drop, tiled=True)
  return x


def gather(tree: Any, specs: SpecTree, drop: int = 0) -> Any:
  """Whole leaves from their FSDP shards (inside shard_map). `drop`: leading spec axes absent
  from the leaves, e.g. 1 for one layer's slice of stacked layers."""
  return jax.tree.map(lambda s, x: _gather_leaf(x, s, drop), specs, tree, is_leaf=is_spec)


def gather_outside_layers(params: Params, specs: SpecTree) -> Params:
  """Gathers every leaf except the layer stack (left to `layer_hook`)."""
  return {k: (v if k == "layers" else gather(v, specs[k])) for k, v in params.items()}


def layer_hook(specs: SpecTree) -> LayerHook | None:
  """The decoder's per-layer hook that gathers one layer's FSDP shards inside the scan."""
  layer_specs = specs["layers"]
  if all(FSDP not in tuple(s) for s in jax.tree.leaves(layer_specs, is_leaf=is_spec)):
    return None
  return lambda layer_params: gather(layer_params, layer_specs, drop=1)


def named(mesh: Mesh, specs: SpecTree) -> Any:
  """NamedSharding per leaf."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def put(tree: Any, mesh: Mesh, specs: SpecTree) -> Any:
  """Places host or device arrays on the mesh with the given specs."""
  return jax.device_put(tree, named(mesh, specs))
