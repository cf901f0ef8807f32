"""The trainer: rollout -> training step -> evaluation every N steps -> checkpoint every M.

    summary = train(config, workdir)

With `config.sft.steps > 0` a fresh run first evaluates the pretrained policy (`pretrained/`
metrics at step 0), then runs the supervised warm-start (`training/sft.py`, `sft/` metrics), and
step 0's `eval/` metrics are those of the warm-started policy RL starts from.

Everything a step consumes is a function of (seed, step, data position): training problems are
consecutive fresh seeds from the data position `next_seed` (`step * problems_per_step` unless DAPO
dynamic sampling rolled out extra problems, `training/refill.py`), sampling keys are
`fold_in(run_key, step)`, so a run restarted from its last checkpoint (params, optimizer state,
step, RNG key and data position) repeats exactly the steps an uninterrupted run would have taken.

KL to a frozen reference (`loss.kl_coef > 0`): a reference pass fills `ref_logp` before each update
(`train_step.fill_ref_logp`; of the trained rows only when a team RL trains in part). LoRA: the
base without adapters (no extra memory). Full models (shared, stacked, mapped): a frozen copy of
the params RL starts from in their own buffers (the size of those params; logged): the pretrained
ones, the warm-started ones, or `init_from`'s. It is never updated and not checkpointed: a resumed
run rebuilds it from what it started from (the pretrained weights and the seed, its own checkpoint
0, or `init_from`'s checkpoint).

Multi-host (SPMD, `parallel/multihost.py`): each process rolls out its contiguous slice of the
step's problems (and of the eval problems) with its own sampling stream, on a process-local view
of the params; the processes agree on the batch's bucketed shapes, each builds its rows and the
global batch is assembled from them; rollout and eval metrics are reduced over processes. Process
0 writes logs, plots and summaries; every process writes the traces of its own eval episodes.

Workdir layout: `checkpoints/`, `metrics.jsonl`, `traces/eval_step{N}.jsonl` (and
`traces/pretrained_step0.jsonl` before a warm-start; + content stores;
process p > 0 of a multi-host run: `traces/eval_step{N}.process{p}.jsonl`),
`learning_curve.png`, `summary.md`, `summary.json`, `config.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from marl_jax.algos.batch import BatchShape
from marl_jax.errors import UserInputError
from marl_jax.models import loading, precision
from marl_jax.models.config import ModelConfig
from marl_jax.models.tokenizer import Tokenizer
from marl_jax.parallel import distributed, layouts, minibatch, multihost, policies
from marl_jax.parallel import mesh as mesh_lib
from marl_jax.parallel.train_step import TrainConfig, make_train_step
from marl_jax.sampling.params import SamplingParams
from marl_jax.sandbox import runner as sandbox
from marl_jax.training import eval_results, evaluation, plots, preflight, progress, refill
from marl_jax.training import config as config_lib
from marl_jax.training import sft as sft_lib
from marl_jax.training import run_identity, workdir_lock
from marl_jax.training.checkpoint import CHECKPOINT_DIR, Checkpointer, saved_steps
from marl_jax.training.checkpoint_integrity import one_line
from marl_jax.training.llm_policy import LLMPolicy
from marl_jax.training.metrics import make_writer
from marl_jax.workflows import registry
from marl_jax.workflows.rollout import (Problem, RolloutConfig, RolloutResult, Sample, id_layout,
                                       rollout)
from marl_jax.workflows.spec import WorkflowSpec


def problems(c: ml_collections.ConfigDict, first_seed: int, count: int,
             ids: range | None = None, for_eval: bool = False) -> list[Problem]:
  """Problems `ids` (default: all) of `count` from consecutive seeds; problem i has seed
  `first_seed + i` and id i, so a process's slice keeps the global dense ids. Env kwargs that
  name a local dataset turn seed s into row `s % rows` (`registry.problem_kwargs`); evaluation's
  kwargs can name their own split (`config_lib.env_kwargs`)."""
  extra = config_lib.env_kwargs(c, for_eval)
  return [Problem(c.env.name, registry.problem_kwargs(c.env.name, c.env.workflow, c.env.max_turns,
                                                      first_seed + i, extra), i)
          for i in (range(count) if ids is None else ids)]


def batch_shape(c: ml_collections.ConfigDict, spec: WorkflowSpec, shards: int,
                procs: int = 1, sft: bool = False) -> BatchShape:
  """The static sizes of a step's batch on `procs` processes: each process's rows split into
  `shards` / `procs` pieces (its devices x micro-batches). `sft`: of a warm-start step."""
  mode, k, num = ((sft_lib.ROLLOUT_MODE, sft_lib.ROLLOUT_K, c.sft.problems_per_step) if sft
                  else (c.rollout.mode, c.rollout.k, c.rollout.problems_per_step))
  trajs, branching = id_layout(mode, k, spec.max_turns)
  return BatchShape(
      num_problems=num, trajs_per_problem=trajs, branching=branching,
      max_turns=spec.max_turns, num_agents=len(spec.agents), num_states=spec.num_states,
      multiple=shards // procs, min_rows=max(1, BatchShape.min_rows // procs))


def train_config(c: ml_collections.ConfigDict, built: config_lib.Built,
                 policy: policies.PolicyConfig, shape: BatchShape) -> TrainConfig:
  """The static configuration of the train step of config `c`."""
  return TrainConfig(
      policy=policy, advantage=built.advantage, loss=built.loss, space=shape.space,
      agent_policies=tuple(built.spec.policy_id(a) for a in built.spec.agents),
      temperature=config_lib.learner_temperature(c), micro_batches=c.train.micro_batches,
      remat=c.train.remat, logits_chunk=c.train.logits_chunk, target_kl=c.train.target_kl,
      mini_batch_size=c.train.mini_batch_size, epochs=c.train.epochs,
      recompute_old_logp=c.train.recompute_old_logp, tis_cap=c.train.tis_cap,
      agent_grad_norms=c.train.agent_grad_norms, reference_policies=trained_policies(c, built))


def trained_policies(c: ml_collections.ConfigDict, built: config_lib.Built) -> tuple[int, ...]:
  """The ids of the policies that act for an agent RL trains (`config.train.agents`): the
  others get a frozen optimizer (`policy_config`), and their rows no update computes."""
  spec, trained = built.spec, config_lib.trained_agents(c, built.spec)
  return tuple(sorted({spec.policy_id(a) for a in trained}))


def team_names(c: ml_collections.ConfigDict, spec: WorkflowSpec
               ) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the model of each model config, the policy names). A mapped team has one model per policy,
  `c.policy.models` in agent order (empty: `c.model` for each), and names each policy after its
  agents, so its params and batch dicts read as the roles; other teams have `c.model` and no
  names."""
  if not layouts.of(c.policy).per_policy_models:
    return (c.model,), ()
  num = spec.num_policies
  return (tuple(c.policy.models) or (c.model,) * num,
          tuple("+".join(a for a in spec.agents if spec.policy_id(a) == p) for p in range(num)))


def policy_config(c: ml_collections.ConfigDict, built: config_lib.Built,
                  models: Sequence[ModelConfig]) -> policies.PolicyConfig:
  """The team's PolicyConfig over the architectures of `team_names(...)[0]`. A policy that acts
  for none of the agents RL trains (`config.train.agents`) gets a frozen optimizer: its
  gradient is zero anyway, and so it also skips AdamW's decoupled weight decay and holds no
  moments; the warm-start (`sft.train_config`) still trains every policy."""
  spec, trained = built.spec, trained_policies(c, built)
  frozen = dataclasses.replace(built.optim, frozen=True)
  optim = tuple(built.optim if p in trained else frozen for p in range(spec.num_policies))
  return policies.PolicyConfig(
      kind=c.policy.kind, models=tuple(models), num_policies=spec.num_policies,
      names=team_names(c, spec)[1], lora=built.lora, optim=optim,
      critic=built.critic, critic_optim=built.critic_optim)


def load_team(c: ml_collections.ConfigDict, built: config_lib.Built
              ) -> tuple[policies.PolicyConfig, Any, list[Tokenizer]]:
  """The team's PolicyConfig, base params and one tokenizer per model config (`team_names`).

  A model named twice is read once and copied: the train step donates its state, and two
  policies must never share one buffer.
  """
  names, policy_names = team_names(c, built.spec)
  loaded: dict[str, loading.LoadedModel] = {}
  params = []
  for name in names:
    if name in loaded:
      params.append(jax.tree.map(np.array, loaded[name].params))
    else:
      loaded[name] = loading.load_model(name, c.param_dtype,
                                        precision.compute_dtype(c.compute_dtype))
      params.append(loaded[name].params)
  models = [loaded[name] for name in names]
  policy = policy_config(c, built, [m.config for m in models])
  base = dict(zip(policy_names, params)) if policy_names else params[0]
  return policy, base, [m.tokenizer for m in models]


def sampling_params(c: ml_collections.ConfigDict, temperature: float, top_p: float
                    ) -> SamplingParams:
  """config.sampling's budget and top-k at `temperature` and `top_p` (rollout or evaluation)."""
  return SamplingParams(max_new_tokens=c.sampling.max_new_tokens, temperature=temperature,
                        top_p=top_p, top_k=c.sampling.top_k)


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


def trained_samples(samples: list[Sample], agents: frozenset[str]) -> list[Sample]:
  """The rollout's samples as RL trains on them (`config.train.agents`). An untrained agent's
  sample keeps its reward and ids, so it still counts in its group's advantage statistics and
  the trained agents' advantages are those of a run that trains everyone; it is marked
  `trained=False`, so its tokens are masked out of every loss term (`algos/batch.py`), and the
  updates leave its row out (`minibatch.trained_rows`)."""
  return [s if s.agent in agents else dataclasses.replace(s, trained=False) for s in samples]


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
    self.policy, base, self.tokenizers = load_team(c, built)
    shape = config_lib.mesh_shape(tuple(c.train.mesh), jax.device_count())
    self.mesh = mesh_lib.make_mesh(*shape)
    # Each process builds its own rows of the batch: 1/processes of the rows, the same minimum.
    procs = jax.process_count()
    shards = mesh_lib.batch_shards(self.mesh) * c.train.micro_batches
    sizes = {"rollout": c.rollout.problems_per_step} | ({"sft": c.sft.problems_per_step}
                                                        if c.sft.steps else {})
    if shards % procs or min(sizes.values()) < procs:
      raise UserInputError(f"{procs} processes need config.<section>.problems_per_step >= "
                           f"{procs} (got {sizes}) and data x fsdp x micro_batches divisible by "
                           f"{procs} (got {shards})")
    self.dynamic = config_lib.dynamic_sampling(c, built.advantage)  # one process: preflight
    self.advantage = built.advantage.resolved()
    self.shape = batch_shape(c, self.spec, shards, procs)
    self.train_cfg = train_config(c, built, self.policy, self.shape)
    self.fns = make_train_step(self.train_cfg, self.mesh)
    self.run_key = jax.random.key(c.seed)
    trainable, frozen = policies.init_params(self.policy, jax.random.fold_in(self.run_key, 1),
                                             base=base)
    trainable, self.frozen = self.fns.shard_params(trainable, frozen)
    self.reference = None  # the KL reference's own params (full models with kl_coef > 0)
    self.trains = trains
    if self._start_checkpoint() is None:  # else set where RL's starting params are made
      self._set_reference(trainable)
    self.next_seed = 0  # data position: the first seed not rolled out yet
    self.local_frozen = policies.sampler_copy(  # never donated
        self.policy, multihost.process_local(self.frozen, self.mesh))
    self.state = self.fns.init(trainable)
    self.rollout_cfg = RolloutConfig(mode=c.rollout.mode, k=c.rollout.k,
                                     tool_timeout_s=c.rollout.tool_timeout_s,
                                     tool_memory_mb=c.rollout.tool_memory_mb,
                                     record_traces=False)
    self.train_policy = LLMPolicy(self.policy, self.tokenizers,
                                  sampling_params(c, c.sampling.temperature, c.sampling.top_p),
                                  self.run_key)
    eval_top_p = c.sampling.top_p if c.eval.top_p is None else c.eval.top_p
    self.eval_policy = LLMPolicy(self.policy, self.tokenizers,
                                 sampling_params(c, c.eval.temperature, eval_top_p), self.run_key)
    self.checkpointer = Checkpointer.from_config(c.checkpoint, workdir, read_only=not trains,
                                                 identity=run_identity.identity(c))
    self.sft_shape = self.sft_fns = None
    if c.sft.steps:
      self.sft_shape = batch_shape(c, self.spec, shards, procs, sft=True)
      self.sft_fns = make_train_step(sft_lib.train_config(
          self.train_cfg, built.optim, c.sft.lr, c.sft.steps, self.sft_shape.space), self.mesh)

  @property
  def params(self):
    """(trainable, frozen) for the sampler, on this process's devices (`multihost.process_local`)
    as compute copies (`policies.sampler_copy`: bf16 under bf16 compute, made once per rollout;
    in fp32 compute the train state's own arrays). Valid until the next train step."""
    local = multihost.process_local(self.state.params, self.mesh)
    return policies.sampler_copy(self.policy, local), self.local_frozen

  def evaluate(self, step: int, split: str = "eval") -> dict[str, float]:
    """Evaluation metrics `{split}/...` and traces `traces/{split}_step{step}...jsonl`
    (split "pretrained": the policy before the warm-start)."""
    c = self.c
    self.eval_policy.reseed(multihost.process_key(
        jax.random.fold_in(jax.random.fold_in(self.run_key, 2), step)))
    process = jax.process_index()
    name = f"{split}_step{step}" + (f".process{process}" if process else "") + ".jsonl"
    trace_path = os.path.join(self.workdir, "traces", name)
    if os.path.exists(trace_path):  # a resumed run re-evaluates this step: keep one copy
      os.remove(trace_path)
      os.remove(trace_path + ".content.jsonl")
    n = c.eval.num_problems
    metrics = evaluation.evaluate(problems(c, c.eval.seed_offset, n, multihost.process_slice(n),
                                           for_eval=True),
                                  self.spec,
                                  self.eval_policy.generate, self.params, k=c.eval.k,
                                  rollout_cfg=self.rollout_cfg, trace_path=trace_path)
    return {f"{split}/{k}": v for k, v in metrics.items()}

  def train_step(self, step: int) -> dict[str, float]:
    if not self.trains:
      raise RuntimeError("this Run was built to evaluate (trains=False): it holds no KL "
                         "reference; build it with trains=True to train")
    self.train_policy.reseed(multihost.process_key(jax.random.fold_in(self.run_key, step)))
    start = time.monotonic()
    samples, result, refill_metrics = self._rollout()
    rollout_s = time.monotonic() - start
    batch = self._batch(trained_samples(samples, self.trained_agents), self.shape)
    if self.fns.old_values is not None:  # MARFT: GAE needs the critic's values of these states
      batch = self.fns.old_values(self.state.params, self.frozen, batch)
    if self.train_cfg.uses_targets or self.trained_agents != set(self.spec.agents):
      # PPO mini-batches / epochs, or updates on the trained agents' rows only (a team RL
      # trains in part: `minibatch.trained_rows`; the KL reference pass runs on those rows
      # alone); shuffles from (run key, step)
      shuffle = np.random.default_rng(np.asarray(jax.random.key_data(
          jax.random.fold_in(jax.random.fold_in(self.run_key, 3), step))))
      self.state, metrics = minibatch.ppo_updates(self.fns, self.train_cfg, self.state,
                                                  self.frozen, batch, shuffle, self.reference)
    else:
      if self.fns.ref_logp is not None:  # the KL term's reference log-probs
        batch = self.fns.ref_logp(self.reference, self.frozen, batch)
      self.state, metrics = self.fns.step(self.state, self.frozen, batch)
    out = _scalars(metrics, self.spec.agents)
    out.update(_rollout_metrics(result, self.spec.agents))
    out.update(refill_metrics)
    out.update({"time/rollout_s": rollout_s, "time/train_s": time.monotonic() - start - rollout_s})
    return out

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
          problems(c, sft_lib.first_seed(c, step), n, multihost.process_slice(n)), self.spec,
          demonstrator, self.rollout_cfg)
      if not multihost.agree_max([len(samples)])[0]:
        raise RuntimeError(f"warm-start step {step}: no demonstration episode of {n} problems "
                           "solved its problem; nothing to train on")
      state, metrics = self.sft_fns.step(state, self.frozen, self._batch(samples,
                                                                         self.sft_shape))
      out["sft/loss"] = float(jax.device_get(metrics["loss"]))
      first_loss = out["sft/loss"] if first_loss is None else first_loss
      logging.info("warm-start step %d/%d: loss %.4f, demonstrations solved %.2f", step + 1,
                   c.sft.steps, out["sft/loss"], out["sft/solved"])
    self.state = self.fns.init(state.params)
    self._set_reference(state.params)
    return dict(out, **{"sft/first_loss": first_loss, "sft/steps": float(c.sft.steps)})

  def start_from_checkpoint(self) -> None:
    """RL's state from the params of `config.init_from`'s checkpoint (restored into this run's
    layout) with a fresh optimizer state, as after a warm-start."""
    workdir, step = config_lib.init_from(self.c)
    params = self._checkpoint_params(workdir, step, f"config.init_from={self.c.init_from!r}")
    logging.info("starting from the params of checkpoint %d in %s", step, workdir)
    self.state = self.fns.init(params)
    self._set_reference(params)

  def resume_reference(self) -> None:
    """A resumed run's KL reference, as its first process had it: the params RL started from,
    `config.init_from`'s checkpoint or, after a warm-start, the run's own checkpoint 0 (which
    rotation keeps)."""
    start = self._start_checkpoint()
    if self.fns.reference_params is not None and start is not None:
      workdir, step = start
      self._set_reference(self._checkpoint_params(workdir, step, workdir))

  def _start_checkpoint(self) -> tuple[str, int] | None:
    """Where the params RL starts from are saved, when they are not the pretrained ones:
    `config.init_from`'s checkpoint, or this run's checkpoint 0 after its warm-start."""
    if self.c.init_from:
      return config_lib.init_from(self.c)
    return (self.workdir, 0) if self.c.sft.steps else None

  def _set_reference(self, trainable: Any) -> None:
    """The KL reference (`loss.kl_coef` > 0): the policy RL starts from, in its own buffers,
    never updated. Full models: a copy of `trainable`'s policy params (a stacked team that RL
    trains in part: the trained policies' blocks, `trained_policies`), so after a warm-start
    the KL keeps RL near the warm-started policy, not the pretrained one (which never saw the
    reply format). LoRA: the base without adapters (RL from trained adapters is refused)."""
    if self.fns.reference_params is None or not self.trains:
      return
    self.reference = self.fns.reference_params(trainable)
    size = sum(x.nbytes for x in jax.tree.leaves(self.reference))
    logging.info("KL reference: %s", "the LoRA base without adapters (no extra memory)"
                 if self.reference is None else
                 f"a frozen copy of the policy params RL starts from, {size} bytes "
                 f"({size / 2**20:.1f} MiB)")

  def _checkpoint_params(self, workdir: str, step: int, source: str) -> Any:
    """The trainable params of checkpoint `step` of `workdir`, restored into this run's layout;
    `source` names where the step came from in the refusal."""
    with Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), read_only=True) as checkpoints:
      try:
        restored = checkpoints.restore(step, target={"train": self.state, "rng": self.run_key})
      except (ValueError, TypeError, KeyError) as e:
        raise UserInputError(f"{source}: checkpoint {step} does not fit this config's team and "
                             f"optimizer ({one_line(e)}); expected a run of the same models, "
                             "policy layout and trained agents") from None
    return restored.state["train"].params

  def _batch(self, samples: list[Sample], shape: BatchShape) -> Any:
    """The global train batch of these samples in `shape`'s layout; each process passes its
    own."""
    sizes = multihost.agree_max(layouts.batch_sizes(self.policy, samples, shape))
    prompts = None  # each distinct prompt once in the learner: a bound every process agrees on
    if self.c.train.share_prompts:
      prompts = multihost.agree_max([layouts.prompt_bound(self.policy, samples, sizes[0])])[0]
    return self._global_batch(layouts.build_batch(
        self.policy, samples, shape, [t.pad_id for t in self.tokenizers], sizes, prompts), shape)

  def _rollout(self) -> tuple[list[Sample], RolloutResult, dict[str, float]]:
    """The step's samples, every rollout's result (for the metrics) and the refill metrics.

    One rollout of `problems_per_step` fresh problems; with DAPO dynamic sampling, more of fresh
    seeds until that many problems qualify or `rollout.max_refills` extra rollouts are spent
    (`refill.select` keeps the first qualifying ones). Each rollout advances the data position."""
    c, n = self.c, self.c.rollout.problems_per_step
    results, qualifying = [], []  # qualifying[t]: the qualifying problem ids of results[t]
    while True:
      results.append(rollout(problems(c, self.next_seed, n, multihost.process_slice(n)),
                             self.spec, self.train_policy.generate, self.params,
                             self.rollout_cfg))
      self.next_seed += n
      if not self.dynamic:
        return results[0].samples, results[0], {}
      qualifying.append(refill.qualifying_problems(results[-1].samples, self.advantage.group_by,
                                                   self.advantage.alpha))
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
    return samples, every, metrics

  def _global_batch(self, batch: Any, shape: BatchShape) -> Any:
    """This process's rows -> the step's global batch (process p's rows are block p)."""
    if jax.process_count() == 1:
      return self.fns.shard_batch(batch)
    # The step cannot check the ids of a batch no process holds whole: check the local rows.
    layouts.validate_batch(self.policy, shape.space, self.train_cfg.agent_policies, batch,
                           shape.multiple)
    return distributed.process_local_batch_to_global(
        batch, self.mesh, layouts.batch_spec(self.policy, mesh_lib.BATCH_AXES))


def evaluate_checkpoint(c: ml_collections.ConfigDict, workdir: str, step: int | None = None,
                        split: str | None = None) -> dict[str, Any]:
  """Evaluates checkpoint `step` of `workdir` (default: the latest) on the run's evaluation
  problems, or on the set `split` names (its files given by `config.eval.env_kwargs`); writes the
  result where `eval_results` says and returns it. Bad input (split name, missing step) is refused
  before the model loads.

  A workdir without checkpoints evaluates step 0, the policy RL would start from: the base model,
  after the config's warm-start when `sft.steps` > 0 (as `train` evaluates step 0), or the
  params of `config.init_from`. So a table's
  rows without RL are the RL rows' starting point, also where a cpu preset warm-starts."""
  eval_results.check_split(split)
  if step is not None:
    preflight.check_workdir(workdir)
    steps = saved_steps(workdir)
    if step not in steps:
      raise UserInputError(f"--checkpoint={step}: no such checkpoint in {workdir}; expected one "
                           f"of the saved steps {steps}")
  run = Run(c, workdir, trains=False)
  warm_start = {}
  if step is not None or run.checkpointer.latest_step() is not None:
    restored = run.checkpointer.restore(step, target={"train": run.state, "rng": run.run_key})
    run.state, step = restored.state["train"], restored.step
  elif c.init_from:
    run.start_from_checkpoint()
  elif c.sft.steps:
    warm_start = run.warm_start()
  step = step or 0
  result = {"config": c.name, "step": step,
            **evaluation.answer_grader(problems(c, c.eval.seed_offset, 1, for_eval=True)[0]),
            **warm_start, **run.evaluate(step, split or "eval")}
  eval_results.write(workdir, step, split, result)
  return result


def train(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) training in `workdir`; returns the final summary. A resume under a config
  that changes what the run computes is refused before any model is built
  (`config.check_resume`), and so is a second writer of the workdir (`workdir_lock`)."""
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
  fresh = restored.step is None
  if run.is_main and fresh:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))
    writer.write_hparams(c.to_dict())
  if fresh and c.init_from:
    run.start_from_checkpoint()
  elif not fresh:
    run.resume_reference()
  if fresh and (c.eval.at_start or c.sft.steps):
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
  bar = progress.step_bar(c.train.steps, start, enabled=c.logging.progress and run.is_main)
  for step in range(start, c.train.steps):
    scalars = run.train_step(step)
    done = step + 1
    if done % c.eval.every == 0 or done == c.train.steps:
      scalars.update(run.evaluate(done))
    writer.write_scalars(done, scalars)
    progress.show_metrics(bar, scalars, ("rollout/success", "eval/accuracy", "train/loss"))
    bar.update(1)
    writer.flush()  # metrics up to a checkpoint survive a SIGKILL right after it
    run.checkpointer.save(done, {"train": run.state, "rng": run.run_key},
                          {"next_step": done, "next_seed": run.next_seed},
                          force=done == c.train.steps)
  bar.close()
  writer.flush()
  summary = _finish(run, writer)
  writer.close()
  run.checkpointer.close()
  return summary


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
  plots.plot_learning_curves(run.workdir, os.path.join(run.workdir, "learning_curve.png"))
  writer.write_summary(summary)
  logging.info("summary: %s", json.dumps(summary, default=str))
  return summary
