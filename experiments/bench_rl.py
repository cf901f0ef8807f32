"""RL-shaped sampling throughput on SmolLM2-135M against transformers' PyTorch `generate`, as JSON.

    python -m experiments.bench_rl [--prompts=2 --group=8 --max_new_tokens=64]

The shape of an RL rollout: for each task (a Plan-Path game turn, a math problem, a TLDR writing
prompt; real env observations rendered with the model's chat template, as
`training/llm_policy.py` renders them), --prompts distinct prompts x --group samples each, drawn
with temperature and top-p as training does and ended by the tokenizer's stop tokens. marl_jax
gets the N * G rows as one `Sampler.generate` call (identical prompts included, as the rollout
passes them); PyTorch gets the N prompts with `num_return_sequences=G` (left-padded, fp32, the
same GGUF through transformers' loader), with torch.set_num_threads(cores) and with one thread,
the faster counting.

Useful new tokens/s = tokens the rows actually produced (each row up to and including its stop
token; padding after it excluded) / wall time of one whole call, best of --repeats after a
warm-up call (JAX compile time is reported separately); `useful_row_step_fraction` = useful
tokens / (rows * longest row), the share of decode row-steps not spent on finished rows. Both
sides sample, so their lengths differ run to run: mean lengths are reported next to the rates.
CPU load averages are included because other processes on the machine distort the figures.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments.bench_common import best_time, left_padded, setup, timed_jax

_PROMPTS = flags.DEFINE_integer("prompts", 2, "Distinct prompts per task (N).")
_GROUP = flags.DEFINE_integer("group", 8, "Samples per prompt (G).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Token budget per sample.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_TOP_P = flags.DEFINE_float("top_p", 0.9, "Nucleus (configs/common.py uses 0.9).")
_TASKS = flags.DEFINE_list("tasks", ["plan_path", "math", "writing"],
                           "Prompt sources: plan_path, math, writing.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Timed calls per measurement (the best counts).")
_TORCH = flags.DEFINE_bool("torch", True, "Also measure transformers' PyTorch generate.")
_UNSHARED = flags.DEFINE_bool("unshared", False,
                              "Also time marl_jax with share_prompts=False (every row prefilled).")

# (env name, make_env kwargs, observing agent): the first call of an episode of each task.
_TASK_PROMPTS = {
    "plan_path": ("plan_path", {}, "plan"),
    "math": ("math", {"workflow": "single"}, "solver"),
    "writing": ("writing", {"task": "tldr"}, "agent1"),
}


def task_prompts(tokenizer, task: str, n: int) -> list[list[int]]:
  """Token ids of n chat-rendered first observations of `task` (seeds 0..n-1)."""
  from marl_jax.workflows import registry

  if task not in _TASK_PROMPTS:
    raise ValueError(f"--tasks has {task!r}; expected names from {sorted(_TASK_PROMPTS)}")
  name, kwargs, agent = _TASK_PROMPTS[task]
  messages = [registry.make_env(name, seed=s, **kwargs).observe(agent).messages() for s in range(n)]
  return [tokenizer.encode(tokenizer.apply_chat_template(m)) for m in messages]


def bench_jax(model, prompts, group: int, repeats: int, compile_log: list[float],
              share_prompts: bool) -> dict:
  import jax

  from marl_jax.sampling.params import SamplingParams
  from marl_jax.sampling.sampler import Sampler

  sampler = Sampler(model.config, model.tokenizer, share_prompts=share_prompts)
  sampling = SamplingParams(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
                            top_p=_TOP_P.value)
  rows = [p for p in prompts for _ in range(group)]  # as the rollout passes a group
  run = lambda: sampler.generate(model.params, rows, sampling, jax.random.key(0))
  seconds, out, compile_times = timed_jax(run, repeats, compile_log)
  useful = sum(len(c.tokens) for c in out)
  longest = max(len(c.tokens) for c in out)
  return {"share_prompts": share_prompts, "seconds": seconds, "useful_tokens": useful,
          "useful_tokens_per_s": useful / seconds, "mean_length": useful / len(out),
          "max_length": longest, "useful_row_step_fraction": useful / (len(out) * longest),
          "stopped": sum(c.finish_reason != "length" for c in out), **compile_times}


def bench_torch(model, tokenizer, prompts, group: int, repeats: int, threads: int) -> dict:
  import torch

  torch.set_num_threads(threads)
  inputs, mask = left_padded(prompts, tokenizer.pad_id)
  width = inputs.shape[1]
  stops = list(tokenizer.stop_token_ids)

  def run(n=_MAX_NEW.value):
    torch.manual_seed(0)
    with torch.inference_mode():
      return model.generate(inputs, attention_mask=mask, max_new_tokens=n, do_sample=True,
                            temperature=_TEMPERATURE.value, top_p=_TOP_P.value, top_k=0,
                            num_return_sequences=group, pad_token_id=tokenizer.pad_id,
                            eos_token_id=stops)

  run(2)  # warm-up
  seconds, out = best_time(run, repeats)
  lengths, stopped = [], 0
  for row in out[:, width:].tolist():  # a row ends at its first stop token (kept), else full
    hits = [i for i, t in enumerate(row) if t in stops]
    lengths.append(hits[0] + 1 if hits else len(row))
    stopped += bool(hits)
  useful = sum(lengths)
  return {"threads": threads, "seconds": seconds, "useful_tokens": useful,
          "useful_tokens_per_s": useful / seconds, "mean_length": useful / len(lengths),
          "stopped": stopped}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  model, torch_model, report, compile_log = setup(_TORCH.value)
  cores = report["cores"]
  report.update({"prompts": _PROMPTS.value, "group": _GROUP.value,
                 "max_new_tokens": _MAX_NEW.value, "temperature": _TEMPERATURE.value,
                 "top_p": _TOP_P.value, "results": []})
  for task in _TASKS.value:
    prompts = task_prompts(model.tokenizer, task, _PROMPTS.value)
    row = {"task": task, "rows": len(prompts) * _GROUP.value,
           "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
           "jax": [bench_jax(model, prompts, _GROUP.value, _REPEATS.value, compile_log, share)
                   for share in ([True, False] if _UNSHARED.value else [True])]}
    if torch_model is not None:
      row["torch"] = [bench_torch(torch_model, model.tokenizer, prompts, _GROUP.value,
                                  _REPEATS.value, threads)
                      for threads in sorted({cores, 1}, reverse=True)]
      best = max(r["useful_tokens_per_s"] for r in row["torch"])
      row["speedup_vs_torch"] = row["jax"][0]["useful_tokens_per_s"] / best
    report["results"].append(row)
    print(json.dumps(row), flush=True)
  report["load_avg_after"] = os.getloadavg()
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
