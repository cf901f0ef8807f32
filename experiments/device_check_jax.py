"""The JAX part of `experiments.device_check` (run in its own process): versions, the train step,
sampling and numerics, each printed as a `RESULT` line when it is done."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import plan
from experiments.device_check import (LR, batch_arrays, emit, host_rss_bytes, model_flops, peaks,
                                      useful_tokens)
from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.batch import GroupSpace, TrainBatch, make_batch
from marl_jax.algos.losses import LossConfig
from marl_jax.algos.optim import OptimConfig
from marl_jax.models import decoder, precision
from marl_jax.models.config import ModelConfig, get_preset
from marl_jax.parallel import policies, update
from marl_jax.parallel.mesh import make_mesh
from marl_jax.parallel.train_config import TrainConfig, TrainSettings
from marl_jax.parallel.train_step import make_train_step
from marl_jax.sampling.params import SamplingParams
from marl_jax.sampling.sampler import Sampler
from marl_jax.shapes import bucket


def _fns(config: ModelConfig, b: dict[str, np.ndarray], group: int, **train):
  """The trainer's step for a shared policy of `config` on one device, and its batch."""
  pcfg = policies.PolicyConfig(kind="shared", models=(config,), optim=(OptimConfig(lr=LR),))
  space = GroupSpace(num_problems=int(b["problem_id"].max()) + 1, num_agents=1)
  cfg = TrainConfig(policy=pcfg, advantage=AdvantageConfig("grpo"), loss=LossConfig(),
                    space=space, with_entropy=False, train=TrainSettings(**train))
  fns = make_train_step(cfg, make_mesh(devices=jax.devices()[:1]))
  n = len(b["rewards"])
  samples = make_batch(b["rewards"], problem_id=b["problem_id"], agent_id=np.zeros(n, np.int32),
                       policy_id=np.zeros(n, np.int32), token_mask=b["token_mask"])
  batch = TrainBatch(prompt=b["prompt"], prompt_mask=b["prompt_mask"], response=b["response"],
                     old_logp=b["old_logp"], samples=samples, num_prompts=n // group)
  return cfg, fns, fns.shard_batch(batch)


def _params(config: ModelConfig, seed: int = 0):
  """Random params of `config`, made on the device (a 1.7B model never passes through host)."""
  return jax.jit(lambda key: decoder.init_params(config, key))(jax.random.key(seed))


def _peak_device_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()
  return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def info() -> dict[str, Any]:
  import flax
  import jaxlib
  import optax
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
          "optax": optax.__version__, "backend": jax.default_backend(),
          "devices": [d.device_kind for d in jax.devices()],
          "compute_dtype_auto": precision.compute_dtype("auto")}


def train_step(args: argparse.Namespace, config: ModelConfig) -> dict[str, Any]:
  b = batch_arrays(config.vocab_size, args.rows, args.group, args.prompt, args.response)
  _, fns, batch = _fns(config, b, args.group, remat=True, logits_chunk=128)
  state = fns.init({"policy": _params(config)})
  fns.check(batch)
  batch, targets, _ = fns.prepare(batch)  # one update of the whole rollout (`update.run`)
  compiled = jax.jit(fns.update, donate_argnums=(0,)).lower(state, {}, batch, targets).compile()
  executed = plan.matmul_flops(jax.jit(fns.update).trace(state, {}, batch, targets).jaxpr)
  times = []
  for _ in range(args.steps + 1):
    start = time.perf_counter()
    state, metrics = compiled(state, {}, batch, targets)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times[1:])
  peak_flops, _ = peaks(jax.devices()[0].device_kind)
  flops = model_flops(config, b, args.group)
  peak = _peak_device_bytes()
  return {"compute_dtype": config.compute_dtype, "param_dtype": config.param_dtype,
          "first_step_s": times[0], "step_s": step_s, "steps_s": times[1:],
          "useful_tokens_per_s": useful_tokens(b, args.group) / step_s,
          "model_flops_per_s": flops / step_s, "executed_flops_per_s": executed / step_s,
          "mfu": None if peak_flops is None else flops / step_s / peak_flops,
          "peak_bytes": peak, "peak_host_rss_bytes": host_rss_bytes(),
          "estimated_peak_bytes": plan.peak_bytes(compiled.memory_analysis()),
          "loss": float(metrics["loss"])}


def sampling(args: argparse.Namespace, config: ModelConfig) -> dict[str, Any]:
  """RL-shaped generation: each prompt `group` times, top-p 0.9, exactly --new_tokens tokens."""
  b = batch_arrays(config.vocab_size, args.rows, args.group, args.prompt, 2)
  prompts = [row[mask].tolist() for row, mask in zip(b["prompt"], b["prompt_mask"])]
  params = policies.sampler_copy(policies.PolicyConfig(models=(config,)), _params(config))
  sampler = Sampler(config)
  sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=0.9,
                      stop_token_ids=())
  times = []
  for i in range(3):  # the first compiles
    start = time.perf_counter()
    out = sampler.generate(params, prompts, sp, jax.random.key(i))
    times.append(time.perf_counter() - start)
  seconds = min(times[1:])
  new = sum(len(c.tokens) for c in out)
  _, bandwidth = peaks(jax.devices()[0].device_kind)
  weights = sum(x.nbytes for x in jax.tree.leaves(params))
  span = args.prompt + args.new_tokens / 2  # the average cache span of a decode step
  kv = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        * jnp.dtype(config.compute_dtype).itemsize * span * len(prompts) / args.group)
  return {"first_call_s": times[0], "call_s": seconds, "new_tokens": new,
          "new_tokens_per_s": new / seconds, "ms_per_decode_step": 1e3 * seconds / args.new_tokens,
          "hbm_bound_ms_per_step": None if bandwidth is None else 1e3 * (weights + kv) / bandwidth}


def engine(args: argparse.Namespace, config: ModelConfig) -> dict[str, Any]:
  """The continuous rollout engine's decode at each of --engine_slots slots: `slots` requests of
  --prompt random tokens, --new_tokens each (no stop token), top-p 0.9; decode tokens/s over the
  decode calls alone (prefill excluded) and the % of the HBM-read bound: per decode step the
  weights once plus every live row's keys/values, at the device's bandwidth."""
  from marl_jax.sampling.continuous import ContinuousEngine
  from marl_jax.sampling.engine import EngineOptions, EngineRequest, request_key, run_all

  params = policies.sampler_copy(policies.PolicyConfig(models=(config,)), _params(config))
  weights = sum(x.nbytes for x in jax.tree.leaves(params))
  per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
               * jnp.dtype(config.compute_dtype).itemsize)
  _, bandwidth = peaks(jax.devices()[0].device_kind)
  rng = np.random.default_rng(0)
  sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=0.9,
                      stop_token_ids=())
  out = {}
  for slots in (int(n) for n in args.engine_slots.split(",")):
    options = EngineOptions(slots=slots, pool_tokens=slots * (args.prompt + args.new_tokens),
                            prefill_chunk=max(256, bucket(args.prompt, 16)))
    eng = ContinuousEngine(config, options=options)
    eng.load(params)
    requests = [EngineRequest(i, tuple(int(t) for t in rng.integers(1, config.vocab_size,
                                                                    args.prompt)),
                              sp, request_key(jax.random.key(1), i)) for i in range(slots)]
    run_all(eng, requests[:min(slots, 4)])  # compiles the small shapes
    start = time.perf_counter()
    run_all(eng, requests)  # compiles the full batch's decode
    first = time.perf_counter() - start
    before = eng.stats()
    start = time.perf_counter()
    done = run_all(eng, [dataclasses.replace(r, request_id=("timed", i))
                         for i, r in enumerate(requests)])
    wall = time.perf_counter() - start
    stats = {k: v - before.get(k, 0.0) for k, v in eng.stats().items()}
    steps = stats["decode_row_steps"] / bucket(slots, 1)  # decode steps of the full batch
    step_ms = 1e3 * stats["decode_s"] / max(steps, 1)
    span = args.prompt + args.new_tokens / 2  # the average keys a row reads per step
    bound_ms = None if bandwidth is None else 1e3 * (weights + slots * span * per_token) / bandwidth
    out[str(slots)] = {
        "first_run_s": first, "wall_s": wall, "decode_s": stats["decode_s"],
        "prefill_s": stats["prefill_s"], "new_tokens": sum(len(c.tokens) for c in done),
        "decode_tokens_per_s": stats["decode_tokens"] / stats["decode_s"],
        "ms_per_decode_step": step_ms, "hbm_bound_ms_per_step": bound_ms,
        "fraction_of_hbm_bound": None if bound_ms is None else bound_ms / step_ms,
        "programs": eng.stats()["programs"], "pool_bytes": eng.stats()["pool_bytes"],
        "decode_steps_per_call": options.decode_steps}
  return out


def numerics(args: argparse.Namespace, config: ModelConfig) -> dict[str, Any]:
  """bf16 compute against fp32 on one small batch, the weights a lr-1e-6 step moves, and the
  sampler/learner log-prob mismatch under bf16."""
  b = batch_arrays(config.vocab_size, 2, 2, args.numerics_prompt, args.numerics_response, seed=1)
  b["rewards"] = np.arange(4, dtype=np.float32)  # every group has reward variance: a gradient
  out: dict[str, Any] = {}
  results = {}
  for dtype in ("float32", "bfloat16"):
    cfg = config.replace(param_dtype="float32", compute_dtype=dtype)
    train_cfg, fns, batch = _fns(cfg, b, 2)
    params = _params(cfg)
    before = jax.device_get(params)
    state, metrics = update.run(fns, train_cfg, fns.init({"policy": params}), {}, batch,
                                np.random.default_rng(0))
    results[dtype] = (float(metrics["loss"]), float(metrics["grad_norm"]),
                      _moved(before, state.params["policy"]))
  (l32, g32, m32), (l16, g16, m16) = results["float32"], results["bfloat16"]
  out.update(loss_fp32=l32, loss_bf16=l16, loss_rel_diff=abs(l16 - l32) / abs(l32),
             grad_norm_rel_diff=abs(g16 - g32) / g32, moved_fp32_masters=m16,
             moved_fp32_everything=m32)
  stored = config.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
  train_cfg, fns, batch = _fns(stored, b, 2)
  params = _params(stored)
  before = jax.device_get(params)
  state, _ = update.run(fns, train_cfg, fns.init({"policy": params}), {}, batch,
                        np.random.default_rng(0))
  out["moved_bf16_storage"] = _moved(before, state.params["policy"])
  out.update(_sampler_vs_learner(config.replace(param_dtype="float32",
                                                compute_dtype="bfloat16"), args))
  return out


def _moved(before: Any, after: Any) -> float:
  after = jax.device_get(after)
  moved = sum(int(np.sum(np.asarray(a, np.float32) != np.asarray(b, np.float32)))
              for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
  return moved / sum(x.size for x in jax.tree.leaves(before))


def _sampler_vs_learner(config: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
  """Log-probs of sampled tokens: the sampler's (bf16 compute copy, bf16 LM head) against the
  learner's recomputation (fp32 masters cast per use, fp32 LM head)."""
  from marl_jax.algos import logprobs
  params = _params(config, seed=2)
  pcfg = policies.PolicyConfig(models=(config,))
  b = batch_arrays(config.vocab_size, 4, 1, args.numerics_prompt, 2, seed=3)
  prompts = [row[mask].tolist() for row, mask in zip(b["prompt"], b["prompt_mask"])]
  sp = SamplingParams(max_new_tokens=args.numerics_response, temperature=1.0, stop_token_ids=())
  out = Sampler(config).generate(policies.sampler_copy(pcfg, params), prompts, sp,
                                 jax.random.key(0))
  response = np.stack([c.tokens for c in out]).astype(np.int32)
  sampler_logp = np.stack([c.logprobs for c in out])
  hidden = logprobs.response_hidden(params, config, b["prompt"], b["prompt_mask"], response)
  learner, _ = logprobs.token_logprobs_from_hidden(params, config, hidden, response, 1.0, False)
  diff = np.asarray(learner) - sampler_logp
  return {"sampler_learner_abs_logp_mean": float(np.mean(np.abs(diff))),
          "sampler_learner_abs_logp_max": float(np.max(np.abs(diff))),
          "sampler_learner_ratio_dev_mean": float(np.mean(np.abs(np.exp(diff) - 1)))}


def run(args: argparse.Namespace) -> None:
  emit("info", info())
  base = get_preset(args.model)
  config = base.replace(param_dtype="float32", compute_dtype=precision.compute_dtype("auto"))
  emit("train_step", train_step(args, config))
  emit("sampling", sampling(args, config))
  emit("numerics", numerics(args, base))


def run_engine(args: argparse.Namespace) -> None:
  """The engine part (its own process, so a failure or time-out leaves the others' results)."""
  emit("info", info())
  config = get_preset(args.model).replace(param_dtype="float32",
                                          compute_dtype=precision.compute_dtype("auto"))
  emit("engine", engine(args, config))
