"""Learned spawning, delegation and aggregation (orchestration decisions O1 "how many to spawn",
O2 "whom to delegate to" and O4 "how to aggregate", docs/papers.md section 5): a dispatcher spawns
parallel solvers on a math problem, each answers on its own, and an aggregator compares their
answers and gives the team's final `\\boxed{}` answer. The decision: `count` (math workflow
'spawn') replies `#### N`, N of 4 identical solvers; `delegate` (workflow 'delegate') names which
of 4 specialists solve, `#### stepwise, checker`.

Credit: every call is a sample; the dispatcher's decision is credited with the episode it led to,
the team reward (1/0 on the aggregate, alpha 1) minus `spawn_cost` per spawned solver
(`--config.env.kwargs.spawn_cost`, default 0.1) and minus `latency_cost` per thousand characters
of the longest solver reply (the parallel stage's wall-clock; default 0), so its group (problem,
dispatcher) compares choices by accuracy net of cost; `aggregation_bonus` (default 0) rewards the
aggregator for keeping a right answer one of the solvers had; the `drmas` estimator over
(problem, turn, agent) groups, format penalties as Dr. MAS; the trace's aggregate event records
whether the aggregator kept a right answer one of the solvers had and the parallelism speedup.
`--config.env.workflow=spawn_vote` (or `delegate_vote`) evaluates the same checkpoint with the
aggregation fixed: the team's answer is the solvers' plurality answer (the aggregator's reply is
not read), the baseline a learned aggregator is compared with. `checked` (workflow
'spawn_checked') is `count` with a verified pick on problems that carry a check (generated at
level 'equation': a * x + b = c, x whole): the team's answer is the first solver answer that
passes the check by substitution, else the plurality; so each extra solver buys accuracy, as
best-of-N with a verifier does, and the dispatcher's count trades it against `spawn_cost`.
Everything else as `configs/drmas_math.py` (K = 8 independent episodes per question, lr 1e-6,
Qwen3-4B: pass `--config.model=/path/to/Qwen3-4B`).

`get_config("[DECISION][,MODELS][,cpu]")`: DECISION `count` (default), `delegate` or
`checked`; MODELS `shared` (default: one model, role prompts), `lora` or `full` (one per agent:
the four solvers then train four models), or `split`: two full models, the dispatcher's own and
one that every worker and the aggregator share (`config.policy.share`), with RL on the
dispatcher alone (`config.train.agents`), so the workers the count buys stay fixed while the
count is learned (on one shared model, RL moves them too). `cpu`: the embedded SmolLM2-135M at
the shared CPU preset's sizes (2 problems x 2 episodes, 48-token replies, 2 steps).
"""

from __future__ import annotations

from configs import common
from marl_jax.workflows import registry

DECISIONS = {"count": "spawn", "delegate": "delegate",
             "checked": "spawn_checked"}  # preset option -> math workflow
MODELS = (*common.MODELS, "split")


def get_config(preset: str | None = None):
  choice, cpu = common.parse_preset(preset, {"decision": tuple(DECISIONS),
                                             "models": MODELS})
  c = common.drmas_config("math", "drmas", model="qwen3-4b", max_turns=1, questions=32, k=8,
                          entropy_coef=0.0)
  c.name = f"orchestration_{DECISIONS[choice['decision']]}_math_{choice['models']}"
  c.env.workflow = DECISIONS[choice["decision"]]
  c.algo.group_by = "problem_turn_agent"
  split = choice["models"] == "split"
  common.apply_models(c, "full" if split else choice["models"])
  if split:
    dispatcher, *rest = registry.workflow_spec("math", c.env.workflow).agents
    c.policy.share, c.train.agents = ("+".join(rest),), dispatcher
  common.data_fields(c, **common.MATH_DATA)
  c.env.kwargs.spawn_cost = 0.1
  c.env.kwargs.latency_cost, c.env.kwargs.aggregation_bonus = 0.0, 0.0
  if cpu:
    common.cpu_preset(c)
    c.eval.k = 2
  return c
