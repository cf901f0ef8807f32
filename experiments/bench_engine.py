"""Rollout engines on RL-shaped workloads, as JSON: the static sampler (today's rollout), the
continuous engine, and transformers' `generate` at equal batch, all arms in one run.

    python -m experiments.bench_engine [--workloads=drmas_math,plan_path_tree,code_tester,heavy_tail]
        [--arms=static,continuous,torch] [--rounds=2] [--warm_start]

Workloads (the embedded SmolLM2-135M, fp32, every rollout setting from the config named):
  drmas_math      the main job's rollouts: configs/drmas_math.py:rl,cpu (Dr. MAS solver, then
                  verifier, at most 2 loops; 4 problems x K = 4 independent; 32-token replies at
                  T = 1). With --warm_start the policy first takes the config's 3-step warm-start,
                  as the main job's RL steps do (without it the pretrained model never answers in
                  the protocol, so every episode runs its 4 turns at the budget).
  plan_path_tree  AT-GRPO tree sampling on Plan-Path: configs/atgrpo_plan_path.py:cpu (a tool
                  agent whose program runs in the sandbox, then a plan agent; K branches per
                  (problem, turn, agent) group, 64-token replies).
  code_tester     configs/atgrpo_code.py:cpu with 2 turns: a coder, then a unit-test writer,
                  each env step judging programs in the sandbox; tree sampling.
  heavy_tail      64 single-call requests sampled alike (T = 1, a 256-token budget, the
                  end-of-turn stop token) whose reply lengths are heavy-tailed, as long reasoning
                  produces at scale: 56 ask for a sum's number only, 8 for a long story, and the
                  model's own replies decide the lengths (reported per arm).

Each arm rolls out one warm-up round (compiling its programs) and `--rounds` timed rounds on
fresh problems; figures are the timed rounds' sums. The torch arm serves the rollout's lock-step
waves with `generate` (one call per sampling setting, left-padded, the same GGUF through
transformers' loader, torch threads = cores), so it is "transformers at equal batch".

Figures per arm: episodes/s; useful new tokens/s (tokens the replies hold); prompt tokens
requested vs prefilled (`prefix_hit_rate` = 1 - prefilled / requested; the static sampler
prefills each distinct prompt of a call once); decode occupancy (useful row-steps / row-steps
computed); peak K/V bytes (continuous: pages in use at the peak; static: the largest dense cache
a call held); XLA compilations and their seconds (all of the arm's, warm-up included).
CPU flags and load averages are in the header: compare arms within one run.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import tempfile
import time
from typing import Any

from absl import app, flags

WORKLOADS = {
    "drmas_math": ("drmas_math", "rl,cpu", {}),
    "plan_path_tree": ("atgrpo_plan_path", "cpu", {}),
    "code_tester": ("atgrpo_code", "cpu", {"env.max_turns": 2}),
    "heavy_tail": ("drmas_math", "rl,cpu", {}),
}
_WORKLOADS = flags.DEFINE_list("workloads", list(WORKLOADS), f"Of {list(WORKLOADS)}.")
_ARMS = flags.DEFINE_list("arms", ["static", "continuous", "torch"],
                          "static, continuous (engines by name) and torch (transformers).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Timed rollouts per arm after a warm-up rollout.")
_WARM_START = flags.DEFINE_bool("warm_start", False, "drmas_math: run the config's warm-start "
                                "first (the main job's policy); else the pretrained model.")
_SLOTS = flags.DEFINE_integer("slots", None, "config.engine.slots (default: the config's).")
_STEPS = flags.DEFINE_integer("decode_steps", None, "config.engine.decode_steps.")


def build(name: str):
  """(config, trainer Run) of a workload, the engine options overridden by the flags."""
  from marl_jax.training import trainer

  module, preset, overrides = WORKLOADS[name]
  c = importlib.import_module(f"configs.{module}").get_config(preset)
  for field, value in overrides.items():
    section, key = field.split(".")
    c[section][key] = value
  if _SLOTS.value:
    c.engine.slots = _SLOTS.value
  if _STEPS.value:
    c.engine.decode_steps = _STEPS.value
  c.rollout.allow_unsandboxed = False
  run = trainer.Run(c, tempfile.mkdtemp(prefix=f"bench_engine_{name}_"))
  if name == "drmas_math" and _WARM_START.value:
    run.warm_start()
  return c, run


def heavy_tail_requests(run, round_index: int) -> list[tuple[list[int], Any]]:
  """64 (prompt ids, SamplingParams) of the heavy-tailed mix, every one sampled alike (T = 1,
  a 256-token budget, the tokenizer's end-of-turn stop): 56 ask for a number only, 8 for a long
  story, so the model's own replies are mostly short with a few at the budget."""
  import numpy as np

  from marl_jax.sampling.params import SamplingParams
  from marl_jax.training.llm_policy import prompt_ids

  rng = np.random.default_rng(round_index)
  sampling = SamplingParams(max_new_tokens=256, temperature=1.0)
  out = []
  for i in range(64):
    a, b = (int(x) for x in rng.integers(2, 99, 2))
    text = (f"Write a long, detailed story about a robot who counts to {a * b}." if i % 8 == 7
            else f"What is {a} + {b}? Reply with the number only.")
    out.append((prompt_ids(run.tokenizers[0], [{"role": "user", "content": text}]), sampling))
  return out


def torch_replies(model, tokenizer, prompts: list[list[int]], settings: list) -> list:
  """transformers' `generate` on requests (prompt ids, SamplingParams): one call per distinct
  setting, left-padded; each reply ends at its first stop token; stop strings cut on the host as
  the engines do. Returns engine Completions (log-probs left at 0)."""
  import numpy as np
  import torch

  from marl_jax.sampling import stops

  groups: dict = {}
  for i, sampling in enumerate(settings):
    groups.setdefault(sampling, []).append(i)
  out = [None] * len(prompts)
  for sampling, indices in groups.items():
    rows = [prompts[i] for i in indices]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_id] * (width - len(p)) + list(p) for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    stop_ids = list(sampling.stop_token_ids if sampling.stop_token_ids is not None
                    else tokenizer.stop_token_ids)
    kwargs = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                  top_k=sampling.top_k) if not sampling.greedy else dict(do_sample=False)
    with torch.inference_mode():
      seqs = model.generate(ids, attention_mask=mask, max_new_tokens=sampling.max_new_tokens,
                            pad_token_id=tokenizer.pad_id, eos_token_id=stop_ids or None,
                            **kwargs)
    for i, row in zip(indices, seqs[:, width:].tolist()):
      hits = [n for n, t in enumerate(row) if t in stop_ids]
      n = hits[0] + 1 if hits else len(row)
      out[i] = stops.completion(tokenizer, np.asarray(row[:n], np.int32),
                                np.zeros(n, np.float32), bool(hits), len(prompts[i]),
                                sampling.stop_strings)
  return out


def torch_generate(model, tokenizer, settings):
  """A rollout `Generate` that serves each lock-step wave with `torch_replies`."""
  from marl_jax.training.llm_policy import prompt_ids
  from marl_jax.workflows.rollout import Generation

  def generate(requests, policy_id, params):
    del policy_id, params
    prompts = [prompt_ids(tokenizer, r.messages) for r in requests]
    replies = torch_replies(model, tokenizer, prompts, [settings(r) for r in requests])
    return [Generation(c.text, tuple(p), tuple(int(t) for t in c.tokens), (), c.finish_reason)
            for p, c in zip(prompts, replies)]

  return generate


def episodes_round(arm: str, c, run, policy, torch_model, round_index: int) -> dict:
  """One rollout of fresh problems: its seconds, episodes and reply tokens."""
  import jax

  from marl_jax.training import setup
  from marl_jax.workflows.rollout import rollout

  problems = setup.problems(c, 10_000 * (round_index + 1), c.rollout.problems_per_step)
  start = time.perf_counter()
  if arm == "torch":
    settings = setup.agent_sampling_params(c, run.spec.agents)
    gen = torch_generate(torch_model, run.tokenizers[0], lambda r: settings[r.agent])
    result = rollout(problems, run.spec, gen, None, run.rollout_cfg)
  else:
    policy.reseed(jax.random.fold_in(run.run_key, round_index))
    result = rollout(problems, run.spec, policy, run.params, run.rollout_cfg)
  return {"seconds": time.perf_counter() - start, "episodes": len(result.episodes),
          "new_tokens": sum(len(s.generation.token_ids) for s in result.samples)}


def heavy_tail_round(arm: str, run, engine, torch_model, round_index: int) -> dict:
  """The heavy-tailed requests through one engine (or transformers) directly."""
  import jax

  from marl_jax.sampling.engine import EngineRequest, request_key, run_all

  items = heavy_tail_requests(run, round_index)
  start = time.perf_counter()
  if arm == "torch":
    replies = torch_replies(torch_model, run.tokenizers[0], [p for p, _ in items],
                            [s for _, s in items])
  else:
    key = jax.random.fold_in(run.run_key, round_index)
    replies = run_all(engine, [EngineRequest(i, tuple(p), s, request_key(key, i))
                               for i, (p, s) in enumerate(items)])
  lengths = sorted(len(c.tokens) for c in replies)
  return {"seconds": time.perf_counter() - start, "episodes": len(items),
          "new_tokens": sum(lengths), "lengths": [lengths[len(lengths) // 2], lengths[-8],
                                                  lengths[-1]]}


def run_arm(name: str, arm: str, c, run, torch_model, compile_log: list[float]) -> dict:
  import numpy as np

  from marl_jax.parallel import layouts
  from marl_jax.sampling import registry
  from marl_jax.training import config as config_lib
  from marl_jax.training import setup
  from marl_jax.training.llm_policy import LLMPolicy

  compiles_before = len(compile_log)
  options = config_lib.engine_options(c)
  policy = engine = None
  if arm != "torch" and name == "heavy_tail":
    engine = registry.make_engine(arm, run.policy.models[0], run.tokenizers[0], options)
    _, model_params, adapters = layouts.of(run.policy).acting_params(run.policy, *run.params,
                                                                     0, 1)
    engine.load(model_params, adapters)
  elif arm != "torch":
    policy = LLMPolicy(run.policy, run.tokenizers,
                       setup.sampling_params(c, c.sampling.temperature, c.sampling.top_p),
                       run.run_key, setup.agent_sampling_params(c, run.spec.agents),
                       engine=arm, options=options)
  totals: dict[str, Any] = {"seconds": 0.0, "episodes": 0, "new_tokens": 0}
  for r in range(_ROUNDS.value + 1):  # round 0: the warm-up (compiles)
    if name == "heavy_tail":
      got = heavy_tail_round(arm, run, engine, torch_model, r)
    else:
      got = episodes_round(arm, c, run, policy, torch_model, r)
    if r:
      for k in ("seconds", "episodes", "new_tokens"):
        totals[k] += got[k]
      if "lengths" in got:  # median, 8th longest and longest reply of the round
        totals.setdefault("reply_lengths_p50_top8_max", []).append(got["lengths"])
  out = {"arm": arm, **totals, "episodes_per_s": totals["episodes"] / totals["seconds"],
         "new_tokens_per_s": totals["new_tokens"] / totals["seconds"],
         "compilations": len(compile_log) - compiles_before,
         "compile_s": round(float(np.sum(compile_log[compiles_before:])), 1)}
  if arm != "torch":
    stats = policy.stats() if policy is not None else engine.stats()  # all rounds
    out["prefix_hit_rate"] = 1 - stats["prefilled_tokens"] / stats["prompt_tokens"]
    out["decode_occupancy"] = stats["decode_tokens"] / max(stats["decode_row_steps"], 1)
    out["peak_kv_bytes"] = stats["peak_kv_bytes"]
    out["engine_stats"] = stats
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unknown = sorted(set(_WORKLOADS.value) - set(WORKLOADS)) + sorted(
      set(_ARMS.value) - {"static", "continuous", "torch"})
  if unknown:
    raise app.UsageError(f"unknown workloads or arms {unknown}; expected workloads of "
                         f"{list(WORKLOADS)} and arms of static, continuous, torch")
  import transformers
  from absl import logging

  from experiments.bench_common import compile_seconds_log, cpu_header, load_torch_reference
  from marl_jax.training import config as config_lib

  logging.set_verbosity(logging.WARNING)
  transformers.logging.set_verbosity_error()
  compile_log = compile_seconds_log()
  torch_model = None
  if "torch" in _ARMS.value:
    import torch

    torch.set_num_threads(os.cpu_count())
    torch_model = load_torch_reference()
  report = {**cpu_header(), "rounds": _ROUNDS.value, "warm_start": _WARM_START.value,
            "results": []}
  for name in _WORKLOADS.value:
    c, run = build(name)
    row = {"workload": name, "engine_options": dataclasses.asdict(config_lib.engine_options(c)),
           "arms": []}
    for arm in _ARMS.value:
      row["arms"].append(run_arm(name, arm, c, run, torch_model, compile_log))
      print(json.dumps({"workload": name, **row["arms"][-1]}, default=float), flush=True)
    by_arm = {a["arm"]: a for a in row["arms"]}
    if {"static", "continuous"} <= set(by_arm):
      row["continuous_over_static"] = (by_arm["continuous"]["episodes_per_s"]
                                       / by_arm["static"]["episodes_per_s"])
    report["results"].append(row)
  report["load_avg_after"] = os.getloadavg()
  print(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
  app.run(main)
