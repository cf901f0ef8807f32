"""The one update path: every update of one rollout, the host loop around the learner's jitted
functions (`parallel/train_step.py`).

    state, metrics = run(fns, cfg, state, frozen, batch, rng, reference)

Every config takes it, in this order (after `fns.check`, the batch's host-side checks):
  1. `fns.old_values`: a critic's values of the rollout's states (MARFT; GAE needs them);
  2. `fns.prepare`: the rollout's targets over the whole batch (advantages, returns and the group
     filter's kept samples: groups span mini-batches);
  3. the rows the updates train on (`trained_rows`): those kept with a token in the loss. A
     sample of an agent RL leaves out (`config.train.agents`) still counts in its group's
     statistics, but no update computes it;
  4. `fns.ref_logp` and `fns.recompute`, when configured: the KL reference's log-probs, and the
     learner's old log-probs and truncated IS weights, of those rows alone (with the importance
     weights' per-agent statistics, `is/` metrics);
  5. `train.epochs` epochs, each shuffling those rows of every policy block and cutting them into
     mini-batches of `train.mini_batch_size` rows (None: all of them in one update, in order),
     one `fns.step` each, whose loss pairs are exact over that mini-batch (its own denominators,
     split over devices and micro-batches). A single full-batch update (MAGRPO, the warm-start)
     is one epoch of one mini-batch. The old log-probs stay those of the rollout, so from the
     second update on the PPO ratio moves away from 1 and the clip, dual clip and MARFT's
     `target_kl` act.

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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from marl_jax.algos.batch import round_rows
from marl_jax.parallel import layouts
from marl_jax.parallel.gradients import RolloutTargets
from marl_jax.parallel.train_config import TrainConfig, TrainState
from marl_jax.parallel.train_step import TrainFns

__all__ = ["host_copy", "mean_metrics", "plan", "run", "select_rows", "trained_rows"]


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
  layout = layouts.of(cfg.policy)
  held = [p for p, i in enumerate(idx) if i is not None]
  blocks = list(zip(layout.split(cfg.policy, batch), layout.split(cfg.policy, targets), idx,
                    valid))
  parts = [_select_block(*blocks[p]) for p in held]
  mb = layout.join(cfg.policy, [p[0] for p in parts])
  mt = layout.join(cfg.policy, [p[1] for p in parts])
  if len(held) < len(idx):
    ids = range(len(idx)) if batch.policies is None else batch.policies
    mb = mb.replace(policies=tuple(ids[p] for p in held))
  return mb, mt


# One jitted copy for the process, so each (config, mini-batch shape) compiles once.
_select_rows_jit = jax.jit(select_rows, static_argnums=0)


def host_copy(x: jax.Array) -> np.ndarray:
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
  layout = layouts.of(cfg.policy)
  return [host_copy(t.sample_mask & jnp.any(b.samples.token_mask, axis=-1))  # one copy per block
          for b, t in zip(layout.split(cfg.policy, batch), layout.split(cfg.policy, targets))]


def run(fns: TrainFns, cfg: TrainConfig, state: TrainState, frozen: Any, batch: Any,
        rng: np.random.Generator, reference: Any = None,
        on_targets: Callable[[Any, Any], None] | None = None
        ) -> tuple[TrainState, dict[str, Any]]:
  """Every update of one rollout (module docstring). `reference`: the KL reference
  (`fns.reference_params`; None with LoRA), whose log-probs are filled for the trained rows only,
  when `fns.ref_logp` is set. `on_targets(batch, targets)`: called right after `fns.prepare`
  with the whole rollout's batch and its `RolloutTargets` (global arrays in the batch's layout),
  for a host that shows them (the trainer's samples tables); in a multi-host run every process
  must pass one (a host copy of a global array is a collective). Returns the new state and the
  metrics:
  each step metric's mean over the updates (`agent/samples`: the rows they trained on), the
  advantage metrics of the whole rollout, `updates` and `policy_skipped` (updates whose policy
  step target_kl or the guard skipped)."""
  fns.check(batch)
  if fns.old_values is not None:  # MARFT: GAE needs the critic's values of these states
    batch = fns.old_values(state.params, frozen, batch)
  batch, targets, adv_metrics = fns.prepare(batch)
  if on_targets is not None:
    on_targets(batch, targets)
  kept = trained_rows(cfg, batch, targets)
  equal = not layouts.of(cfg.policy).per_policy_models
  (idx, valid), = plan(kept, None, rng, fns.shards, equal)
  if any(i is None or len(i) < len(k) for i, k in zip(idx, kept)):  # leave out the other rows
    batch, targets = fns.shard_batch(_select_rows_jit(cfg, batch, targets, idx, valid))
    kept = [v for v in valid if v is not None]
  if fns.ref_logp is not None:  # the KL reference's log-probs of the rows the updates train on
    batch = fns.ref_logp(reference, frozen, batch)
  importance = {}
  if fns.recompute is not None:  # the learner's old log-probs of the rows it trains on
    batch, targets, importance = fns.recompute(state.params, frozen, batch, targets)
  history = []
  for _ in range(cfg.train.epochs):
    for idx, valid in plan(kept, cfg.train.mini_batch_size, rng, fns.shards, equal):
      if cfg.train.mini_batch_size is None:  # the rows above, in order: no selection to make
        mb, mt = batch, targets
      else:
        mb, mt = fns.shard_batch(_select_rows_jit(cfg, batch, targets, idx, valid))
      state, metrics = fns.step(state, frozen, mb, mt)
      history.append(metrics)
  host = jax.device_get(history)
  out = mean_metrics(host)
  out["updates"] = np.float32(len(host))
  out["policy_skipped"] = np.float32(len(host) - sum(bool(m["policy_updated"]) for m in host))
  out.update({f"adv/{k}": v for k, v in jax.device_get(adv_metrics).items()})
  out.update({f"is/{k}": v for k, v in jax.device_get(importance).items()})
  return state, out
