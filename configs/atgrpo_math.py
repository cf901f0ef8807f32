"""AT-GRPO math (docs/papers.md section 1): a Python tool agent, then a reasoner; the episode ends
when their answers agree (at most 4 turns). Tool programs run in the sandbox.

`get_config("VARIANT[,cpu]")`, VARIANT one of configs/atgrpo_games.TASK_VARIANTS: the table rows of
configs/atgrpo_games.py (single, sa_grpo, mas_norl, mas_shared (default), mas_lora, mas_full) and
mas_grpo (the team under plain GRPO). Defaults are the paper's: Qwen3-1.7B (pass
`--config.model=/path/to/Qwen3-1.7B`), 32 problems x K=8 tree branches, 200 steps, 2048-token
replies, lr 1e-6 constant, clip 0.2/0.2, dual-clip 3, token-mean loss, grad clip 1.0, weight decay
0.01, lowest-mean 50% group filtering, local + team reward (alpha 1).

Grading: math-verify, as PettingLLMs' math agents grade (`env.kwargs.grader='math_verify'`, in a
bounded worker process: marl_jax/envs/math/grading.py); `--config.env.kwargs.grader=builtin` grades
with the project's own checker instead.

Data: generated arithmetic word problems unless a local file is given, e.g. POLARIS-53K for
training: `--config.env.kwargs.path=polaris.jsonl [--config.env.kwargs.fmt=plain]` (formats:
auto, gsm8k, math, plain); problem seed s is row s % rows. `cpu`: the embedded SmolLM2-135M,
2 generated problems x 2 branches, one turn, 48-token replies, 2 steps.
"""

from __future__ import annotations

from configs.atgrpo_games import task_config
from configs.common import MATH_DATA, data_fields


def get_config(preset: str | None = None):
  c = task_config("math", "atgrpo", max_turns=4, preset=preset)
  data_fields(c, **MATH_DATA)
  c.env.kwargs.grader = "math_verify"
  return c
