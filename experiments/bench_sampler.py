"""Sampler throughput on SmolLM2-135M against transformers' PyTorch `generate`, as JSON.

    python -m experiments.bench_sampler [--batch_sizes=8,64 --prompt_tokens=64 --new_tokens=64]

Both sides decode the same left-padded chat prompts (lengths spread just below --prompt_tokens)
greedily for exactly --new_tokens tokens (no stop token), from the same embedded GGUF file:
marl_jax through its own loader, PyTorch through transformers' GGUF loader, fp32. PyTorch runs
with torch.set_num_threads(cores) and also with one thread, because OpenMP threads spinning on a
busy machine can slow it several-fold; the speed-up is taken against the faster of the two.
New tokens/s = batch * new_tokens / wall time of one whole call (prefill included), best of
--repeats calls after a warm-up call; JAX compile time is reported separately (summed from jax's
compilation events). CPU load averages before and after are included because other processes on
the machine distort the figures.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments.bench_common import best_time, left_padded, setup, timed_jax

_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["8", "64"], "Batch sizes to measure.")
_PROMPT_TOKENS = flags.DEFINE_integer(
    "prompt_tokens", 64, "Longest prompt in tokens; prompts spread over its last 1/8.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per row.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed calls per measurement (the best counts).")
_TORCH = flags.DEFINE_bool("torch", True, "Also measure transformers' PyTorch generate.")

_TOPICS = ["the ocean", "prime numbers", "a city at night", "machine learning", "the moon",
           "coffee", "mountains", "a chess game", "rivers", "libraries", "trains", "gardens"]


def make_prompts(tokenizer, batch: int, max_tokens: int) -> list[list[int]]:
  """Chat prompts whose lengths spread over [7/8 * max_tokens, max_tokens]."""
  prompts = []
  for i in range(batch):
    target = max_tokens - (i * 7919) % (max_tokens // 8 + 1)
    words = f"Tell me about {_TOPICS[i % len(_TOPICS)]}, in detail, with examples".split()
    ids: list[int] = []
    while True:
      text = " ".join(words)
      nxt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
      if len(nxt) > target:
        break
      ids, words = nxt, words + ["please"]
    if not ids:
      raise ValueError(f"--prompt_tokens={max_tokens} is shorter than the chat template")
    prompts.append(ids)
  return prompts


def bench_jax(model, prompts, new_tokens: int, repeats: int, compile_log: list[float]) -> dict:
  import jax

  from marl_jax.sampling.params import SamplingParams
  from marl_jax.sampling.sampler import Sampler

  sampler = Sampler(model.config, model.tokenizer)
  sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=())
  run = lambda: sampler.generate(model.params, prompts, sampling, jax.random.key(0))
  seconds, out, compile_times = timed_jax(run, repeats, compile_log)
  return {"seconds": seconds, "new_tokens_per_s": len(prompts) * new_tokens / seconds,
          **compile_times, "tokens": [c.tokens.tolist() for c in out]}


def bench_torch(model, tokenizer, prompts, new_tokens: int, repeats: int, threads: int) -> dict:
  import torch

  torch.set_num_threads(threads)
  inputs, mask = left_padded(prompts, tokenizer.pad_id)
  width = inputs.shape[1]

  def run(n=new_tokens):
    with torch.inference_mode():
      return model.generate(inputs, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=tokenizer.pad_id, eos_token_id=None)

  run(2)  # warm-up
  seconds, out = best_time(run, repeats)
  return {"threads": threads, "seconds": seconds,
          "new_tokens_per_s": len(prompts) * new_tokens / seconds,
          "tokens": out[:, width:].tolist()}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  model, torch_model, report, compile_log = setup(_TORCH.value)
  cores = report["cores"]
  report.update({"new_tokens": _NEW_TOKENS.value, "results": []})
  for batch in map(int, _BATCH_SIZES.value):
    prompts = make_prompts(model.tokenizer, batch, _PROMPT_TOKENS.value)
    row = {"batch": batch, "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))]}
    ours = bench_jax(model, prompts, _NEW_TOKENS.value, _REPEATS.value, compile_log)
    row["jax"] = {k: v for k, v in ours.items() if k != "tokens"}
    if torch_model is not None:
      refs = [bench_torch(torch_model, model.tokenizer, prompts, _NEW_TOKENS.value, _REPEATS.value,
                          threads) for threads in sorted({cores, 1}, reverse=True)]
      row["torch"] = [{k: v for k, v in r.items() if k != "tokens"} for r in refs]
      ref = max(refs, key=lambda r: r["new_tokens_per_s"])
      row["speedup_vs_torch"] = ours["new_tokens_per_s"] / ref["new_tokens_per_s"]
      same = [a == b for x, y in zip(ours["tokens"], ref["tokens"]) for a, b in zip(x, y)]
      row["greedy_token_agreement"] = sum(same) / len(same)
    report["results"].append(row)
    print(json.dumps(row), flush=True)
  report["load_avg_after"] = os.getloadavg()
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
