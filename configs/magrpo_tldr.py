"""MAGRPO TLDR summarisation (docs/papers.md section 3): agent 1 writes a concise summary, agent 2 a
detailed one, in parallel; both get the level-gated joint reward (max 3.0; word range 8-256,
length ratio optimum [1.6, 3.2], unique-word ratio, transition words, Jaccard cap 0.03).

`get_config("[ESTIMATOR][,MODELS][,cpu]")`: ESTIMATOR `magrpo` (default: mean baseline), `rloo`
or `remax` (CoMLRL's MARLOO / MAReMax baselines); MODELS `full` (default: one full model per
agent, each with its own optimizer, as in the paper), `lora` or `shared`. Defaults are the
paper's: Qwen3-1.7B per agent (pass `--config.model=/path/to/Qwen3-1.7B`), G = 4, lr 5e-6,
temperature 0.7, top-p 0.9, 256-token replies, REINFORCE with the joint-reward advantage;
1000 training examples: 1000 steps of one post each, evaluation every 100 steps (docs/papers.md
section 3 gives neither the batch size nor the evaluation schedule).

Data: generated filler posts unless a local file is given, e.g. TLDR training posts:
`--config.env.kwargs.path=tldr_train.jsonl [--config.env.kwargs.field=prompt]`; problem seed s is
row s % rows. `cpu`: the embedded SmolLM2-135M, 2 generated posts x 2 joint actions, 48-token
replies, 2 steps, evaluation on 2 posts at the end.
"""

from __future__ import annotations

from configs import common

MODELS = ("full", "lora", "shared")


def get_config(preset: str | None = None):
  return common.writing_config("tldr", preset, MODELS)
