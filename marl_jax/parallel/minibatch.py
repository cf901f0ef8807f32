"""PPO mini-batches and epochs over one rollout, and updates on the trained rows only: the host
loop around the jitted step.

    state, metrics = ppo_updates(fns, cfg, state, frozen, batch, rng)

`fns.prepare` fixes the rollout's targets over the whole batch first (advantages, returns and the
group filter's kept samples: groups span mini-batches). The rows an update trains on are then
those kept with a token in the loss (`trained_rows`): a sample of an agent RL leaves out
(`config.train.agents`) still counts in its group's statistics, but no update computes it, and
the learner's old log-probs and truncated IS weights, when configured, are computed for these
rows alone (`fns.recompute`), and so are the KL reference's (`fns.ref_logp`). Each of
`cfg.epochs` epochs shuffles those rows of every policy block and cuts them into mini-batches of
`cfg.mini_batch_size` rows (None: all of them in one update, in order); each mini-batch is one
call of the step, whose loss pairs are exact over that mini-batch (its own denominators, split
over devices and micro-batches). The old log-probs stay those of the rollout, so from the second
update on the PPO ratio moves away from 1 and the clip, dual clip and MARFT's `target_kl` act.

A stacked team's blocks share one row count, so a block with fewer such rows than the others
fills its share of the last mini-batches with masked rows, and a block with none is left out
(the batch names the policies it holds, `TrainBatch.policies`, and the step runs only those). A
mapped team's models each take their own block, so each block holds only its own rows, rounded
up (`batch.round_rows`), and a policy with none keeps `fns.shards` masked rows. Either way a
coordinator-only step of a three-model team computes the coordinator's rows, not the solver's
and checker's. A mini-batch in which a policy has no rows at all still steps that policy's
optimizer with a zero gradient (AdamW moments and weight decay move it), as a per-agent verl
worker with fewer updates would not. The shuffles come from `rng`, which the trainer derives
from (run key, step), so a resumed run repeats them exactly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from marl_jax.algos.batch import round_rows
from marl_jax.parallel import layouts
from marl_jax.parallel.gradients import RolloutTargets
from marl_jax.parallel.train_step import TrainConfig, TrainFns, TrainState

__all__ = ["mean_metrics", "plan", "ppo_updates", "select_rows", "trained_rows"]


def _blocks(cfg: TrainConfig, tree: Any) -> list[Any]:
  """A tree in batch layout -> one tree per policy block (flat layouts: one block)."""
  layout = layouts.of(cfg.policy)
  if layout.per_policy_models:
    return [tree[k] for k in cfg.policy.names]
  if layout.sample_axis == 1:  # num_policies blocks, or fewer (`TrainBatch.policies`)
    return [jax.tree.map(lambda x, p=p: x[p], tree)
            for p in range(np.shape(jax.tree.leaves(tree)[0])[0])]
  return [tree]


def _join(cfg: TrainConfig, parts: list[Any]) -> Any:
  """Inverse of `_blocks`."""
  layout = layouts.of(cfg.policy)
  if layout.per_policy_models:
    return dict(zip(cfg.policy.names, parts))
  if layout.sample_axis == 1:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
  return parts[0]


def plan(kept: list[np.ndarray], size: int | None, rng: np.random.Generator, multiple: int = 1,
         equal_blocks: bool = True) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
  """One epoch's mini-batches: for each, (row indices [m_b] per block, valid [m_b] per block);
  with `equal_blocks`, a block with no kept row (while another has some) gets None for both: it
  is left out.

  `kept`: bool [rows] per block, the samples to train on. Each block's kept rows are shuffled
  and cut into chunks of `size`; there are as many mini-batches as the fullest block needs, and
  slots past a block's rows point at row 0 with valid=False. `size` None: one mini-batch of every
  kept row, in order (nothing to shuffle). m_b = `size`, or fewer when the block keeps fewer
  samples than that: `batch.round_rows` of its count, a multiple of `multiple` (the pieces the
  rows split over); with `equal_blocks` (blocks stacked into one array) every block takes the
  fullest block's m. The same updates on the same samples, without rows that are all padding:
  the AT-GRPO cpu preset keeps 4 of its 8 samples after the group filter, and its 16-row
  mini-batch computed 12 padding rows."""
  perms = [np.flatnonzero(k) if size is None else rng.permutation(np.flatnonzero(k))
           for k in kept]
  counts = [len(p) for p in perms]
  fullest = max(counts)
  size = round_rows(fullest, multiple) if size is None else size
  sizes = [min(size, round_rows(fullest if equal_blocks else n, multiple)) for n in counts]
  count = max(1, max(-(-n // s) for n, s in zip(counts, sizes)))
  out = []
  for u in range(count):
    idx, valid = [], []
    for p, s in zip(perms, sizes):
      if equal_blocks and not len(p) and fullest:
        idx.append(None)
        valid.append(None)
        continue
      chunk = p[u * s:(u + 1) * s]
      idx.append(np.concatenate([chunk, np.zeros(s - len(chunk), chunk.dtype)]))
      valid.append(np.arange(s) < len(chunk))
    out.append((idx, valid))
  return out


def _select_block(b, t: RolloutTargets, idx, valid):
  b, t = jax.tree.map(lambda x: x[idx], (b, t))
  s = b.samples
  b = b.replace(samples=s.replace(sample_mask=s.sample_mask & valid,
                                  token_mask=s.token_mask & valid[:, None]))
  return b, t.replace(sample_mask=t.sample_mask & valid)


def select_rows(cfg: TrainConfig, batch: Any, targets: Any, idx: list[Any],
                valid: list[Any]) -> tuple[Any, Any]:
  """(batch, targets) of one mini-batch: rows `idx` of each block, slots not `valid` masked.
  `targets`: `RolloutTargets` in the batch's layout, as `TrainFns.prepare` returns them. A block
  whose `idx` is None (stacked) is left out, and the batch names the policies it holds."""
  held = [p for p, i in enumerate(idx) if i is not None]
  blocks = list(zip(_blocks(cfg, batch), _blocks(cfg, targets), idx, valid))
  parts = [_select_block(*blocks[p]) for p in held]
  mb, mt = _join(cfg, [p[0] for p in parts]), _join(cfg, [p[1] for p in parts])
  if len(held) < len(idx):
    ids = range(len(idx)) if batch.policies is None else batch.policies
    mb = mb.replace(policies=tuple(ids[p] for p in held))
  return mb, mt


# One jitted copy for the process, so each (config, mini-batch shape) compiles once.
_select_rows_jit = jax.jit(select_rows, static_argnums=0)


def _host(x: jax.Array) -> np.ndarray:
  """A global array on every process's host (all processes take part in the gather)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def mean_metrics(host: list[dict[str, Any]]) -> dict[str, np.ndarray]:
  """Per-update metrics (on the host) -> their means over the updates (MARFT reports the same).

  A per-agent vector [A] (`agent/...`) averages each agent over the updates in which it had
  samples: in the others its num / den pairs count nothing and read 0, which would pull the
  mean towards 0 (an agent whose rows all fell into one of two mini-batches would report half
  its loss). `agent/samples` itself stays the plain mean, and an agent that never acted keeps 0
  (the trainer reports no value for it)."""
  acted = np.stack([np.asarray(h["agent/samples"]) > 0 for h in host])  # [updates, A]
  out = {}
  for k in host[0]:
    values = np.stack([np.asarray(h[k], np.float64) for h in host])  # [updates, ...]
    if k.startswith("agent/") and k != "agent/samples":
      values = np.where(acted, values, 0.0).sum(0) / np.maximum(acted.sum(0), 1)
    else:
      values = values.mean(0)
    out[k] = values.astype(np.float32)
  return out


def trained_rows(cfg: TrainConfig, batch: Any, targets: Any) -> list[np.ndarray]:
  """bool [rows] per block: the samples an update trains on, those the group filter kept that
  have a token in the loss. The others (padding, filtered samples, the samples of an agent RL
  leaves out, `trainer.trained_samples`) add nothing to any loss term or denominator
  (`losses.aggregate` counts tokens, or responses with a token), so leaving them out of the
  updates changes no gradient, only the work."""
  return [_host(t.sample_mask & jnp.any(b.samples.token_mask, axis=-1))  # one copy per block
          for b, t in zip(_blocks(cfg, batch), _blocks(cfg, targets))]


def ppo_updates(fns: TrainFns, cfg: TrainConfig, state: TrainState, frozen: Any, batch: Any,
                rng: np.random.Generator, reference: Any = None
                ) -> tuple[TrainState, dict[str, Any]]:
  """Every update of one rollout (module docstring). `reference`: the KL reference
  (`fns.reference_params`; None with LoRA), whose log-probs are filled for the trained rows only,
  when `fns.ref_logp` is set. Returns the new state and the metrics:
  each step metric's mean over the updates (`agent/samples`: the rows they trained on), the
  advantage metrics of the whole rollout, `updates` and `policy_skipped` (updates whose policy
  step target_kl or the guard skipped)."""
  batch, targets, adv_metrics = fns.prepare(state.params, frozen, batch, recompute=False)
  kept = trained_rows(cfg, batch, targets)
  equal = not layouts.of(cfg.policy).per_policy_models
  (idx, valid), = plan(kept, None, rng, fns.shards, equal)
  if any(i is None or len(i) < len(k) for i, k in zip(idx, kept)):  # leave out the other rows
    batch, targets = fns.shard_batch(_select_rows_jit(cfg, batch, targets, idx, valid))
    kept = [v for v in valid if v is not None]
  if fns.ref_logp is not None:  # the KL reference's log-probs of the rows the updates train on
    batch = fns.ref_logp(reference, frozen, batch)
  if fns.recompute is not None:  # the learner's old log-probs of the rows it trains on
    batch, targets = fns.recompute(state.params, frozen, batch, targets)
  history = []
  for _ in range(cfg.epochs):
    if cfg.mini_batch_size is None:
      state, metrics = fns.step(state, frozen, batch, targets)
      history.append(metrics)
      continue
    for idx, valid in plan(kept, cfg.mini_batch_size, rng, fns.shards, equal):
      mb, mt = fns.shard_batch(_select_rows_jit(cfg, batch, targets, idx, valid))
      state, metrics = fns.step(state, frozen, mb, mt)
      history.append(metrics)
  host = jax.device_get(history)
  out = mean_metrics(host)
  out["updates"] = np.float32(len(host))
  out["policy_skipped"] = np.float32(len(host) - sum(bool(m["policy_updated"]) for m in host))
  out.update({f"adv/{k}": v for k, v in jax.device_get(adv_metrics).items()})
  return state, out
