"""Checks an export against the run it came from: our logits vs transformers' on held-out prompts,
and (with lm-eval installed) the `marl_jax` lm-eval model's loglikelihoods vs lm-eval's own `hf`
model on the exported directories.

    python -m experiments.export_check --workdir=RUN --export=EXPORT_DIR [--checkpoint=STEP]

EXPORT_DIR is what `experiments.export` wrote for that checkpoint (`export.json` says which
directory holds which policy, and whether LoRA was merged or written as PEFT adapters; adapters
are loaded with peft over the exported base). Prints, per policy, the largest absolute logit
difference over the prompts (with the largest |logit| for scale and, for LoRA, how far the
adapter moves the logits, so the check is seen to be sensitive) and the largest loglikelihood
difference over a fixed set of (context, continuation) pairs. Everything runs in fp32 on the CPU.
Bad input ends in one `error: ...` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from marl_jax.errors import ReportedError, UserInputError

PROMPTS = ["What is 17 times 3? Put the answer in \\boxed{}.",
           "Name two prime numbers larger than 50.",
           "Summarise in one sentence why the sky looks blue."]
PAIRS = [("The capital of France is", " Paris"), ("2 + 2 =", " 4"),
         ("Question: what colour is grass?\nAnswer:", " green, in spring and summer.")]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.export_check",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="the run's directory")
  parser.add_argument("--export", required=True, help="what experiments.export wrote for it")
  parser.add_argument("--checkpoint", type=int, default=None, help="the exported step")
  args = parser.parse_args(argv)
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
  try:
    for record in compare(args.workdir, args.export, args.checkpoint):
      print(record["text"])
  except ReportedError as e:
    print(e.report(), file=sys.stderr)
    return 1
  return 0


def compare(workdir: str, export_dir: str, step: int | None = None) -> list[dict[str, Any]]:
  """One record per policy and comparison: {"policy", "what", "max_abs_diff", "text", ...}."""
  import jax.numpy as jnp  # here, so --help stays fast
  import numpy as np
  import torch
  import transformers

  from marl_jax.models import decoder
  from marl_jax.models import lora as lora_lib
  from marl_jax.training import export

  try:
    with open(os.path.join(export_dir, export.MANIFEST)) as f:
      manifest = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise UserInputError(f"--export={export_dir!r}: no readable {export.MANIFEST} ({e}); "
                         "expected a directory experiments.export wrote") from None
  team = export.restore_team(workdir, step)
  if team.step != manifest["step"]:
    raise UserInputError(f"--export holds step {manifest['step']}, the run's checkpoint is "
                         f"{team.step}; expected --checkpoint={manifest['step']}")
  out = []
  for p, name in enumerate(team.names):
    entry = manifest["models"][name]
    path = os.path.join(export_dir, entry["path"])
    if entry["format"] == "peft_adapter":
      import peft
      base = transformers.AutoModelForCausalLM.from_pretrained(
          os.path.join(export_dir, manifest["base"]), dtype=torch.float32)
      model = peft.PeftModel.from_pretrained(base, path)
    else:
      model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config, params, tokenizer = export.policy_model(team, p)
    adapters = None
    if team.frozen:  # LoRA: our forward runs the adapter unmerged, as training and sampling do
      params = team.frozen["base"]
      adapters = lora_lib.adapters(team.trainable, jnp.full((1,), p, jnp.int32),
                                   team.policy.lora)
    worst, scale, moved = 0.0, 0.0, 0.0
    for prompt in PROMPTS:
      ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
      tokens, positions = jnp.asarray([ids], jnp.int32), jnp.arange(len(ids))[None]
      ours, _ = decoder.forward(params, tokens, positions, config, adapters=adapters)
      with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits.numpy()
      worst = max(worst, float(np.abs(np.asarray(ours) - ref).max()))
      scale = max(scale, float(np.abs(ref).max()))
      if adapters is not None:
        without, _ = decoder.forward(params, tokens, positions, config)
        moved = max(moved, float(np.abs(np.asarray(ours) - np.asarray(without)).max()))
    out.append({"policy": name, "what": "logits", "max_abs_diff": worst, "max_abs_logit": scale,
                "adapter_effect": moved if adapters is not None else None,
                "text": f"{name}: logits max |ours - transformers| = {worst:.3g} over "
                        f"{len(PROMPTS)} prompts (max |logit| {scale:.3g}, {entry['format']}"
                        + (f"; the adapter moves them by up to {moved:.3g})"
                           if adapters is not None else ")")})
    if entry["format"] == "model":
      out.append(_compare_loglikelihoods(name, path, workdir, team.step))
  return out


def _compare_loglikelihoods(name: str, path: str, workdir: str, step: int) -> dict[str, Any]:
  """The marl_jax lm-eval model (from the checkpoint) against lm-eval's `hf` (the export)."""
  try:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
  except ImportError:
    return {"policy": name, "what": "loglikelihood", "max_abs_diff": None,
            "text": f"{name}: lm-eval not installed, loglikelihoods not compared"}
  from marl_jax.training.lm_eval_model import MarlJaxLM

  requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
  ours = MarlJaxLM(checkpoint=workdir, step=step, policy=name).loglikelihood(requests)
  theirs = HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=1).loglikelihood(
      requests)
  worst = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs))
  greedy = sum(a[1] == b[1] for a, b in zip(ours, theirs))
  return {"policy": name, "what": "loglikelihood", "max_abs_diff": worst,
          "greedy_agree": greedy, "pairs": len(PAIRS),
          "text": f"{name}: lm-eval loglikelihood max |marl_jax - hf| = {worst:.3g} over "
                  f"{len(PAIRS)} pairs (values {[round(a[0], 3) for a in ours]}), is_greedy "
                  f"agrees on {greedy}/{len(PAIRS)}"}


if __name__ == "__main__":
  sys.exit(main())
