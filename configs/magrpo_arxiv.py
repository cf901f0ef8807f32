"""MAGRPO arXiv abstract expansion (docs/papers.md section 3): from an abstract, agent 1 writes the
background and motivation, agent 2 the method and implications, in parallel; both get the
level-gated joint reward (max 3.0; word range 128-256, length ratio optimum [1.3, 1.6],
unique-word ratio [0.7, 1.3], transition words, Jaccard cap 0.23).

`get_config("[ESTIMATOR][,MODELS][,cpu]")`: ESTIMATOR `magrpo` (default: mean baseline), `rloo`
or `remax` (CoMLRL's MARLOO / MAReMax baselines); MODELS `full` (default: one full model per
agent, each with its own optimizer, as in the paper), `lora` or `shared`. Defaults are the
paper's: Qwen3-1.7B per agent (pass `--config.model=/path/to/Qwen3-1.7B`), G = 4, lr 5e-6,
temperature 0.7, top-p 0.9, 256-token replies, REINFORCE with the joint-reward advantage;
1000 training examples: 1000 steps of one abstract each, evaluation every 100 steps (docs/papers.md
section 3 gives neither the batch size nor the evaluation schedule).

Data: generated filler documents unless a local file is given, e.g. arXiv abstracts:
`--config.env.kwargs.path=arxiv_train.jsonl [--config.env.kwargs.field=abstract]`; problem seed s
is row s % rows. `cpu`: the embedded SmolLM2-135M, 2 generated documents x 2 joint actions,
48-token replies, 2 steps, evaluation on 2 documents at the end.
"""

from __future__ import annotations

from configs import common

MODELS = ("full", "lora", "shared")


def get_config(preset: str | None = None):
  return common.writing_config("arxiv", preset, MODELS)
