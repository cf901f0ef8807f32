"""Dr. MAS search (docs/papers.md section 2): each step a verifier routes
(`<verify>yes|no</verify>`) to a search agent (`<search>query</search>`, top-3 BM25 passages
appended) or an answer agent (`<answer>...</answer>`, which ends the episode); at most 4 steps;
exact-match reward, minus 0.01 for a call with an invalid format.

`get_config("[ESTIMATOR][,MODELS][,cpu]")`: ESTIMATOR `drmas` (default: per-agent normalisation)
or `grpo` (the vanilla baseline); MODELS `shared` (default: one model, role prompts), `lora` (one
adapter per agent, rank 16 / alpha 32) or `full` (one full model per agent, each with its own
optimizer), or `hetero` (one full model per agent, each its own architecture and tokenizer:
docs/papers.md section 2's 2 x Llama-3.2-3B + Qwen2.5-7B, here verifier and search agent on
Llama-3.2-3B and answer agent on Qwen2.5-7B; the role assignment is a choice;
`--config.policy.models=...` picks others). Defaults are the paper's: Qwen2.5-3B (pass
`--config.model=/path/to/Qwen2.5-3B`), 128 questions x 5 trajectories, clip 0.2, dual-clip 3,
token-mean loss, no KL, entropy bonus 0.001, grad clip 1.0, team reward alpha 1, evaluation avg@16 /
pass@16 at temperature 0.6; lr 1e-6 (docs/papers.md section 2 states it for math; the same is used
here).

Data: questions of a generated multi-hop world (24 per world) unless local files are given, e.g.
the Search-R1 corpus and NQ + HotpotQA training questions:
`--config.env.kwargs.corpus_path=wiki.jsonl --config.env.kwargs.questions_path=nq_hotpot.jsonl`;
problem seed s is question s % rows. `cpu`: the embedded SmolLM2-135M, 2 generated questions x 2
trajectories, 2 steps per episode, 48-token replies, 2 training steps, evaluation pass@2 on 2
questions at the end.
"""

from __future__ import annotations

from configs import common

MODELS = common.MODELS + ("hetero",)
# hetero: one model per agent in agent order (config.policy.kind 'mapped').
HETERO = ("llama-3.2-3b", "llama-3.2-3b", "qwen2.5-7b")


def get_config(preset: str | None = None):
  choice, cpu = common.parse_preset(preset, {"estimator": common.DRMAS_ESTIMATORS,
                                             "models": MODELS})
  c = common.drmas_config("search", choice["estimator"], model="qwen2.5-3b", max_turns=4,
                          questions=128, k=5, entropy_coef=0.001)
  c.name += f"_{choice['models']}"
  common.apply_team(c, choice["models"], HETERO)
  common.data_fields(c, corpus_path=None, questions_path=None)
  if cpu:
    common.cpu_preset(c)
    c.env.max_turns = 2
    c.eval.k = 2
  return c
