"""AT-GRPO code (docs/papers.md section 1): a coder, then a unit-test writer; the episode ends when
the generated tests pass on the generated code (at most 4 turns). All programs run in the sandbox.

`get_config("VARIANT[,cpu]")`, VARIANT one of configs/atgrpo_games.TASK_VARIANTS: the table rows of
configs/atgrpo_games.py (single, sa_grpo, mas_norl, mas_shared (default), mas_lora, mas_full) and
mas_grpo (the team under plain GRPO). Defaults are the paper's: Qwen3-1.7B (pass
`--config.model=/path/to/Qwen3-1.7B`), 32 problems x K=8 tree branches, 200 steps, 2048-token
replies, lr 1e-6 constant, clip 0.2/0.2, dual-clip 3, token-mean loss, grad clip 1.0, weight decay
0.01, lowest-mean 50% group filtering, local + team reward (alpha 1).

Data: generated stdin/stdout tasks unless a local file is given, e.g. the paper's CodeContests +
APPS training data: `--config.env.kwargs.path=apps_train.jsonl --config.env.kwargs.fmt=apps`
(formats: canonical, humaneval, mbpp, apps, code_contests); problem seed s is row s % rows.
`cpu`: the embedded SmolLM2-135M, 2 generated tasks x 2 branches, one turn, 48-token replies,
2 steps.
"""

from __future__ import annotations

from configs.atgrpo_games import task_config
from configs.common import data_fields


def get_config(preset: str | None = None):
  c = task_config("code", "atgrpo", max_turns=4, preset=preset)
  data_fields(c, path=None, fmt="canonical")
  return c
