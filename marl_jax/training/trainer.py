"""The trainer: rollout -> training step -> evaluation every N steps -> checkpoint every M.

    summary = train(config, workdir)

With `config.sft.steps > 0` a fresh run first evaluates the pretrained policy (`pretrained/`
metrics at step 0), then runs the supervised warm-start (`training/sft.py`, `sft/` metrics), and
step 0's `eval/` metrics are those of the warm-started policy RL starts from.

Everything a step consumes is a function of (seed, step, data position): training problems are
consecutive fresh seeds from the data position `next_seed` (`step * problems_per_step` unless DAPO
dynamic sampling rolled out extra problems, `training/refill.py`), and each reply is drawn with a
key derived from (run key, step, rollout try, episode, turn, agent, sample) (`Run.sampling_key`,
`training/llm_policy.py`), so a run restarted from its last checkpoint (params, optimizer state,
step, RNG key and data position) repeats exactly the steps an uninterrupted run would have taken,
whichever engine samples.

Key streams of the run key: fold_in(run_key, s) with s = 1 the params' initialisation, 2 the
evaluations, 3 and 4 the RL and warm-start mini-batch shuffles, 5 the rollouts' sampling.

Each step is a rollout (`Run.rollout`, host side) and every update of it through the one update
path (`parallel/update.run`). With `train.max_staleness` = k > 0 the rollouts run on a thread
beside the learner, step s's sampled with the params of step s - k (`training/pipeline.py`).
The static parts of a run come from `training/setup.py`; where RL starts from and its KL
reference (`loss.kl_coef > 0`), from `training/reference.py`.

Multi-host (SPMD, `parallel/multihost.py`): each process rolls out its contiguous slice of the
step's problems (and of the eval problems) with its own sampling stream, on a process-local view
of the params; the processes agree on the batch's bucketed shapes, each builds its rows and the
global batch is assembled from them; rollout and eval metrics are reduced over processes. Process
0 writes logs, plots and summaries; every process writes the traces of its own eval episodes.

Workdir layout: `checkpoints/`, `metrics.jsonl`, `samples/step{N}.md` (`training/samples.py`),
`traces/eval_step{N}.jsonl` (and `traces/pretrained_step0.jsonl` before a warm-start; + content
stores;
process p > 0 of a multi-host run: `traces/eval_step{N}.process{p}.jsonl`),
`learning_curve.png` (unless `logging.learning_curve` is off), `summary.md`, `summary.json`,
`config.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections import defaultdict
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from marl_jax.algos.batch import BatchShape
from marl_jax.errors import UserInputError
from marl_jax.parallel import distributed, layouts, multihost, policies, sharding, update
from marl_jax.parallel import mesh as mesh_lib
from marl_jax.parallel.train_step import make_train_step
from marl_jax.sandbox import runner as sandbox
from marl_jax.training import eval_metrics, pipeline, plots, preflight, progress, reference
from marl_jax.training import refill
from marl_jax.training import config as config_lib
from marl_jax.training import run_identity, setup, workdir_lock
from marl_jax.training import samples as samples_lib
from marl_jax.training import sft as sft_lib
from marl_jax.training.checkpoint import Checkpointer
from marl_jax.training.llm_policy import LLMPolicy
from marl_jax.training.metrics import make_writer
from marl_jax.workflows.rollout import RolloutConfig, RolloutResult, Sample, rollout


def train(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) training in `workdir`; returns the final summary. A resume under a config
  that changes what the run computes is refused before any model is built
  (`run_identity.check_resume`), and so is a second writer of the workdir (`workdir_lock`)."""
  preflight.check_workdir(workdir)
  with workdir_lock.exclusive(workdir, enabled=jax.process_index() == 0):
    return _train(c, workdir)


def _train(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  run_identity.check_resume(workdir, c, write=jax.process_index() == 0)
  run = Run(c, workdir)
  restored = run.checkpointer.restore_or_init(
      {"train": run.state, "rng": run.run_key}, {"next_step": 0, "next_seed": 0})
  run.state = restored.state["train"]
  start = int(restored.host_state["next_step"])
  # Checkpoints written before dynamic sampling existed had no data position: seeds were
  # step * problems_per_step then.
  run.next_seed = int(restored.host_state.get("next_seed", start * c.rollout.problems_per_step))
  writer = make_writer(c.logging, workdir, run.is_main, resume_step=restored.step or 0)
  if restored.step is None:
    _start(run, writer)
  else:
    run.resume_reference()
  bar = progress.step_bar(c.train.steps, start, enabled=c.logging.progress and run.is_main)
  producer = None  # asynchronous RL: the rollouts on a thread beside the learner
  if c.train.max_staleness and start < c.train.steps:
    producer = pipeline.Producer(run, start, c.train.steps, c.train.max_staleness,
                                 run.published_params())
  with producer or contextlib.nullcontext():
    for step in range(start, c.train.steps):
      _step(run, writer, bar, step, producer)
  bar.close()
  writer.flush()
  summary = _finish(run, writer)
  writer.close()
  run.checkpointer.close()
  return summary


def _step(run: Run, writer, bar, step: int, producer: pipeline.Producer | None) -> None:
  """RL step `step` (its rollout from `producer` in an asynchronous run), its evaluation when
  due, its metrics and its checkpoint."""
  c, workdir = run.c, run.workdir
  if producer is None:
    scalars = run.train_step(step)
  else:
    start = time.monotonic()
    rolled = producer.take(step)
    waited = time.monotonic() - start  # the learner's wait for the rollout thread
    scalars = run.train_step(step, rolled)
    scalars["time/rollout_wait_s"] = waited
  done = step + 1
  if producer is not None and producer.needed(done):
    producer.publish(done, run.published_params())
  if done % c.eval.every == 0 or done == c.train.steps:
    scalars.update(run.evaluate(done))
  writer.write_scalars(done, scalars)
  if run.samples_table is not None:  # process 0 only
    samples_lib.publish(run.samples_table, done, workdir, writer)
  progress.show_metrics(bar, scalars, ("rollout/success", "eval/accuracy", "train/loss"))
  bar.update(1)
  writer.flush()  # metrics up to a checkpoint survive a SIGKILL right after it
  run.checkpointer.save(done, {"train": run.state, "rng": run.run_key},
                        {"next_step": done, "next_seed": run.next_seed},
                        force=done == c.train.steps)


def _start(run: Run, writer) -> None:
  """A fresh run's step 0: its config.json, the fork's params (`init_from`), the pretrained
  evaluation, the warm-start and its checkpoint 0, and the evaluation of the policy RL starts
  from."""
  c, workdir = run.c, run.workdir
  if run.is_main:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))
    writer.write_hparams(c.to_dict())
  if c.init_from:
    run.start_from_checkpoint()
  if not (c.eval.at_start or c.sft.steps):
    return
  scalars = {}
  if c.sft.steps:  # step 0's eval/ metrics are the warm-started policy's; pretrained/ before
    if c.eval.at_start:
      scalars.update(run.evaluate(0, split="pretrained"))
    scalars.update(run.warm_start())
  if c.eval.at_start:
    scalars.update(run.evaluate(0))
  writer.write_scalars(0, scalars)
  writer.flush()
  if c.sft.steps:  # a crash in step 1 keeps the warm-start; a fork starts from it (init_from)
    run.checkpointer.save(0, {"train": run.state, "rng": run.run_key},
                          {"next_step": 0, "next_seed": run.next_seed}, force=True)


def _finish(run: Run, writer) -> dict[str, Any]:
  """Learning-curve PNG, Markdown summary table and summary JSON (process 0)."""
  summary: dict[str, Any] = {"steps": run.c.train.steps, "skipped_updates": int(run.state.skipped)}
  if not run.is_main:
    return summary
  rows = plots.summarize(run.workdir)
  summary.update({r["metric"]: r["last"] for r in rows if r["metric"].startswith("eval/")})
  plots.write_summary_table(os.path.join(run.workdir, "summary.md"), rows,
                            title=f"{run.c.env.name}: {run.c.algo.estimator}, "
                                  f"{run.c.policy.kind} policy")
  if run.c.logging.learning_curve:
    plots.plot_learning_curves(run.workdir, os.path.join(run.workdir, "learning_curve.png"))
  writer.write_summary(summary)
  logging.info("summary: %s", json.dumps(summary, default=str))
  return summary


class Run:
  """One configured training run: model, team, workflow, train step and bookkeeping."""

  def __init__(self, c: ml_collections.ConfigDict, workdir: str, *, trains: bool = True):
    """`trains=False`: the run only evaluates, so it holds no KL reference copy."""
    built = preflight.check(c, workdir)  # every input error surfaces here, before any loading
    if c.param_dtype != "float32":
      logging.warning("config.param_dtype=%r (allow_bf16_params): trainable params and AdamW "
                      "moments are stored in %s; at lr %g most updates round away",
                      c.param_dtype, c.param_dtype, c.optim.lr)
    sandbox.require_isolation(c.rollout.allow_unsandboxed)  # refuses or warns before the model
    self.c, self.workdir = c, workdir
    self.is_main = jax.process_index() == 0
    self.spec = built.spec
    self.trained_agents = config_lib.trained_agents(c, built.spec)
    self.policy, base, self.tokenizers = setup.load_team(c, built)
    learner, rollout_devices = config_lib.split_devices(c.train.rollout_devices, jax.devices(),
                                                        jax.process_count())
    shape = config_lib.mesh_shape(tuple(c.train.mesh), len(learner))
    self.mesh = mesh_lib.make_mesh(*shape, devices=learner)
    # Rollout devices of their own (train.rollout_devices): the sampler's params are FSDP-sharded
    # over them, and the engines, which follow their params, run there.
    self.rollout_mesh = (mesh_lib.make_mesh(1, len(rollout_devices), 1, devices=rollout_devices)
                         if c.train.rollout_devices else None)
    # Each process builds its own rows of the batch: 1/processes of the rows, the same minimum.
    procs = jax.process_count()
    shards = mesh_lib.batch_shards(self.mesh) * c.train.micro_batches
    sizes = {"rollout": c.rollout.problems_per_step} | ({"sft": c.sft.problems_per_step}
                                                        if c.sft.steps else {})
    if shards % procs or min(sizes.values()) < procs:
      raise UserInputError(f"{procs} processes need config.<section>.problems_per_step >= "
                           f"{procs} (got {sizes}) and data x fsdp x micro_batches divisible by "
                           f"{procs} (got {shards})")
    self.dynamic = refill.enabled(c, built.advantage)  # one process: preflight
    self.advantage = built.advantage.resolved()
    self.shape = setup.batch_shape(c, self.spec, shards, procs)
    self.train_cfg = setup.train_config(c, built, self.policy, self.shape)
    self.fns = make_train_step(self.train_cfg, self.mesh)
    self.run_key = jax.random.key(c.seed)
    trainable, frozen = policies.init_params(self.policy, jax.random.fold_in(self.run_key, 1),
                                             base=base)
    trainable, self.frozen = self.fns.shard_params(trainable, frozen)
    self.trains = trains
    self.reference = None  # the KL reference's own params (full models with kl_coef > 0)
    if trains and reference.start_point(c, workdir) is None:  # else made where RL starts
      self.reference = reference.copy(self.fns, trainable)
    self.next_seed = 0  # data position: the first seed not trained on yet
    # The rollouts and evaluations share the engines: an asynchronous run's rollout thread and
    # the learner's evaluations take turns.
    self.engine_lock = threading.Lock()
    self.samples_table = None  # the last train step's samples table rows (`training/samples.py`)
    self.local_frozen = self._for_rollouts(policies.sampler_copy(  # never donated
        self.policy, multihost.process_local(self.frozen, self.mesh)), frozen=True)
    self.state = self.fns.init(trainable)
    self.rollout_cfg = RolloutConfig(mode=c.rollout.mode, k=c.rollout.k,
                                     tool_timeout_s=c.rollout.tool_timeout_s,
                                     tool_memory_mb=c.rollout.tool_memory_mb,
                                     record_traces=False)
    engine = dict(engine=c.rollout.engine, options=built.engine)
    self.train_policy = LLMPolicy(self.policy, self.tokenizers,
                                  setup.sampling_params(c, c.sampling.temperature,
                                                        c.sampling.top_p),
                                  self.run_key, setup.agent_sampling_params(c, self.spec.agents),
                                  **engine)
    eval_top_p = c.sampling.top_p if c.eval.top_p is None else c.eval.top_p
    self.eval_policy = LLMPolicy(self.policy, self.tokenizers,
                                 setup.sampling_params(c, c.eval.temperature, eval_top_p),
                                 self.run_key,
                                 setup.agent_sampling_params(c, self.spec.agents, for_eval=True),
                                 engines=self.train_policy.engines, **engine)
    self.checkpointer = Checkpointer.from_config(c.checkpoint, workdir, read_only=not trains,
                                                 identity=run_identity.identity(c))
    self.sft_shape = self.sft_cfg = self.sft_fns = None
    if c.sft.steps:
      self.sft_shape = setup.batch_shape(c, self.spec, shards, procs, sft=True)
      self.sft_cfg = sft_lib.train_config(self.train_cfg, built.optim, c.sft.lr, c.sft.steps,
                                          self.sft_shape.space)
      self.sft_fns = make_train_step(self.sft_cfg, self.mesh)

  @property
  def params(self):
    """(trainable, frozen) for the sampler, on this process's devices (`multihost.process_local`)
    as compute copies (`policies.sampler_copy`: bf16 under bf16 compute, made once per rollout;
    in fp32 compute the train state's own arrays), or on the rollout devices of
    `train.rollout_devices` (copies there). Valid until the next train step (which donates
    them); `published_params` outlives it."""
    local = multihost.process_local(self.state.params, self.mesh)
    return self._for_rollouts(policies.sampler_copy(self.policy, local)), self.local_frozen

  def _for_rollouts(self, params: Any, frozen: bool = False) -> Any:
    """Trainable (or `frozen`) sampler params on the rollout devices, FSDP-sharded over them
    (`rollout_mesh`): the hand-off of a version, device to device; as they are without one."""
    if self.rollout_mesh is None:
      return params
    fsdp = self.rollout_mesh.shape[mesh_lib.FSDP]
    specs = (policies.frozen_specs(params, fsdp) if frozen
             else policies.trainable_specs(self.policy, params, fsdp))
    return sharding.put(params, self.rollout_mesh, specs)

  def evaluate(self, step: int, split: str = "eval") -> dict[str, float]:
    """Evaluation metrics `{split}/...` and traces `traces/{split}_step{step}...jsonl`
    (split "pretrained": the policy before the warm-start).

    Every evaluation of a run draws from the same key stream (common random numbers): the reply
    of (episode, turn, agent) uses the same noise at every step, so two evaluations of nearby
    policies differ by what the policy changed, not by a fresh draw, and the learning curve's
    step-to-step differences (e.g. RL's gain over the warm-start) carry far less sampling noise.
    Each evaluation alone is still an unbiased sample of the policy's success. The stream is
    fold_in(fold_in(run_key, 2), 0), apart from the rollouts' (`sampling_key`)."""
    c = self.c
    self.eval_policy.reseed(multihost.process_key(
        jax.random.fold_in(jax.random.fold_in(self.run_key, 2), 0)))
    process = jax.process_index()
    name = f"{split}_step{step}" + (f".process{process}" if process else "") + ".jsonl"
    trace_path = os.path.join(self.workdir, "traces", name)
    if os.path.exists(trace_path):  # a resumed run re-evaluates this step: keep one copy
      os.remove(trace_path)
      os.remove(trace_path + ".content.jsonl")
    n = c.eval.num_problems
    with self.engine_lock:
      metrics = eval_metrics.evaluate(setup.problems(c, c.eval.seed_offset, n,
                                                     multihost.process_slice(n), for_eval=True),
                                      self.spec,
                                      self.eval_policy, self.params, k=c.eval.k,
                                      rollout_cfg=self.rollout_cfg, trace_path=trace_path)
    return {f"{split}/{k}": v for k, v in metrics.items()}

  def train_step(self, step: int, rolled: Rolled | None = None) -> dict[str, float]:
    """RL step `step`: its rollout (`rolled`, an asynchronous run's from `training/pipeline.py`;
    None: rolled out now with the current params) and every update of it."""
    if not self.trains:
      raise RuntimeError("this Run was built to evaluate (trains=False): it holds no KL "
                         "reference; build it with trains=True to train")
    start = time.monotonic()
    if rolled is None:
      rolled = self.rollout(step, self.next_seed, self.params, step)
    rollout_s = time.monotonic() - start  # 0 for a rollout made beforehand
    self.next_seed = rolled.next_seed
    samples = trained_samples(rolled.samples, self.trained_agents, self.c.train.overlong_filter)
    lag = self.c.train.max_staleness
    stale = 0
    if lag:
      samples, stale = pipeline.admit(samples, step, lag)
    batch = self.batch(samples, self.shape)
    capture = (samples_lib.Capture(self.policy, samples, self.c.logging.samples_episodes)
               if samples_lib.due(self.c.logging, step + 1) else None)  # step + 1: as logged
    self.state, metrics = update.run(self.fns, self.train_cfg, self.state, self.frozen, batch,
                                     self._shuffles(3, step), self.reference, capture)
    self.samples_table = capture.table() if capture is not None and self.is_main else None
    out = _scalars(metrics, self.spec.agents)
    out.update(_rollout_metrics(rolled.result, self.spec.agents))
    out.update(rolled.metrics)
    if lag:
      out.update(pipeline.staleness_metrics(rolled.samples, step, lag))
      out["staleness/dropped"] = float(stale)
    out.update({"time/rollout_s": rolled.seconds,
                "time/train_s": time.monotonic() - start - rollout_s})
    return out

  def _shuffles(self, stream: int, step: int) -> np.random.Generator:
    """The host RNG of step `step`'s mini-batch shuffles (stream 3: RL, 4: the warm-start),
    from the run key, so a resumed run repeats them."""
    key = jax.random.fold_in(jax.random.fold_in(self.run_key, stream), step)
    return np.random.default_rng(np.asarray(jax.random.key_data(key)))

  def warm_start(self) -> dict[str, float]:
    """The supervised warm-start (`training/sft.py`): config.sft.steps updates on demonstrations,
    then a fresh RL optimizer state on the new params. Returns the last step's metrics and the
    first step's loss."""
    c, n = self.c, self.c.sft.problems_per_step
    demonstrator = sft_lib.Demonstrator(self.policy, self.tokenizers, c.sft.mistake_rate)
    params = self.state.params
    self.state = None  # RL's optimizer state is rebuilt afterwards: free it meanwhile
    state, out, first_loss = self.sft_fns.init(params), {}, None
    for step in range(c.sft.steps):
      samples, out = sft_lib.demonstrations(
          setup.problems(c, sft_lib.first_seed(c, step), n, multihost.process_slice(n)),
          self.spec,
          demonstrator, self.rollout_cfg)
      if not multihost.agree_max([len(samples)])[0]:
        raise RuntimeError(f"warm-start step {step}: no demonstration episode of {n} problems "
                           "solved its problem; nothing to train on")
      state, metrics = update.run(self.sft_fns, self.sft_cfg, state, self.frozen,
                                  self.batch(samples, self.sft_shape), self._shuffles(4, step))
      out["sft/loss"] = float(jax.device_get(metrics["loss"]))
      first_loss = out["sft/loss"] if first_loss is None else first_loss
      logging.info("warm-start step %d/%d: loss %.4f, demonstrations solved %.2f", step + 1,
                   c.sft.steps, out["sft/loss"], out["sft/solved"])
    self.state = self.fns.init(state.params)
    if self.trains:
      self.reference = reference.copy(self.fns, state.params)
    return dict(out, **{"sft/first_loss": first_loss, "sft/steps": float(c.sft.steps)})

  def start_from_checkpoint(self) -> None:
    """RL's state from the params of `config.init_from`'s checkpoint (restored into this run's
    layout) with a fresh optimizer state, as after a warm-start."""
    workdir, step = config_lib.init_from(self.c)
    params = reference.restore_params(workdir, step, {"train": self.state, "rng": self.run_key},
                                      f"config.init_from={self.c.init_from!r}")
    logging.info("starting from the params of checkpoint %d in %s", step, workdir)
    self.state = self.fns.init(params)
    if self.trains:
      self.reference = reference.copy(self.fns, params)

  def resume_reference(self) -> None:
    """A resumed run's KL reference, rebuilt from where RL started (`reference.start_point`; the
    pretrained params were copied when the run was built)."""
    start = reference.start_point(self.c, self.workdir)
    if self.fns.reference_params is not None and start is not None:
      self.reference = reference.copy(self.fns, reference.restore_params(
          *start, {"train": self.state, "rng": self.run_key}, start[0]))

  def batch(self, samples: list[Sample], shape: BatchShape) -> Any:
    """The global train batch of these samples in `shape`'s layout; each process passes its
    own."""
    sizes = multihost.agree_max(layouts.batch_sizes(self.policy, samples, shape))
    prompts = None  # each distinct prompt once in the learner: a bound every process agrees on
    if self.c.train.share_prompts:
      prompts = multihost.agree_max([layouts.prompt_bound(self.policy, samples, sizes[0])])[0]
    return self._global_batch(layouts.build_batch(
        self.policy, samples, shape, [t.pad_id for t in self.tokenizers], sizes, prompts), shape)

  def sampling_key(self, step: int, attempt: int) -> jax.Array:
    """The key stream of step `step`'s rollout number `attempt` (DAPO refills roll out again):
    fold_in(fold_in(fold_in(run_key, 5), step), attempt), per process."""
    key = jax.random.fold_in(jax.random.fold_in(self.run_key, 5), step)
    return multihost.process_key(jax.random.fold_in(key, attempt))

  def rollout(self, step: int, seed: int, params: Any, version: int) -> Rolled:
    """Step `step`'s rollout from data position `seed`, sampled with `params` (`Run.params`
    of policy version `version`, which stamps its replies).

    One rollout of `problems_per_step` fresh problems; with DAPO dynamic sampling, more of fresh
    seeds until that many problems qualify or `rollout.max_refills` extra rollouts are spent
    (`refill.select` keeps the first qualifying ones). Each rollout advances the data position.
    Takes the engines (`engine_lock`) for its whole length."""
    c, n = self.c, self.c.rollout.problems_per_step
    start = time.monotonic()
    results, qualifying = [], []  # qualifying[t]: the qualifying problem ids of results[t]
    with self.engine_lock:
      while True:
        self.train_policy.reseed(self.sampling_key(step, len(results)), version=version)
        results.append(rollout(setup.problems(c, seed, n, multihost.process_slice(n)),
                               self.spec, self.train_policy, params, self.rollout_cfg))
        seed += n
        if not self.dynamic:
          return Rolled(step, results[0].samples, results[0], {}, seed,
                        time.monotonic() - start)
        qualifying.append(refill.qualifying_problems(
            results[-1].samples, self.advantage.group_by, self.advantage.alpha))
        if sum(map(len, qualifying)) >= n or len(results) > c.rollout.max_refills:
          break
    samples, metrics = refill.select(results, qualifying, n, self.shape.trajs_per_problem)
    if metrics["rollout/refill_cap_hit"]:
      logging.warning("dynamic sampling: %d of %d problems qualify after %d rollouts "
                      "(rollout.max_refills=%d); training on those",
                      metrics["rollout/qualifying_found"], n, len(results), c.rollout.max_refills)
    every = RolloutResult([s for r in results for s in r.samples],
                          [e for r in results for e in r.episodes],
                          sum(r.safety_events for r in results))
    return Rolled(step, samples, every, metrics, seed, time.monotonic() - start)

  def published_params(self) -> Any:
    """The current params as an asynchronous run's producer samples with them: `params`, with
    the leaves the next update donates copied (`pipeline.own_copy`)."""
    trainable, frozen = self.params
    if self.rollout_mesh is not None:  # a copy on other devices already
      return trainable, frozen
    return pipeline.own_copy(trainable, self.state.params), frozen

  def _global_batch(self, batch: Any, shape: BatchShape) -> Any:
    """This process's rows -> the step's global batch (process p's rows are block p)."""
    if jax.process_count() == 1:
      return self.fns.shard_batch(batch)
    # The step cannot check the ids of a batch no process holds whole: check the local rows.
    layouts.validate_batch(self.policy, shape.space, self.train_cfg.agent_policies, batch,
                           shape.multiple)
    return distributed.process_local_batch_to_global(
        batch, self.mesh, layouts.batch_spec(self.policy, mesh_lib.BATCH_AXES))


@dataclasses.dataclass(frozen=True)
class Rolled:
  """One step's rollout as the learner takes it (`Run.rollout`)."""
  step: int
  samples: list[Sample]  # those the step trains on (dynamic sampling: the selected problems')
  result: RolloutResult  # every rollout of the step, for the metrics
  metrics: dict[str, float]  # dynamic sampling's refill metrics
  next_seed: int  # the data position after it
  seconds: float


def trained_samples(samples: list[Sample], agents: frozenset[str], overlong_filter: bool = False
                    ) -> list[Sample]:
  """The rollout's samples as RL trains on them: those of `agents` (`config.train.agents`),
  less, with `overlong_filter` (`config.train.overlong_filter`), the replies the token budget cut
  off. A sample left out keeps its reward and ids, so it still counts in its group's advantage
  statistics and the others' advantages are those of a run that trains on everything; it is
  marked `trained=False`, so its tokens are masked out of every loss term (`algos/batch.py`),
  and the updates leave its row out (`update.trained_rows`)."""
  return [s if s.agent in agents and not (overlong_filter and _truncated(s))
          else dataclasses.replace(s, trained=False) for s in samples]


def _truncated(sample: Sample) -> bool:
  """Whether the token budget ended the sample's reply (the sampler's finish reason)."""
  return sample.generation.finish_reason == "length"


def _rollout_metrics(result, agents) -> dict[str, float]:
  """Means over every process's rollout (a collective, see `multihost.global_means`)."""
  rewards = defaultdict(list)
  for s in result.samples:
    rewards[s.agent].append(s.reward)
  parts = {f"reward/{a}": multihost.sum_count(rewards[a]) for a in agents}
  parts["success"] = multihost.sum_count([e.solved for e in result.episodes])
  parts["safety_event_rate"] = (float(result.safety_events), len(result.samples))
  parts["response_tokens"] = multihost.sum_count([len(s.generation.token_ids)
                                                  for s in result.samples])
  parts["truncated"] = multihost.sum_count([_truncated(s) for s in result.samples])
  return {f"rollout/{k}": v for k, v in multihost.global_means(parts).items()}


def _scalars(metrics: dict[str, Any], agents: tuple[str, ...]) -> dict[str, float]:
  """Device metrics -> named scalars; per-agent vectors become one entry per agent that has
  samples in the update (an agent that did not act, e.g. a worker nobody spawned, has no mean to
  report), besides `agent/samples/<agent>` for every agent (with PPO mini-batches: means over
  the rollout's updates, as every step metric)."""
  metrics = jax.device_get(metrics)
  acted = np.asarray(metrics["agent/samples"]) > 0
  out = {}
  for name, value in metrics.items():
    value = np.asarray(value)
    if value.ndim == 1 and value.shape[0] == len(agents):
      out.update({f"{name}/{a}": float(v) for a, v, on in zip(agents, value, acted)
                  if on or name == "agent/samples"})
    elif value.size == 1:
      out[f"train/{name}"] = float(value)
  return out


