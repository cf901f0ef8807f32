r"""The learner's update when RL trains part of a team (`config.train.agents`): on the trained
agents' rows only (`parallel/update.trained_rows`) against the whole batch with the other
agents' tokens masked (what such a run computed before), as JSON.

    python -m experiments.bench_partial_step \
        --config=configs/orchestration_stop.py:full,program,cpu --config.train.agents=coordinator \
        [--config.env.kwargs.level=one_step --config.rollout.problems_per_step=4 \
         --config.rollout.k=4 --repeats=2]

The config's warm-start (when `sft.steps` > 0, as a run starts; else `init_from`'s params) and one
rollout, then one update of the same params from that batch each way: on the whole batch
(`fns.prepare`, the learner's old log-probs when the config recomputes them, then `fns.step`),
and `update.run` (the trainer's one update path), which computes only the trained rows, old
log-probs included. With `loss.kl_coef` > 0 the whole-batch path also fills the KL reference's
log-probs of every row (from a reference of every policy, built for it), `update.run` those of
its rows (from the trainer's reference), and a third path, `trained_rows_whole_reference`, is
the trainer between a359963 and 377fd9d: the reference pass over every row, then `update.run`. Each path is called once to compile, then --repeats times, each from
a fresh state of the same params; the fastest call counts. The report gives each path's batch shape
(rows per block; [blocks, rows] for a stacked team), its seconds, its loss and its gradient norm
(the same update every way, so these agree to float32 rounding; at ratio 1 a z-scored policy loss
is about 0, the gradient norm is not), and `speedup`: each other path's seconds over those of
`trained_rows`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

from experiments import cli

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file with a preset, as experiments.train takes it; "
    "--config.train.agents must name the agents RL trains.", lock_config=True)
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed calls per path (the fastest counts).")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import jax
  import numpy as np

  from marl_jax.parallel import layouts, update
  from marl_jax.parallel.train_step import make_train_step
  from marl_jax.training import config as config_lib
  from marl_jax.training import trainer

  c = _CONFIG.value
  spec = config_lib.build(c).spec  # before any model loads
  if config_lib.trained_agents(c, spec) == set(spec.agents):
    raise app.UsageError(f"--config.train.agents={c.train.agents!r} trains every agent of "
                         f"{list(spec.agents)}, so no row is left out; name the agents RL "
                         "trains (e.g. coordinator)")
  run = trainer.Run(c, tempfile.mkdtemp(prefix="bench_partial_step_"))
  if c.sft.steps:
    run.warm_start()
  elif c.init_from:  # a saved warm-start (the run's fork point), instead of making one
    run.start_from_checkpoint()
  samples = run.rollout(0, run.next_seed, run.params, 0).samples
  batch = run.batch(trainer.trained_samples(samples, run.trained_agents), run.shape)
  host_params = jax.device_get(run.state.params)
  run.state = None
  names = run.policy.names or ("policy",)
  per_name = lambda b: (layouts.of(run.policy).split(run.policy, b)
                        if layouts.of(run.policy).per_policy_models else [b])
  # [rows] per block, or [blocks, rows] of a stacked batch
  shape_of = lambda b: [list(np.shape(x.response)[:-1]) for x in per_name(b)]
  rows: list[list[int]] = []

  def recording_step(state, frozen, b, targets):
    rows.append(shape_of(b))
    return run.fns.step(state, frozen, b, targets)

  def fresh_state():
    trainable, _ = run.fns.shard_params(host_params, run.frozen)
    return run.fns.init(trainable)

  if run.fns.ref_logp is not None:  # the whole batch needs every policy's reference: the
    # trainer's holds the trained policies' alone (`TrainConfig.reference_policies`)
    whole_fns = make_train_step(dataclasses.replace(run.train_cfg, reference_policies=None),
                                run.mesh)
    whole_ref = whole_fns.reference_params(run.fns.shard_params(host_params, run.frozen)[0])

  def whole_reference():  # the KL reference pass over every row (the trainer before 377fd9d)
    return whole_fns.ref_logp(whole_ref, run.frozen, batch)

  def whole_batch(state):  # the trainer's update before a359963: every row, untrained masked
    full = batch if run.fns.ref_logp is None else whole_reference()
    run.fns.check(full)
    full, targets, _ = run.fns.prepare(full)
    if run.fns.recompute is not None:
      full, targets, _ = run.fns.recompute(state.params, run.frozen, full, targets)
    return run.fns.step(state, run.frozen, full, targets)

  paths = {
      "whole_batch": whole_batch,
      "trained_rows": lambda state: update.run(
          run.fns._replace(step=recording_step), run.train_cfg, state, run.frozen, batch,
          np.random.default_rng(0), run.reference),
  }
  if run.fns.ref_logp is not None:  # the trainer between a359963 and 377fd9d
    paths["trained_rows_whole_reference"] = lambda state: update.run(
        run.fns._replace(step=recording_step, ref_logp=None), run.train_cfg, state, run.frozen,
        whole_reference(), np.random.default_rng(0))
  report = {"config": c.name, "trained_agents": sorted(run.trained_agents),
            "samples": {a: sum(s.agent == a for s in samples) for a in run.spec.agents},
            "blocks": list(names), "cores": os.cpu_count(), "jax": jax.__version__,
            "results": {}}
  for name, path in paths.items():
    times, loss, grad_norm = [], None, None
    for call in range(1 + _REPEATS.value):
      state = fresh_state()
      jax.block_until_ready(state)
      rows.clear()
      start = time.perf_counter()
      state, metrics = path(state)
      jax.block_until_ready((state, metrics))
      times.append(time.perf_counter() - start)
      loss, grad_norm = (float(jax.device_get(metrics[k])) for k in ("loss", "grad_norm"))
    report["results"][name] = {"batch_shape": rows[0] if rows else shape_of(batch),
                               "first_call_s": times[0], "seconds": min(times[1:]),
                               "loss": loss, "grad_norm": grad_norm}
    print(json.dumps({name: report["results"][name]}), flush=True)
  results = report["results"]
  report["speedup"] = {name: r["seconds"] / results["trained_rows"]["seconds"]
                       for name, r in results.items() if name != "trained_rows"}
  report["load_avg_after"] = os.getloadavg()
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  cli.run(main)
