"""Learned spawning and aggregation (orchestration decisions O1 "when/how many to spawn" and O4
"how to aggregate", PAPERS.md section 5): a dispatcher replies `#### N` to spawn N of 4 parallel
solvers on a math problem, each answers on its own, and an aggregator compares their answers and
gives the team's final `\\boxed{}` answer.

Credit: every call is a sample; the dispatcher's decision is credited with the episode it led to,
the team reward (1/0 on the aggregate, alpha 1) minus `spawn_cost` per spawned solver
(`--config.env.kwargs.spawn_cost`, default 0.1), so its group (problem, dispatcher) compares
spawn counts by accuracy net of cost; the `drmas` estimator over (problem, turn, agent) groups,
format penalties as Dr. MAS; the trace's aggregate event records whether the aggregator kept a
right answer one of the solvers had. Everything else as `configs/drmas_math.py` (K = 8
independent episodes per question, lr 1e-6, Qwen3-4B: pass `--config.model=/path/to/Qwen3-4B`).

`get_config("[MODELS][,cpu]")`: MODELS `shared` (default: one model, role prompts), `lora` or
`full` (one per agent: the four solvers then train four models). `cpu`: the embedded SmolLM2-135M
at the shared CPU preset's sizes (2 problems x 2 episodes, 48-token replies, 2 steps).
"""

from __future__ import annotations

from configs import common


def get_config(preset: str | None = None):
  choice, cpu = common.parse_preset(preset, {"models": common.MODELS})
  c = common.drmas_config("math", "drmas", model="qwen3-4b", max_turns=1, questions=32, k=8,
                          entropy_coef=0.0)
  c.name = f"orchestration_spawn_math_{choice['models']}"
  c.env.workflow = "spawn"
  c.algo.group_by = "problem_turn_agent"
  common.apply_models(c, choice["models"])
  common.data_fields(c, path=None, fmt="auto")
  c.env.kwargs.spawn_cost = 0.1
  if cpu:
    common.cpu_preset(c)
    c.eval.k = 2
  return c
