r"""Plans a paper-scale run without the hardware: memory per device, FLOPs, step time, fit.

    python -m experiments.plan --config=configs/atgrpo_math.py:mas_shared --devices=8 \
        [--mesh=1,8,1] [--device=h100|v5e|v4|<GiB>] [--mfu=0.4] [--peak_tflops=989] \
        [--hbm_gbps=3350] [--prompt_tokens=512] [--config.train.rollout_devices=R] \
        [--link_gbps=450]

N fake CPU devices: `main` sets XLA_FLAGS=--xla_force_host_platform_device_count=N (and
JAX_PLATFORMS=cpu) before jax first initialises its backend (importing jax does not), then checks
that jax sees N devices. Params are `jax.eval_shape` of the policy init with the FSDP shardings
of `policies.param_specs`, so nothing of the model's size is allocated; each program is
`jax.jit(...).lower(abstract).compile()` for the config's mesh:

  train_step  the trainer's own update (`TrainFns.update`) on one optimizer update's batch of
              the config's shapes (every episode runs `max_turns` turns and every agent acts
              each turn: an upper bound): the whole rollout, or with `train.mini_batch_size` one
              mini-batch per policy block, its FLOPs times the updates of all epochs. Prompts of
              `--prompt_tokens` (shared as the rollout shares them), responses of
              `sampling.max_new_tokens` (each agent's `sampling.per_agent` budget where set),
              bucketed as the trainer buckets them. The
              once-per-rollout forwards (recomputed old log-probs, KL reference, critic values)
              are not counted, the KL reference's params are.
  prefill     the sampler's prefill of the largest `generate` call's distinct prompts (the first
              policy's model, for a mapped team of several architectures).
  decode      with `rollout.engine="static"`: the sampler's own `generate_tokens` program for
              that call (prefill, then the decode loops over blocks of growing cache spans) for
              memory; FLOPs: one decode step over the largest span x the largest budget. Both
              sampler programs run on the FSDP-sharded params with unplaced prompts, as the
              sampler does; their FLOPs per device are the call's total (`flops_total`) over the
              device count, the best spread. With the continuous engine (the default): one
              decode call over `engine.slots` rows and the engine's K/V pool (`engine_program`),
              and the report's `engine` section sizes that pool at the config's scale.

Asynchronous RL (`train.max_staleness`, `training/pipeline.py`): with
--config.train.rollout_devices=R the learner's programs are planned on the first N - R devices
(--mesh for them) and the rollout's on the last R (FSDP over them, holding the sampler's compute
copy alone), as the trainer places them, and the JSON holds two reports, `synchronous` (one
device set) and `asynchronous` (the split), and their ratio `predicted_speedup`; each report's
`schedule` gives rollout, update and hand-off seconds and the step under each schedule.

Memory: XLA's `memory_analysis` of each compiled program per device (arguments + outputs -
aliased + temporaries + code); the sampler programs count the whole train state resident
during the rollout (params, optimizer state, frozen base, KL reference) instead of their param
arguments. FLOPs: matmul FLOPs per device counted from the traced program, loops
times their trip counts (XLA's `cost_analysis` counts a loop body once, so it is reported as
`xla_flops` only). Seconds = FLOPs / (mfu x peak), the peak by default the device's dense bf16
one whatever the config's dtype; decode takes at least its HBM time (`hbm_seconds`: each step
reads every weight and the rows' K/V, `hbm_bytes_per_step`), which at RL's row counts is far
above its FLOP time. Prints JSON on stdout, a table on stderr, and
exits 1 with one line when the config does not fit the device memory.

Measured (2-core CPU, load ~2): Qwen3-1.7B AT-GRPO math (`mas_shared`, 2048 samples of 512 +
2048 tokens, mini-batches of 16, mesh 1,8,1) plans in ~35 s. SmolLM2-135M, 8 rows of 128 + 128 tokens, remat, one
device: plan's train step 2.88 GiB (0.50 params + 1.00 AdamW + 1.38 temporaries), 1.94 TFLOP;
`bench_train_step --modes jax_full_remat --random` at the same shapes: peak RSS 3.59 GiB (the
rest: the Python / XLA runtime and host copies), 16.4 s per step (0.12 TFLOP/s achieved).
Over 400 lines: flags, stand-in batch, the three programs and the report are one pipeline; split
it when it grows.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import cli
from marl_jax.algos import batch as batch_lib
from marl_jax.algos.batch import BatchShape
from marl_jax.errors import UserInputError
from marl_jax.models import decoder, hf, precision
from marl_jax.models.config import PRESETS, ModelConfig
from marl_jax.parallel import layouts, policies, sharding
from marl_jax.parallel import mesh as mesh_lib
from marl_jax.parallel.train_config import TrainConfig
from marl_jax.parallel.train_step import TrainFns, make_train_step
from marl_jax.sampling import paged_attention, paged_runner
from marl_jax.sampling.decode import generate_tokens
from marl_jax.sampling.logits import Knobs
from marl_jax.sampling.sampler import Buckets, Sampler, prompt_layout
from marl_jax.shapes import bucket, round_up
from marl_jax.training import config as config_lib
from marl_jax.training import preflight
from marl_jax.training import setup as setup_lib

# name -> (memory GiB, dense bf16 peak TFLOP/s, HBM GB/s, device-to-device GB/s one way; None:
# not published per chip) per device, from the vendors' spec sheets (H100 SXM: NVLink 900 GB/s
# both ways; v5e: ICI 400 GB/s both ways).
DEVICES = {"h100": (80.0, 989.0, 3350.0, 450.0), "v5e": (16.0, 197.0, 819.0, 200.0),
           "v4": (32.0, 275.0, 1200.0, None)}
GIB = 2**30

cli.check_flagfiles(sys.argv)  # config_flags reads flag files at definition
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file: configs/NAME.py[:PRESET].", lock_config=True)
_DEVICES = flags.DEFINE_integer("devices", 8, "Fake devices to plan for.")
_MESH = flags.DEFINE_string("mesh", None, "data,fsdp,tensor sizes (one may be -1); default: "
                            "config.train.mesh.")
_DEVICE = flags.DEFINE_string("device", "h100", f"Per-device memory: one of {list(DEVICES)} or "
                              "a number of GiB.")
_MFU = flags.DEFINE_float("mfu", 0.4, "Model FLOPs utilisation assumed for the time estimate.")
_PEAK = flags.DEFINE_float("peak_tflops", None, "Peak TFLOP/s per device; default: the device's "
                           "dense bf16 peak (a number of GiB for --device needs this).")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 512, "Prompt tokens per sample (the config does "
                               "not bound them).")
_HBM = flags.DEFINE_float("hbm_gbps", None, "HBM GB/s per device; default: the device's (none for "
                          "a number of GiB: decode is then bounded by FLOPs alone).")
_LINK = flags.DEFINE_float("link_gbps", None, "Device-to-device GB/s one way, for the weight "
                           "hand-off of config.train.rollout_devices; default: the device's.")
flags.mark_flag_as_required("config")


@dataclasses.dataclass(frozen=True)
class Target:
  """The device planned for: memory per device and peak FLOP/s."""
  name: str
  memory_bytes: int
  peak_flops: float
  mfu: float
  hbm_bytes_per_s: float | None = None  # None: decode bounded by FLOPs alone
  link_bytes_per_s: float | None = None  # one way, device to device


def parse_target(device: str, peak_tflops: float | None, mfu: float,
                 hbm_gbps: float | None = None, link_gbps: float | None = None) -> Target:
  """--device / --peak_tflops / --mfu / --hbm_gbps / --link_gbps -> Target; bad values raise
  UserInputError."""
  if not 0 < mfu <= 1:
    raise UserInputError(f"--mfu={mfu}; expected a fraction in (0, 1]")
  for name, value in (("hbm_gbps", hbm_gbps), ("link_gbps", link_gbps)):
    if value is not None and value <= 0:
      raise UserInputError(f"--{name}={value}; expected a positive GB/s")
  hbm = link = None
  if device in DEVICES:
    gib, peak, hbm, link = DEVICES[device]
  else:
    try:
      gib, peak = float(device), None
    except ValueError:
      raise UserInputError(f"--device={device!r}; expected one of {list(DEVICES)} or a number "
                           "of GiB") from None
    if gib <= 0:
      raise UserInputError(f"--device={device!r}; expected a positive number of GiB")
  peak = peak_tflops if peak_tflops is not None else peak
  if peak is None or peak <= 0:
    raise UserInputError(f"--peak_tflops={peak_tflops}; expected a positive TFLOP/s (needed with "
                         f"--device={device})")
  hbm = hbm_gbps if hbm_gbps is not None else hbm
  link = link_gbps if link_gbps is not None else link
  return Target(device, int(gib * GIB), peak * 1e12, mfu, None if hbm is None else hbm * 1e9,
                None if link is None else link * 1e9)


def parse_mesh(text: str) -> tuple[int, int, int]:
  try:
    sizes = tuple(int(s) for s in text.split(","))
  except ValueError:
    sizes = ()
  if len(sizes) != 3:
    raise UserInputError(f"--mesh={text!r}; expected three comma-separated ints data,fsdp,tensor")
  return sizes  # type: ignore[return-value]


def use_fake_devices(n: int) -> None:
  """N fake CPU devices. XLA reads the flag when jax first initialises its backend, so this must
  run before any jax computation or device query (importing jax is fine)."""
  if n < 1:
    raise UserInputError(f"--devices={n}; expected an int >= 1")
  flag = f"--xla_force_host_platform_device_count={n}"
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(kept + [flag])
  os.environ["JAX_PLATFORMS"] = "cpu"


# ------------------------------------------------------------------------------ FLOPs


def matmul_flops(jaxpr: Any) -> int:
  """Matmul FLOPs of a (closed) jaxpr: 2 x output size x contracted size per dot_general; a scan
  counts its body `length` times, a cond its costliest branch, a while loop its body once (trip
  counts are unknown; the programs planned here have none on their hot path)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
      continue
    subs = [v for v in eqn.params.values() if _is_jaxpr(v)]
    subs += [j for v in eqn.params.values() if isinstance(v, (tuple, list))
             for j in v if _is_jaxpr(j)]
    if eqn.primitive.name == "cond":
      total += max(matmul_flops(j) for j in subs)
    else:
      inner = sum(matmul_flops(j) for j in subs)
      total += inner * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
  return total


def _is_jaxpr(x: Any) -> bool:
  return isinstance(x, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))


# ------------------------------------------------------------------------------ programs


def model_config(name: str, param_dtype: str, compute_dtype: str) -> ModelConfig:
  """The architecture of model `name` (a preset or an HF checkpoint directory), its params
  stored in `param_dtype` and computing in `compute_dtype`."""
  if name in PRESETS:
    config = PRESETS.get(name)
  elif os.path.isfile(os.path.join(name, "config.json")):
    with open(os.path.join(name, "config.json")) as f:
      config = hf.config_from_hf(json.load(f))
  else:
    raise UserInputError(f"model {name!r}: plan needs an architecture preset {sorted(PRESETS)} "
                         "or an HF checkpoint directory with a config.json")
  return config.replace(param_dtype=param_dtype, compute_dtype=compute_dtype)


def compute_dtype(c: ml_collections.ConfigDict) -> str:
  """The config's compute dtype on the planned accelerator ("auto": bf16)."""
  return precision.compute_dtype(c.compute_dtype, backend="accelerator")


def policy_config(c: ml_collections.ConfigDict, built: config_lib.Built) -> policies.PolicyConfig:
  """The team's PolicyConfig as `setup_lib.load_team` builds it on the planned accelerator, from
  architectures only."""
  return setup_lib.policy_config(c, built, [model_config(n, c.param_dtype, compute_dtype(c))
                                          for n in setup_lib.team_names(c, built.spec)[0]])


@dataclasses.dataclass(frozen=True)
class _Generation:
  prompt_ids: list[int]
  token_ids: list[int]
  logprobs: list[float]


@dataclasses.dataclass(frozen=True)
class _Sample:
  """A stand-in rollout sample with the config's shapes (`batch.RolloutSample`)."""
  problem_id: int
  traj_id: int
  turn: int
  agent_id: int
  policy_id: int
  generation: _Generation
  state: int = 0
  reward: float = 0.0
  team_reward: float = 0.0
  trained: bool = True


def rollout_samples(c: ml_collections.ConfigDict, built: config_lib.Built, prompt_tokens: int
                    ) -> list[_Sample]:
  """One step's samples at their most: every episode runs `max_turns` turns, every agent acts in
  each (tree: K replies per (problem, turn, agent); independent: K trajectories; magrpo_tree:
  K^t joint actions at turn t), with `prompt_tokens` + `max_new_tokens` tokens each. Prompts
  are shared as the rollout shares them (train.share_prompts counts them): the K replies of a
  tree node or of a MAGRPO node's joint actions, and the K trajectories' first turn."""
  spec, k, turns = built.spec, c.rollout.k, built.spec.max_turns
  budget = {a: config_lib.agent_sampling(c, a, "max_new_tokens") for a in spec.agents}
  trajs, _ = batch_lib.id_layout(c.rollout.mode, k, turns)
  per_turn = {"tree": lambda t: k, "independent": lambda t: k,
              "magrpo_tree": lambda t: k ** (t + 1)}[c.rollout.mode]
  shared = {"tree": lambda t, j: 0, "independent": lambda t, j: 0 if t == 0 else j,
            "magrpo_tree": lambda t, j: j // k}[c.rollout.mode]  # j's prompt among turn t's
  out, prompt_ids = [], {}
  for problem in range(c.rollout.problems_per_step):
    for turn in range(turns):
      for j in range(per_turn(turn)):
        for a, agent in enumerate(spec.agents):
          first = prompt_ids.setdefault((problem, turn, shared(turn, j), a), len(prompt_ids))
          new = budget[agent]  # the agent's own (`sampling.per_agent`)
          gen = _Generation([first] + [0] * (prompt_tokens - 1), [0] * new, [0.0] * new)
          out.append(_Sample(problem, problem * trajs + j % trajs, turn, a,
                             spec.policy_id(agent), gen))
  return out


def sampler_call(c: ml_collections.ConfigDict, turns: int, prompt_tokens: int,
                 buckets: Buckets = Buckets()) -> tuple[int, int, int, int]:
  """(prompt entries U, rows per entry R, prompt width, new-token slots) of the largest
  `generate` call (one agent's wave), laid out and padded as `Sampler` does it."""
  n, k = c.rollout.problems_per_step, c.rollout.k
  unique, per_prompt = {"tree": (n, k), "independent": (n * k, 1),
                        "magrpo_tree": (n * k ** (turns - 1), k)}[c.rollout.mode]
  return (*prompt_layout([per_prompt] * unique, buckets.row_multiple),
          round_up(prompt_tokens, buckets.prompt_block),
          round_up(setup_lib.largest_budget(c), buckets.new_token_multiple))


def _abstract(tree: Any, mesh: jax.sharding.Mesh, specs: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, sharding.named(mesh, specs))


def abstract_params(policy: policies.PolicyConfig, mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
  """(trainable, frozen) as ShapeDtypeStructs with their FSDP shardings; nothing allocated."""
  trainable, frozen = jax.eval_shape(lambda key: policies.init_params(policy, key),
                                     jax.random.key(0))
  specs = []  # computed on tracers: layouts index the leaves (a stacked team's x[0])

  def capture(trainable, frozen):
    specs.append(policies.param_specs(policy, trainable, frozen, mesh.shape[mesh_lib.FSDP]))
    return 0

  jax.eval_shape(capture, trainable, frozen)
  return _abstract(trainable, mesh, specs[0][0]), _abstract(frozen, mesh, specs[0][1])


def analyse(fn: Any, *args: Any, donate: tuple[int, ...] = ()) -> dict[str, Any]:
  """Per-device memory (XLA's memory_analysis) and FLOPs of `fn` compiled for `args`."""
  jitted = jax.jit(fn, donate_argnums=donate)
  flops = matmul_flops(jitted.trace(*args).jaxpr)
  compiled = jitted.lower(*args).compile()
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return dict(argument_bytes=int(m.argument_size_in_bytes),
              output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes),
              temp_bytes=int(m.temp_size_in_bytes),
              code_bytes=int(m.generated_code_size_in_bytes), peak_bytes=peak_bytes(m),
              flops=int(flops), xla_flops=float(cost.get("flops", 0.0)))


def peak_bytes(m: Any) -> int:
  """A compiled program's peak per device from XLA's memory analysis: arguments + outputs -
  aliased (donated) + temporaries + code."""
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes + m.generated_code_size_in_bytes)


def device_bytes(tree: Any) -> int:
  """Bytes one device holds of an abstract (or concrete) sharded tree."""
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def copy_bytes(tree: Any, dtype: str, *, head: bool, cast_only: bool = False) -> int:
  """Bytes one device holds of `precision.compute_copy(tree, dtype, head=head)` for an abstract
  sharded tree: every leaf, or with `cast_only` only the leaves it casts (new buffers)."""
  copy = jax.eval_shape(functools.partial(precision.compute_copy, dtype=dtype, head=head), tree)
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(y.dtype).itemsize
             for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(copy))
             if not cast_only or x.dtype != y.dtype)


@dataclasses.dataclass(frozen=True)
class Setup:
  """What the trainer would build for a config, from architectures only."""
  built: config_lib.Built
  mesh: jax.sharding.Mesh
  policy: policies.PolicyConfig
  shape: BatchShape
  train: TrainConfig
  samples: list[_Sample]


def setup(c: ml_collections.ConfigDict, mesh_sizes: tuple[int, int, int],
          prompt_tokens: int, devices: list[jax.Device] | None = None) -> Setup:
  """The checked config's team, mesh over `devices` (default: all), batch shape, TrainConfig
  and stand-in samples; bad values raise UserInputError."""
  if prompt_tokens < 1:
    raise UserInputError(f"--prompt_tokens={prompt_tokens}; expected an int >= 1")
  devices = jax.devices() if devices is None else devices
  try:
    built = config_lib.build(c)
    sizes = config_lib.mesh_shape(tuple(mesh_sizes), len(devices))
    preflight.check_mini_batch(c, sizes)
    mesh = mesh_lib.make_mesh(*sizes, devices=devices)
    policy = policy_config(c, built)
  except UserInputError:
    raise
  except ValueError as e:
    raise UserInputError(str(e)) from None
  shape = setup_lib.batch_shape(c, built.spec, mesh_lib.batch_shards(mesh) * c.train.micro_batches)
  return Setup(built, mesh, policy, shape, setup_lib.train_config(c, built, policy, shape),
               rollout_samples(c, built, prompt_tokens))


def update_samples(s: Setup, mini_batch_size: int | None) -> tuple[list[_Sample], int]:
  """(the samples of one optimizer update, updates per epoch): the whole rollout, or with PPO
  mini-batches the first `mini_batch_size` samples of each policy block and as many updates as
  the fullest block needs (`parallel/update.plan`; every sample counted as kept)."""
  if mini_batch_size is None:
    return s.samples, 1
  blocks = layouts.of(s.policy).blocks(s.policy, s.samples)
  return ([x for b in blocks for x in b[:mini_batch_size]],
          -(-max(len(b) for b in blocks) // mini_batch_size))


def abstract_batch(s: Setup, share_prompts: bool, samples: list[_Sample] | None = None) -> Any:
  """The step's TrainBatch of `samples` (default: the stand-in rollout), abstract, sharded over
  the sample axis (with the trainer's distinct-prompt bound when the config shares prompts)."""
  samples = s.samples if samples is None else samples
  sizes = layouts.batch_sizes(s.policy, samples, s.shape)
  prompts = layouts.prompt_bound(s.policy, samples, sizes[0]) if share_prompts else None
  batch = layouts.build_batch(s.policy, samples, s.shape, [0] * len(s.policy.models), sizes,
                              prompts)
  spec = layouts.batch_spec(s.policy, mesh_lib.BATCH_AXES)
  return _abstract(batch, s.mesh, jax.tree.map(lambda _: spec, batch))


def abstract_targets(s: Setup, fns: TrainFns, batch: Any) -> Any:
  """The `RolloutTargets` of an abstract batch (`fns.prepare`'s), sharded like the batch."""
  targets = jax.eval_shape(fns.prepare, batch)[1]
  spec = layouts.batch_spec(s.policy, mesh_lib.BATCH_AXES)
  return _abstract(targets, s.mesh, jax.tree.map(lambda _: spec, targets))


def plan(c: ml_collections.ConfigDict, mesh_sizes: tuple[int, int, int], target: Target, *,
         prompt_tokens: int) -> dict[str, Any]:
  """The report (module docstring) of config `c` on a (data, fsdp, tensor) mesh of the current
  devices, or with `train.rollout_devices` R > 0 of the learner on the first N - R devices and
  the rollout on the last R (`schedule`). Bad config values raise UserInputError."""
  rollout_devices = c.train.rollout_devices
  learner, rollout = config_lib.split_devices(rollout_devices, jax.devices())
  if rollout_devices and target.link_bytes_per_s is None:
    raise UserInputError(f"config.train.rollout_devices={rollout_devices} needs the link speed "
                         f"of --device={target.name}; expected --link_gbps (device-to-device "
                         "GB/s one way)")
  s = setup(c, mesh_sizes, prompt_tokens, learner)
  mesh, policy, cfg, samples = s.mesh, s.policy, s.train, s.samples
  update, updates = update_samples(s, c.train.mini_batch_size)
  batch = abstract_batch(s, c.train.share_prompts, update)
  trainable, frozen = abstract_params(policy, mesh)
  fns = make_train_step(cfg, mesh)
  state = abstract_state(fns, trainable, mesh)
  train = analyse(fns.update, state, frozen, batch, abstract_targets(s, fns, batch), donate=(0,))
  train["flops"] *= updates * c.train.epochs  # every update of every PPO epoch
  reference = 0  # a KL reference of full models: a frozen compute copy of the policy params
  if c.loss.kl_coef != 0.0 and not layouts.of(policy).adapters:
    reference = copy_bytes(state.params["policy"], policy.compute_dtype, head=False)
  train["peak_bytes"] += reference
  # During a rollout the sampler reads a compute copy of the trainable params and of the frozen
  # base's head (`policies.sampler_copy`), beside the whole train state; on rollout devices of
  # its own, the copy alone (every leaf a new buffer there), FSDP-sharded over them.
  rollout_mesh, handoff = mesh, 0
  if rollout_devices:
    rollout_mesh = mesh_lib.make_mesh(1, rollout_devices, 1, devices=rollout)
    r_trainable, r_frozen = abstract_params(policy, rollout_mesh)
    received = copy_bytes(r_trainable, policy.compute_dtype, head=True)
    resident = received + copy_bytes(r_frozen, policy.compute_dtype, head=True)
    # Each version's trainable copy leaves each learner device and reaches each rollout device.
    handoff = max(copy_bytes(state.params, policy.compute_dtype, head=True), received)
  else:
    sampler_copy = sum(copy_bytes(t, policy.compute_dtype, head=True, cast_only=True)
                       for t in (state.params, frozen))
    resident = device_bytes(state) + device_bytes(frozen) + reference + sampler_copy
  programs = {"train_step": train}
  programs.update(sampler_programs(c, policy.models[0], rollout_mesh, s.built.spec.max_turns,
                                   prompt_tokens, resident))
  engine = None
  if c.rollout.engine == "continuous":  # its decode replaces the static sampler's
    engine = engine_program(c, s.built, policy.models[0], rollout_mesh, prompt_tokens, resident)
    programs["decode"] = engine.pop("decode")
  for p in programs.values():
    p["seconds"] = p["flops"] / (target.mfu * target.peak_flops)
  decode = programs["decode"]
  decode["hbm_seconds"] = None
  if target.hbm_bytes_per_s is not None:  # each step reads its weights and K/V once
    decode["hbm_seconds"] = decode["steps"] * decode["bytes_per_step"] / target.hbm_bytes_per_s
    decode["seconds"] = max(decode["seconds"], decode["hbm_seconds"])
  needed = max(p["peak_bytes"] for p in programs.values())
  return dict(
      config=c.name, model=c.model, param_dtype=c.param_dtype, compute_dtype=compute_dtype(c),
      policy=c.policy.kind,
      mesh=dict(mesh.shape), devices=jax.device_count(), device=target.name,
      rollout_mesh=dict(rollout_mesh.shape) if rollout_devices else None,
      device_bytes=target.memory_bytes, mfu=target.mfu, peak_tflops=target.peak_flops / 1e12,
      train_batch=dict(samples=len(samples), response=list(batch_leaf(batch, "response").shape),
                       prompt=list(batch_leaf(batch, "prompt").shape)),
      params_bytes=device_bytes(state.params), opt_state_bytes=device_bytes(state.opt_state),
      frozen_bytes=device_bytes(frozen), reference_bytes=reference, programs=programs,
      engine=engine, schedule=schedule(programs, rollout_calls(samples, programs), handoff,
                                       rollout_devices > 0, target),
      needed_bytes=needed, fits=needed <= target.memory_bytes)


def rollout_calls(samples: list[_Sample], programs: dict[str, Any]) -> int:
  """Prefill + decode calls of one rollout: each agent's wave of a turn (its replies wait for the
  previous wave's) in calls of the decode program's rows."""
  rows = programs["decode"]["shape"]["rows"]
  waves = collections.Counter((x.turn, x.agent_id) for x in samples)
  return sum(-(-n // rows) for n in waves.values())


def schedule(programs: dict[str, Any], calls: int, handoff_bytes: int, split: bool,
             target: Target) -> dict[str, Any]:
  """Seconds per RL step, synchronous and asynchronous (`train.max_staleness` >= 1); a rollout
  is `calls` x (prefill + decode).

  On one device set the rollout's and the update's device work take turns either way (the
  asynchronous gain there is host-side work, env and sandbox time, which this plan does not
  model), so both are rollout + update. On split sets the two overlap: a step takes the slower
  of the two, plus the hand-off of each version's weights (per device: the larger of a learner's
  and a rollout device's share of the trainable compute copy, over the one-way link), counted on
  the step's path; synchronously on the same split they run one after the other."""
  rollout = calls * (programs["prefill"]["seconds"] + programs["decode"]["seconds"])
  train = programs["train_step"]["seconds"]
  out = dict(rollout_calls=calls, rollout_seconds=rollout, train_seconds=train,
             handoff_bytes=handoff_bytes,
             handoff_seconds=0.0, synchronous_seconds=rollout + train,
             asynchronous_seconds=rollout + train)
  if split:
    out["handoff_seconds"] = handoff_bytes / target.link_bytes_per_s
    out["synchronous_seconds"] += out["handoff_seconds"]
    out["asynchronous_seconds"] = max(rollout, train) + out["handoff_seconds"]
  return out


def batch_leaf(batch: Any, field: str) -> Any:
  """`field` of the batch's first block (any layout: flat, stacked or a dict of blocks)."""
  return jax.tree.leaves(jax.tree.map(lambda b: getattr(b, field), batch,
                                      is_leaf=lambda x: hasattr(x, field)))[0]


def abstract_state(fns: TrainFns, trainable: Any, mesh: jax.sharding.Mesh) -> Any:
  """The TrainState the trainer's `init` makes, abstract, with the shardings `init` gives it
  (`TrainFns.state_specs`, computed on tracers: layouts index the leaves)."""
  specs = []

  def init(t):
    specs.append(fns.state_specs(t))
    return fns.init(t)

  shapes = jax.eval_shape(init, trainable)
  return _abstract(shapes, mesh, specs[0])


def sampler_programs(c: ml_collections.ConfigDict, config: ModelConfig, mesh: jax.sharding.Mesh,
                     turns: int, prompt_tokens: int, resident: int) -> dict[str, Any]:
  """Prefill and decode of the largest `generate` call on the FSDP-sharded params of `config`.

  "prefill" is the prompts' forward alone; "decode" has the memory of the whole call (the
  sampler's own `generate_tokens` program: prefill, then the decode loops) and the FLOPs of one
  decode step over the largest span x `max_new_tokens`. Peaks count the whole train state
  (`resident` bytes) instead of their param arguments."""
  unique, per_prompt, width, slots = sampler_call(c, turns, prompt_tokens)
  rows = unique * per_prompt
  params = jax.eval_shape(  # the sampler's compute copy (`policies.sampler_copy`)
      lambda key: precision.compute_copy(decoder.init_params(config, key), config.compute_dtype,
                                         head=True), jax.random.key(0))
  params = _abstract(params, mesh, sharding.model_specs(params, mesh.shape[mesh_lib.FSDP]))
  param_bytes = device_bytes(params)  # counted in `resident` (as the params or their copy)
  ints = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  prompt, mask = ints(unique, width), jax.ShapeDtypeStruct((unique, width), jnp.bool_)

  def prefill(params, prompt, mask):  # prompt, mask: [U, Tp]
    hidden, cache = decoder.hidden_states(params, prompt, decoder.positions_from_mask(mask),
                                          config, attn_mask=mask, fill_cache=True)
    return decoder.lm_logits(params, hidden[:, -1], config), cache

  def decode_step(params, tokens, positions, cache):  # tokens, positions: [B, 1]
    hidden, cache = decoder.hidden_states(params, tokens, positions, config, cache=cache)
    return decoder.lm_logits(params, hidden[:, 0], config), cache

  sampling = setup_lib.sampling_params(c, c.sampling.temperature, c.sampling.top_p)
  sampler = Sampler(config)  # its defaults (LLMPolicy's): buckets, decode blocks, top candidates
  generate = functools.partial(
      generate_tokens, config=config, pad_id=sampler.pad_id, block=sampler.decode_block,
      candidates=sampler.top_candidates, new_slots=slots, modes=frozenset({sampling.mode}))
  decode = analyse(generate, params, prompt, mask, ints(unique, per_prompt), row_keys(rows),
                   row_knobs(rows), ints(sampler.buckets.min_stop_ids), ints())
  cache = jax.eval_shape(lambda: decoder.init_cache(config, rows, width + slots))
  decode["flops"] = setup_lib.largest_budget(c) * matmul_flops(
      jax.jit(decode_step).trace(params, ints(rows, 1), ints(rows, 1), cache).jaxpr)
  decode["xla_flops"] = None  # loops: XLA counts each body once
  decode["steps"] = setup_lib.largest_budget(c)
  decode["bytes_per_step"] = hbm_bytes_per_step(params, tree_bytes(cache), mesh)
  out = {"prefill": analyse(prefill, params, prompt, mask), "decode": decode}
  for p in out.values():
    p["peak_bytes"] += resident - param_bytes
    p["resident_bytes"] = resident
    # Traced at global shapes: the whole call's FLOPs, spread over the mesh at best.
    p["flops_total"] = p["flops"]
    p["flops"] = p["flops"] // mesh.size
  out["prefill"]["shape"] = dict(prompts=unique, width=width)
  out["decode"]["shape"] = dict(rows=rows, cache=width + slots, steps=setup_lib.largest_budget(c))
  return out


def tree_bytes(tree: Any) -> int:
  """Bytes of a whole (abstract) tree, over every device."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def hbm_bytes_per_step(params: Any, kv_bytes: int, mesh: jax.sharding.Mesh) -> int:
  """HBM bytes a device reads in one decode step, at least: every weight (each device computes
  its rows with the whole model, gathered from the FSDP shards) and its share of the rows' K/V
  at their longest, the rows spread over the mesh at best as the FLOPs are. The all-gathers
  themselves are not counted: a lower bound."""
  return tree_bytes(params) + kv_bytes // mesh.size


def row_keys(n: int) -> Any:
  """Abstract [n] typed PRNG keys."""
  return jax.eval_shape(lambda: jax.random.split(jax.random.key(0), n))


def row_knobs(n: int) -> Knobs:
  """Abstract per-row sampling knobs of n rows."""
  return Knobs(temperature=jax.ShapeDtypeStruct((n,), jnp.float32),
               top_k=jax.ShapeDtypeStruct((n,), jnp.int32),
               top_p=jax.ShapeDtypeStruct((n,), jnp.float32),
               mode=jax.ShapeDtypeStruct((n,), jnp.int32))


def engine_program(c: ml_collections.ConfigDict, built: config_lib.Built, config: ModelConfig,
                   mesh: jax.sharding.Mesh, prompt_tokens: int, resident: int) -> dict[str, Any]:
  """The continuous engine (`config.engine`) at paper scale: its K/V pool against the static
  sampler's dense cache, and one decode call over every slot.

  The pool holds `engine.pool_tokens` (or `pool_gib`) of K/V, replicated on each device of the
  mesh (the engine does not shard it this round). "needed" is what every slot at its longest
  (`--prompt_tokens` + the largest budget) would hold, the static sampler's cache is its largest
  call's (rows x (padded prompt + new-token slots), prompts shared across a call's rows), and
  "decode" is one call of `engine.decode_steps` steps over `engine.slots` rows: its memory
  (the pool donated) and the FLOPs of a request's whole budget of steps."""
  o = built.engine
  per_token = paged_runner.bytes_per_token(config)
  budget = setup_lib.largest_budget(c)
  tokens = o.pool_tokens if o.pool_gib == 0 else int(o.pool_gib * GIB) // per_token
  pages = tokens // o.page_size + 1
  unique, per_prompt, width, slots = sampler_call(c, built.spec.max_turns, prompt_tokens)
  B, P = bucket(o.slots, 1), bucket(math.ceil((prompt_tokens + budget - 1) / o.page_size), 1)
  params = jax.eval_shape(
      lambda key: precision.compute_copy(decoder.init_params(config, key), config.compute_dtype,
                                         head=True), jax.random.key(0))
  params = _abstract(params, mesh, sharding.model_specs(params, mesh.shape[mesh_lib.FSDP]))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  pool = jax.ShapeDtypeStruct((config.num_key_value_heads, config.num_hidden_layers * pages,
                               o.page_size, config.head_dim), config.compute_dtype,
                              sharding=replicated)
  ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  sampling = setup_lib.sampling_params(c, c.sampling.temperature, c.sampling.top_p)
  step = functools.partial(paged_runner.decode, config=config, attend=paged_attention.gather,
                           modes=frozenset({sampling.mode}), candidates=o.top_candidates)
  args = (params, pool, pool, ints(B), ints(B), ints(B), ints(B), ints(B, 4),
          jax.ShapeDtypeStruct((B,), jnp.bool_), ints(B, P), row_keys(B), row_knobs(B), ints(B),
          None)
  decode = analyse(functools.partial(step, steps=o.decode_steps), *args, donate=(1, 2))
  decode["flops"] = budget * matmul_flops(
      jax.jit(functools.partial(step, steps=1)).trace(*args).jaxpr) // mesh.size
  decode["xla_flops"] = None  # a while loop: XLA counts its body once
  decode["steps"] = budget
  decode["bytes_per_step"] = hbm_bytes_per_step(
      params, o.slots * (prompt_tokens + budget) * per_token, mesh)
  decode["peak_bytes"] += resident - device_bytes(params)
  decode["resident_bytes"] = resident
  decode["shape"] = dict(rows=B, table_pages=P, steps_per_call=o.decode_steps)
  return dict(
      bytes_per_token=per_token, page_size=o.page_size, slots=o.slots, pool_tokens=tokens,
      pool_bytes=pages * o.page_size * per_token,
      needed_bytes=o.slots * (prompt_tokens + budget) * per_token,
      static_cache_bytes=(unique * width + unique * per_prompt * slots) * per_token,
      decode=decode)


def no_fit_line(report: dict[str, Any]) -> str:
  return (f"config {report['config']!r} needs {report['needed_bytes'] / GIB:.3g} GiB per device "
          f"on mesh {report['mesh']}; the {report['device']} limit is "
          f"{report['device_bytes'] / GIB:.3g} GiB (more fsdp devices, remat, micro_batches or "
          "a smaller batch would lower it)")


def table(report: dict[str, Any]) -> str:
  """A short human summary of the report."""
  lines = [f"{report['config']} ({report['model']}, {report['param_dtype']} params, "
           f"{report['compute_dtype']} compute, {report['policy']}) on "
           f"{report['devices']} x {report['device']} mesh {report['mesh']}",
           f"{'program':<11} {'peak GiB':>9} {'temp GiB':>9} {'TFLOP':>10} {'seconds':>8}"]
  for name, p in report["programs"].items():
    lines.append(f"{name:<11} {p['peak_bytes'] / GIB:>9.2f} {p['temp_bytes'] / GIB:>9.2f} "
                 f"{p['flops'] / 1e12:>10.3g} {p['seconds']:>8.3g}")
  e = report["engine"]
  if e is not None:
    lines.append(f"engine: {e['slots']} slots, K/V {e['bytes_per_token'] / 1024:.0f} KiB/token; "
                 f"pool {e['pool_bytes'] / GIB:.2f} GiB ({e['pool_tokens']} tokens), every slot "
                 f"at its longest {e['needed_bytes'] / GIB:.2f} GiB, the static sampler's cache "
                 f"{e['static_cache_bytes'] / GIB:.2f} GiB")
  t = report["schedule"]
  where = (f"learner mesh {report['mesh']}, rollout mesh {report['rollout_mesh']}"
           if report["rollout_mesh"] else "one device set")
  lines.append(f"step ({where}): synchronous {t['synchronous_seconds']:.3g} s, asynchronous "
               f"{t['asynchronous_seconds']:.3g} s (rollout {t['rollout_seconds']:.3g}, update "
               f"{t['train_seconds']:.3g}, hand-off {t['handoff_seconds']:.3g})")
  lines.append(f"params {report['params_bytes'] / GIB:.2f} GiB, optimizer "
               f"{report['opt_state_bytes'] / GIB:.2f} GiB, frozen "
               f"{report['frozen_bytes'] / GIB:.2f} GiB per device; fits "
               f"{report['device_bytes'] / GIB:.0f} GiB: {report['fits']}")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  use_fake_devices(_DEVICES.value)
  if jax.device_count() != _DEVICES.value:
    raise UserInputError(f"--devices={_DEVICES.value} but jax already runs on "
                         f"{jax.device_count()} devices; run plan in a fresh process")
  target = parse_target(_DEVICE.value, _PEAK.value, _MFU.value, _HBM.value, _LINK.value)
  c = _CONFIG.value
  mesh = parse_mesh(_MESH.value) if _MESH.value else tuple(c.train.mesh)
  report = out = plan(c, mesh, target, prompt_tokens=_PROMPT.value)
  if c.train.rollout_devices:  # beside the one device set, planned in the same process
    shared = copy.deepcopy(c)
    shared.train.rollout_devices = 0
    together = plan(shared, mesh, target, prompt_tokens=_PROMPT.value)
    out = dict(synchronous=together, asynchronous=report,
               predicted_speedup=(together["schedule"]["synchronous_seconds"]
                                  / report["schedule"]["asynchronous_seconds"]))
    print(table(together), file=sys.stderr)
  print(json.dumps(out, indent=1))
  print(table(report), file=sys.stderr)
  if c.train.rollout_devices:
    print(f"predicted asynchronous speedup: {out['predicted_speedup']:.3g}x", file=sys.stderr)
  if not report["fits"]:
    raise UserInputError(no_fit_line(report))


if __name__ == "__main__":
  cli.run(main)
