"""Dr. MAS math (docs/papers.md section 2): a solver answers in `\\boxed{}`, a verifier ends with
`<verify>approve|reject</verify>`; at most 2 loops, approval exits, no verifier on the last loop;
reward 1/0 on the last solver answer, minus 0.1 for a call with an invalid format.

`get_config("[ESTIMATOR][,MODELS][,cpu]")`: ESTIMATOR `drmas` (default: per-agent normalisation)
or `grpo` (the vanilla baseline); MODELS `shared` (default: one model, role prompts), `lora` (one
adapter per agent, rank 16 / alpha 32) or `full` (one full model per agent, each with its own
optimizer), or `hetero` (one full model per agent, each its own architecture and tokenizer:
solver on Qwen3-4B, verifier on Llama-3.2-3B; docs/papers.md section 2 names a heterogeneous team
for search only, so this pairing is a choice; `--config.policy.models=...` picks others). Defaults
are the paper's: Qwen3-4B (pass `--config.model=/path/to/Qwen3-4B`), 32 questions x 8 trajectories,
lr 1e-6 per agent, clip 0.2, dual-clip 3, token-mean loss, no KL, no entropy bonus, grad clip 1.0,
team reward alpha 1, evaluation avg@16 / pass@16 at temperature 0.6.

Data: generated arithmetic word problems unless a local file is given, e.g. the paper's
dapo_filter set: `--config.env.kwargs.path=dapo_filter.parquet --config.env.kwargs.fmt=plain`;
problem seed s is row s % rows. `cpu`: the embedded SmolLM2-135M, 2 generated problems x 2
trajectories, 48-token replies, 2 steps, evaluation pass@2 on 2 problems at the end.
"""

from __future__ import annotations

from configs import common

MODELS = common.MODELS + ("hetero",)
# hetero: one model per agent in agent order (config.policy.kind 'mapped').
HETERO = ("qwen3-4b", "llama-3.2-3b")


def get_config(preset: str | None = None):
  choice, cpu = common.parse_preset(preset, {"estimator": common.DRMAS_ESTIMATORS,
                                             "models": MODELS})
  c = common.drmas_config("math", choice["estimator"], model="qwen3-4b", max_turns=2,
                          questions=32, k=8, entropy_coef=0.0)
  c.name += f"_{choice['models']}"
  common.apply_team(c, choice["models"], HETERO)
  common.data_fields(c, **common.MATH_DATA)
  if cpu:
    common.cpu_preset(c)
    c.eval.k = 2
  return c
