"""Policy layouts: which params act for which agent, and everything else that differs by kind.

  kind       trainable params['policy']           frozen          batch layout
  "shared"   one model                            -               [N, ...]
  "lora"     adapters [L, P, ...] (models/lora)   {'base': model} [N, ...] (row -> adapter by
                                                                  policy_id)
  "stacked"  P models stacked [P, ...]            -               [P, N/P, ...] (row block p is
                                                                  policy p's sub-batch)
  "mapped"   {name: model}, architectures differ  -               {name: [N_name, ...]}

One `Layout` object per kind (named in `policy_config.LAYOUTS`, looked up with `of(cfg)`) owns
what differs between kinds: param init and selection, optimizers, partition specs, the batch
layout (blocks, sample axis, flatten / unflatten), validation of configs and batches, and the
per-kind parts of building the batch (rows per block, pad id per model). Nothing outside this
module compares kind strings. Every sample's `policy_id` names its policy (for "mapped", the
index into `names`). The learner's log-probs come from `algos/logprobs.py` (the same quantity the
sampler records). The params, optimizers, specs and log-probs of a `PolicyConfig` are in
`parallel/policies.py`, which asks the layout for every per-kind part.

(Over 400 lines: by design every kind-dependent rule is here, one class per kind, so that no
other module compares kind strings.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from marl_jax.algos import optim as optim_lib
from marl_jax.algos.batch import (BatchShape, GroupSpace, RolloutSample, TrainBatch, build_rows,
                                  count_prompts, validate_batch as validate_ids)
from marl_jax.models import decoder
from marl_jax.models import lora as lora_lib
from marl_jax.parallel import sharding
from marl_jax.parallel.policy_config import LAYOUTS, PolicyConfig

Params = dict[str, Any]


class Layout:
  """What one policy kind does differently. Stateless: every method takes the PolicyConfig.

  Class attributes:
    sample_axis: axis of batch leaves that indexes samples.
    per_role: may hold one policy per role (False: every agent acts with one model).
    per_policy_models: one ModelConfig (and tokenizer, pad id) per policy, keyed by name.
    adapters: LoRA adapters over a frozen base (which is also the only critic trunk).
  """
  sample_axis = 0
  per_role = True
  per_policy_models = False
  adapters = False

  # ---------------------------------------------------------------- params
  def init_policy(self, cfg: PolicyConfig, key: jax.Array, base: Any) -> tuple[Any, Params]:
    """(trainable['policy'], frozen) from the base params (`key`: fresh adapters)."""
    raise NotImplementedError

  def policy_optimizer(self, cfg: PolicyConfig, txs: list[optax.GradientTransformation]
                       ) -> optax.GradientTransformation:
    """The optimizer of trainable['policy'] from one optimizer per policy."""
    raise NotImplementedError

  def policy_specs(self, cfg: PolicyConfig, policy: Any, fsdp_size: int) -> Any:
    """FSDP PartitionSpecs of trainable['policy']."""
    raise NotImplementedError

  def acting_params(self, cfg: PolicyConfig, trainable: Params, frozen: Params, policy_id: int,
                    n: int) -> tuple[int, Any, decoder.LoraAdapters | None]:
    """(model index, model params, adapters) that sample policy `policy_id` for n rows."""
    return 0, trainable["policy"], None

  def engine_of(self, cfg: PolicyConfig, policy_id: int) -> int:
    """The rollout engine serving policy `policy_id`: policies that share weights share one
    (LoRA adapters are rows of one engine's batch); separate weights need their own."""
    return 0

  def token_logprobs(self, cfg: PolicyConfig, run: Callable, policy: Any, frozen: Params,
                     specs: tuple[Any, Any], batch: Any) -> tuple[Any, Any]:
    """`run(params, model_specs, config, batch, adapters)` for every policy's part of the batch,
    returning (log-probs, entropies) in the batch's layout."""
    return run(policy, specs[0], cfg.models[0], batch, None)

  # ---------------------------------------------------------------- KL reference
  def reference_policy(self, cfg: PolicyConfig, policy: Any, ids: tuple[int, ...] | None
                       ) -> Any:
    """The part of trainable['policy'] the KL reference copies when only policies `ids` (None:
    all) have rows in the reference pass: all of it, unless the layout can address a part."""
    return policy

  def reference_rows(self, cfg: PolicyConfig, batch: Any, ids: tuple[int, ...] | None) -> Any:
    """`batch` as the reference pass runs it over `reference_policy(cfg, policy, ids)`."""
    return batch

  # ---------------------------------------------------------------- batch layout
  def groups(self, cfg: PolicyConfig, batch: Any, fn: Callable[[TrainBatch], Any]) -> Any:
    """Applies `fn` to every TrainBatch of the layout (one, or one per name)."""
    return fn(batch)

  def flatten(self, cfg: PolicyConfig, tree: Any) -> Any:
    """Batch layout -> flat samples [n, ...]."""
    return tree

  def unflatten(self, cfg: PolicyConfig, flat: Any, like: Any) -> Any:
    """Inverse of `flatten`: flat samples back to the layout of `like` (a batch of it)."""
    return flat

  def blocks(self, cfg: PolicyConfig, samples: Sequence[RolloutSample]
             ) -> list[Sequence[RolloutSample]]:
    """The samples of each row block (one block, or one per policy)."""
    return [samples]

  def block_pad_ids(self, cfg: PolicyConfig, pad_ids: Sequence[int]) -> list[int]:
    """The pad id of each row block, from one pad id per model config."""
    return [pad_ids[0]]

  def split(self, cfg: PolicyConfig, tree: Any) -> list[Any]:
    """A tree in batch layout (a batch, or targets in its layout) -> one tree per row block."""
    return [tree]

  def join(self, cfg: PolicyConfig, parts: list[Any]) -> Any:
    """Inverse of `split`: row blocks (host or device arrays; a stacked layout's of equal
    shapes) -> the tree in this layout."""
    return parts[0]

  def check_batch(self, cfg: PolicyConfig, batch: Any) -> None:
    """Layout-level checks of a batch (its container and block count)."""

  def block_owner(self, cfg: PolicyConfig, batch: Any) -> Any | None:
    """The policy owning each sample slot, in batch layout; None: any slot may hold any."""
    return None


class Shared(Layout):
  """One model for every agent."""
  per_role = False

  def init_policy(self, cfg, key, base):
    return dict(base), {}

  def policy_optimizer(self, cfg, txs):
    return txs[0]

  def policy_specs(self, cfg, policy, fsdp_size):
    return sharding.model_specs(policy, fsdp_size)


class Lora(Layout):
  """One adapter per policy over a frozen base; row -> adapter by `policy_id`."""
  adapters = True

  def init_policy(self, cfg, key, base):
    return lora_lib.init_lora(cfg.models[0], cfg.lora, cfg.num_policies, key), {"base": base}

  def policy_optimizer(self, cfg, txs):
    return optim_lib.per_policy(txs, 1)

  def policy_specs(self, cfg, policy, fsdp_size):
    return sharding.replicated(policy)

  def acting_params(self, cfg, trainable, frozen, policy_id, n):
    return 0, frozen["base"], lora_lib.adapters(trainable["policy"],
                                                np.full(n, policy_id, np.int32), cfg.lora)

  def token_logprobs(self, cfg, run, policy, frozen, specs, batch):
    ad = lora_lib.adapters(policy, batch.samples.policy_id, cfg.lora)
    return run(frozen["base"], specs[1]["base"], cfg.models[0], batch, ad)


class _PerPolicyBlocks(Layout):
  """Shared by stacked and mapped: one row block per policy."""

  def engine_of(self, cfg, policy_id):
    return policy_id

  def blocks(self, cfg, samples):
    return [[s for s in samples if s.policy_id == p] for p in range(cfg.num_policies)]

  def block_pad_ids(self, cfg, pad_ids):
    return [pad_ids[0]] * cfg.num_policies


class Stacked(_PerPolicyBlocks):
  """P copies of one architecture stacked on a leading axis; batch blocks [P, n/P, ...]."""
  sample_axis = 1

  def init_policy(self, cfg, key, base):
    return jax.tree.map(lambda x: jnp.stack([x] * cfg.num_policies), base), {}

  def policy_optimizer(self, cfg, txs):
    return optim_lib.per_policy(txs, 0)

  def policy_specs(self, cfg, policy, fsdp_size):
    one = jax.tree.map(lambda x: x[0], policy)
    return sharding.stacked(sharding.model_specs(one, fsdp_size))

  def acting_params(self, cfg, trainable, frozen, policy_id, n):
    return 0, jax.tree.map(lambda x: x[policy_id], trainable["policy"]), None

  def token_logprobs(self, cfg, run, policy, frozen, specs, batch):
    unstacked = jax.tree.map(lambda s: jax.sharding.PartitionSpec(*tuple(s)[1:]), specs[0],
                             is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    if batch.policies is not None:  # blocks of some policies only: run just those (their
      # gradients scatter back into the stack; the others get zeros)
      policy = jax.tree.map(lambda x: x[np.asarray(batch.policies)], policy)
    # A loop over the P policies (lax.map), not a vmap: vmapping the layer scan moves the policy
    # axis inside it, so XLA copied every stacked weight and weight gradient between
    # [P, L, ...] and [L, P, ...]. The loop reads policy p's slice and writes its gradient in
    # place, with one policy's activations live at a time.
    return jax.lax.map(lambda pb: run(pb[0], unstacked, cfg.models[0], pb[1], None),
                       (policy, batch))

  def reference_policy(self, cfg, policy, ids):
    if ids is None or len(ids) == cfg.num_policies:
      return policy
    return jax.tree.map(lambda x: x[np.asarray(ids)], policy)  # [len(ids), ...]

  def reference_rows(self, cfg, batch, ids):
    if ids is None or len(ids) == cfg.num_policies:
      return batch
    held = tuple(range(cfg.num_policies)) if batch.policies is None else batch.policies
    if not set(held) <= set(ids):
      raise ValueError(f"the KL reference holds the blocks of policies {ids} "
                       f"(reference_policies); the batch has blocks of policies {held}")
    return batch.replace(policies=tuple(ids.index(p) for p in held))  # blocks of the reference

  def flatten(self, cfg, tree):
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)

  def unflatten(self, cfg, flat, like):
    blocks = np.shape(like.response)[0]  # num_policies, or fewer (`TrainBatch.policies`)
    return jax.tree.map(lambda x: x.reshape((blocks, -1) + x.shape[1:]), flat)

  def split(self, cfg, tree):
    blocks = np.shape(jax.tree.leaves(tree)[0])[0]  # num_policies, or fewer (`batch.policies`)
    return [jax.tree.map(lambda x, p=p: x[p], tree) for p in range(blocks)]

  def join(self, cfg, parts):
    stack = lambda *xs: (np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs)
                         else jnp.stack(xs))
    return jax.tree.map(stack, *parts)

  def check_batch(self, cfg, batch):
    lead = np.shape(batch.response)[0]
    if batch.policies is None and lead != cfg.num_policies:
      raise ValueError(f"stacked batch has {lead} policy blocks; expected num_policies="
                       f"{cfg.num_policies}")
    ids = batch.policies
    if ids is not None and (lead != len(ids) or not set(ids) <= set(range(cfg.num_policies))):
      raise ValueError(f"stacked batch has {lead} policy blocks for policies {ids}; expected "
                       f"one block per listed policy, each in [0, {cfg.num_policies})")

  def block_owner(self, cfg, batch):
    shape = np.shape(batch.samples.policy_id)
    ids = np.arange(shape[0]) if batch.policies is None else np.asarray(batch.policies)
    return np.broadcast_to(ids[:, None], shape)


class Mapped(_PerPolicyBlocks):
  """One model per policy name (architectures and tokenizers may differ); batch {name: rows}."""
  per_policy_models = True

  def init_policy(self, cfg, key, base):
    return dict(base), {}

  def policy_optimizer(self, cfg, txs):
    return optim_lib.by_key(dict(zip(cfg.names, txs)))

  def policy_specs(self, cfg, policy, fsdp_size):
    return {k: sharding.model_specs(v, fsdp_size) for k, v in policy.items()}

  def acting_params(self, cfg, trainable, frozen, policy_id, n):
    return policy_id, trainable["policy"][cfg.names[policy_id]], None

  def token_logprobs(self, cfg, run, policy, frozen, specs, batch):
    outs = {k: run(policy[k], specs[0][k], m, batch[k], None)
            for k, m in zip(cfg.names, cfg.models)}
    entropies = {k: o[1] for k, o in outs.items()}
    return ({k: o[0] for k, o in outs.items()},
            None if any(e is None for e in entropies.values()) else entropies)

  def groups(self, cfg, batch, fn):
    return {k: fn(batch[k]) for k in cfg.names}

  def flatten(self, cfg, tree):
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *[tree[k] for k in cfg.names])

  def unflatten(self, cfg, flat, like):
    sizes = [like[k].samples.rewards.shape[0] for k in cfg.names]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return {k: jax.tree.map(lambda x, o=o, s=s: x[o:o + s], flat)
            for k, o, s in zip(cfg.names, offsets, sizes)}

  def block_pad_ids(self, cfg, pad_ids):
    return list(pad_ids)

  def split(self, cfg, tree):
    return [tree[k] for k in cfg.names]

  def join(self, cfg, parts):
    return dict(zip(cfg.names, parts))

  def check_batch(self, cfg, batch):
    if not isinstance(batch, dict) or sorted(batch) != sorted(cfg.names):
      got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
      raise ValueError(f"a mapped batch is a dict with keys {sorted(cfg.names)}, got {got}")

  def block_owner(self, cfg, batch):
    return {k: np.full(np.shape(batch[k].samples.policy_id), p) for p, k in enumerate(cfg.names)}


# The objects `policy_config.LAYOUTS` names.
SHARED, LORA, STACKED, MAPPED = Shared(), Lora(), Stacked(), Mapped()


def of(cfg: PolicyConfig) -> Layout:
  """The layout object of `cfg.kind`."""
  return LAYOUTS.get(cfg.kind)


# ----------------------------------------------------------------------------- batches


def batch_sizes(cfg: PolicyConfig, samples: Sequence[RolloutSample], shape: BatchShape
                ) -> tuple[int, int, int]:
  """(rows per block, prompt width, response width) that `build_batch` pads `samples` to.

  Multi-host runs take the element-wise maximum over processes (`multihost.agree_max`) and pass
  it to `build_batch`, so every process's rows have the same shapes.
  """
  return shape.sizes(samples, max(len(b) for b in of(cfg).blocks(cfg, samples)))


def prompt_bound(cfg: PolicyConfig, samples: Sequence[RolloutSample], rows: int) -> int:
  """`TrainBatch.num_prompts` of `samples` in blocks of `rows` rows: the largest
  `batch.count_prompts` over the blocks. Multi-host runs take the maximum over processes: a
  device's rows all come from one process, so it bounds every shard."""
  return max(count_prompts(b, rows) for b in of(cfg).blocks(cfg, samples))


def build_batch(cfg: PolicyConfig, samples: Sequence[RolloutSample], shape: BatchShape,
                pad_ids: Sequence[int], sizes: tuple[int, int, int] | None = None,
                num_prompts: int | None = None) -> Any:
  """The step's TrainBatch in the layout of `cfg` (flat, [P, n, ...] blocks, or a dict).

  `pad_ids`: one per model config of `cfg` (a mapped team's models each pad with their own
  tokenizer's id, which must lie in that model's vocabulary); padding is masked out either way.
  `sizes`: (rows per block, prompt width, response width), at least `batch_sizes(...)`;
  default: exactly those. `num_prompts`: at least `prompt_bound(...)`; given, the learner
  computes each distinct prompt once (`TrainBatch.num_prompts`).
  """
  layout = of(cfg)
  if len(pad_ids) != len(cfg.models):
    raise ValueError(f"{len(pad_ids)} pad ids for the {len(cfg.models)} model config(s) of "
                     f"a {cfg.kind!r} policy; expected one per model")
  need = batch_sizes(cfg, samples, shape)
  rows, width, resp = need if sizes is None else sizes
  if any(s < n for s, n in zip((rows, width, resp), need)):
    raise ValueError(f"sizes (rows, prompt, response) = {tuple(sizes)} are smaller than the "
                     f"{need} these samples need")
  bound = prompt_bound(cfg, samples, rows)
  if num_prompts is not None and num_prompts < bound:
    raise ValueError(f"num_prompts={num_prompts} is below these samples' prompt bound {bound} "
                     "(distinct (prompt, policy) pairs of a block, rounded up; prompt_bound)")
  empty = [i for i, s in enumerate(samples) if not s.generation.token_ids]
  if empty:
    raise ValueError(f"samples {empty[:5]} have no response tokens; train batches need the "
                     "sampler's token ids (scripted policies cannot be trained)")
  parts = [build_rows(b, shape, pad, rows, width, resp, num_prompts)
           for b, pad in zip(layout.blocks(cfg, samples), layout.block_pad_ids(cfg, pad_ids))]
  return layout.join(cfg, parts)


def validate_batch(cfg: PolicyConfig, space: GroupSpace, agent_policies: tuple[int, ...],
                   batch: Any, shards: int) -> None:
  """Host-side checks before any device work, so a bad batch fails with one clear error instead
  of a silent wrong group or a shape error deep inside XLA: layout, shapes, divisibility into
  `shards` pieces (devices x micro-batches) and every id."""
  layout = of(cfg)
  layout.check_batch(cfg, batch)
  parts = layout.groups(cfg, batch, lambda b: b)
  for name, b in (parts if isinstance(parts, dict) else {"batch": parts}).items():
    resp = np.shape(b.response)
    rows = resp[layout.sample_axis]
    if rows % shards:
      raise ValueError(f"{name}: {rows} samples per block do not split into {shards} "
                       f"pieces (devices x micro-batches); pad the blocks")
    shapes = {"old_logp": np.shape(b.old_logp), "samples.token_mask": np.shape(
        b.samples.token_mask)}
    if b.ref_logp is not None:
      shapes["ref_logp"] = np.shape(b.ref_logp)
    for field, shape in shapes.items():
      if shape != resp:
        raise ValueError(f"{name}.{field} has shape {shape}; expected the response shape {resp}")
    if np.shape(b.prompt)[-1] < 1 or np.shape(b.prompt) != np.shape(b.prompt_mask):
      raise ValueError(f"{name}: prompt {np.shape(b.prompt)} and prompt_mask "
                       f"{np.shape(b.prompt_mask)} must match and hold >= 1 token")
  samples = layout.groups(cfg, batch, lambda b: b.samples)
  if not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(samples)):
    return  # a multi-host global batch: validate each process's local batch before assembly
  flat = jax.tree.map(np.asarray, layout.flatten(cfg, samples))
  validate_ids(flat, space)
  mask, pid, aid = flat.sample_mask, flat.policy_id, flat.agent_id
  want = np.asarray(agent_policies)[np.clip(aid, 0, space.num_agents - 1)]
  bad = np.flatnonzero(mask & (pid != want))
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"sample {i}: policy_id={int(pid[i])} but agent {int(aid[i])} is mapped to "
                     f"policy {int(want[i])} (agent_policies={agent_policies}, "
                     f"{cfg.num_policies} policies with params)")
  owner = layout.block_owner(cfg, batch)
  if owner is not None:
    owner = np.asarray(layout.flatten(cfg, owner))
    bad = np.flatnonzero(mask & (pid != owner))
    if bad.size:
      i = int(bad[0])
      raise ValueError(f"sample {i} has policy_id={int(pid[i])} but sits in policy "
                       f"{int(owner[i])}'s block of the {cfg.kind} batch")


def batch_spec(cfg: PolicyConfig, batch_axes: Any) -> jax.sharding.PartitionSpec:
  """The PartitionSpec of every batch leaf: the sample axis split over `batch_axes`."""
  return jax.sharding.PartitionSpec(*((None,) * of(cfg).sample_axis + (batch_axes,)))
