"""PPO mini-batches and epochs over one rollout: the host loop around the jitted step.

    state, metrics = ppo_updates(fns, cfg, state, frozen, batch, rng)

`fns.prepare` fixes the rollout's targets over the whole batch first (advantages, returns and the
group filter's kept samples: groups span mini-batches; the learner's old log-probs and truncated
IS weights when configured). Then each of `cfg.epochs` epochs shuffles the kept samples of every
policy block and cuts them into mini-batches of `cfg.mini_batch_size` rows (None: the whole batch,
unshuffled); each mini-batch is one call of the step, whose loss pairs are exact over that
mini-batch (its own denominators, split over devices and micro-batches). The old log-probs stay
those of the rollout, so from the second update on the PPO ratio moves away from 1 and the clip,
dual clip and MARFT's `target_kl` act.

A block with fewer kept samples than the others (stacked / mapped teams) fills its share of the
last mini-batches with masked rows; a mini-batch in which a policy has no rows at all still steps
that policy's optimizer with a zero gradient (AdamW moments and weight decay move it), as a
per-agent verl worker with fewer updates would not. The shuffles come from `rng`, which the
trainer derives from (run key, step), so a resumed run repeats them exactly.
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

__all__ = ["mean_metrics", "plan", "ppo_updates", "select_rows"]


def _blocks(cfg: TrainConfig, tree: Any) -> list[Any]:
  """A tree in batch layout -> one tree per policy block (flat layouts: one block)."""
  layout = layouts.of(cfg.policy)
  if layout.per_policy_models:
    return [tree[k] for k in cfg.policy.names]
  if layout.sample_axis == 1:
    return [jax.tree.map(lambda x, p=p: x[p], tree) for p in range(cfg.policy.num_policies)]
  return [tree]


def _join(cfg: TrainConfig, parts: list[Any]) -> Any:
  """Inverse of `_blocks`."""
  layout = layouts.of(cfg.policy)
  if layout.per_policy_models:
    return dict(zip(cfg.policy.names, parts))
  if layout.sample_axis == 1:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
  return parts[0]


def plan(kept: list[np.ndarray], size: int, rng: np.random.Generator, multiple: int = 1
         ) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
  """One epoch's mini-batches: for each, (row indices [m] per block, valid [m] per block).

  `kept`: bool [rows] per block, the samples to train on. Each block's kept rows are shuffled
  and cut into chunks of `size`; there are as many mini-batches as the fullest block needs, and
  slots past a block's rows point at row 0 with valid=False. m = `size`, or fewer when the
  fullest block keeps fewer samples than that: `batch.round_rows` of its count, a multiple of
  `multiple` (the pieces the rows split over). The same updates on the same samples, without
  rows that are all padding: the AT-GRPO cpu preset keeps 4 of its 8 samples after the group
  filter, and its 16-row mini-batch computed 12 padding rows."""
  perms = [rng.permutation(np.flatnonzero(k)) for k in kept]
  size = min(size, round_rows(max(len(p) for p in perms), multiple))  # >= the fullest's count
  count = max(1, max(-(-len(p) // size) for p in perms))
  out = []
  for u in range(count):
    idx, valid = [], []
    for p in perms:
      chunk = p[u * size:(u + 1) * size]
      idx.append(np.concatenate([chunk, np.zeros(size - len(chunk), chunk.dtype)]))
      valid.append(np.arange(size) < len(chunk))
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
  `targets`: `RolloutTargets` in the batch's layout, as `TrainFns.prepare` returns them."""
  parts = [_select_block(b, t, i, v) for b, t, i, v in
           zip(_blocks(cfg, batch), _blocks(cfg, targets), idx, valid)]
  return _join(cfg, [p[0] for p in parts]), _join(cfg, [p[1] for p in parts])


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


def ppo_updates(fns: TrainFns, cfg: TrainConfig, state: TrainState, frozen: Any, batch: Any,
                rng: np.random.Generator) -> tuple[TrainState, dict[str, Any]]:
  """Every update of one rollout (module docstring). Returns the new state and the metrics:
  each step metric's mean over the updates, the advantage metrics of the whole rollout,
  `updates` and `policy_skipped` (updates whose policy step target_kl or the guard skipped)."""
  batch, targets, adv_metrics = fns.prepare(state.params, frozen, batch)
  kept = [_host(t.sample_mask) for t in _blocks(cfg, targets)]
  history = []
  for _ in range(cfg.epochs):
    if cfg.mini_batch_size is None:
      state, metrics = fns.step(state, frozen, batch, targets)
      history.append(metrics)
      continue
    for idx, valid in plan(kept, cfg.mini_batch_size, rng, fns.shards):
      mb, mt = fns.shard_batch(_select_rows_jit(cfg, batch, targets, idx, valid))
      state, metrics = fns.step(state, frozen, mb, mt)
      history.append(metrics)
  host = jax.device_get(history)
  out = mean_metrics(host)
  out["updates"] = np.float32(len(host))
  out["policy_skipped"] = np.float32(len(host) - sum(bool(m["policy_updated"]) for m in host))
  out.update({f"adv/{k}": v for k, v in jax.device_get(adv_metrics).items()})
  return state, out
