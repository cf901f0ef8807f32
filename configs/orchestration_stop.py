"""Learned stopping (orchestration decision O5, docs/papers.md section 5; issue: no published RL
method learns it): the Dr. MAS math loop (solver -> verifier) with its exit made a coordinator's
decision, `#### stop` or `#### continue`, after every review; the round cap (3) is only a safety
limit.

Credit: every decision is a sample in its own group (problem, round, coordinator), scored with the
episode it led to: the team reward (1/0 on the final answer, alpha 1) minus `round_cost` per
solver round used (`--config.env.kwargs.round_cost`, default 0.1) and, when set,
`premature_penalty` for stopping on a wrong answer with rounds left; format penalties as Dr. MAS.
Advantages: the `drmas` estimator (unbiased std; a singleton group keeps its reward) over
(problem, turn, agent) groups, so round-r decisions compete only with round-r decisions.
Everything else as `configs/drmas_math.py` (K = 8 independent trajectories per question, lr 1e-6,
Qwen3-4B: pass `--config.model=/path/to/Qwen3-4B`); round_cost 0 with a coordinator that stops
when the verifier approves is the fixed Dr. MAS loop.

`get_config("[MODELS][,REVIEW][,cpu]")`: MODELS `shared` (default: one model, role prompts),
`lora` or `full` (one per agent); REVIEW `verifier` (default: the Dr. MAS verifier reviews each
answer) or `program` (the `learned_stop_checked` workflow: a checker's program, run in the
sandbox, reviews it, and the warm-start demonstrates no stop rule; fixed exits for its baselines:
`--config.env.workflow=stop_by_check` or `stop_at_cap_checked`). With `program` the groups are
state-matched and pooled over the step's problems: (round, agent, whether the answer matched the
check), so a decision competes only with decisions taken after the same review, a baseline per
state; the estimator is `at_grpo` (a singleton group has nothing to compare with and gets 0,
where `drmas` would hand it its raw reward), and a KL of 1.0 to the policy RL starts from (the
warm-start) keeps the coordinator from collapsing to one decision (`loss.kl_coef`; LoRA teams
have none: RL from trained adapters refuses it). Why these settings, what they replaced and how
each did: RESULTS.md, from "Learned stopping with a program checker" to "Pooled state groups
with a KL anchor". `cpu`: the embedded SmolLM2-135M at the shared CPU preset's sizes (2 problems
x 2 trajectories, 48-token replies, 2 steps).

Options the probes in RESULTS.md use: one-operation problems (`--config.env.kwargs.level=one_step`,
where a second round sometimes fixes a wrong answer) and RL on the coordinator alone
(`--config.train.agents=coordinator`). With `program`, `--config.algo.balance_states=True` weighs
the decisions after a match and after a mismatch equally (`AdvantageConfig.balance_states`), and
`--config.algo.normalize_states=True` with `--config.algo.normalize_std=False` gives each state's
mean-centred advantages unit scale.
"""

from __future__ import annotations

from configs import common

REVIEWS = ("verifier", "program")  # who reviews each answer for the coordinator


def get_config(preset: str | None = None):
  choice, cpu = common.parse_preset(preset, {"models": common.MODELS, "review": REVIEWS})
  c = common.drmas_config("math", "drmas", model="qwen3-4b", max_turns=3, questions=32, k=8,
                          entropy_coef=0.0)
  checked = choice["review"] == "program"
  c.name = f"orchestration_stop_math_{choice['models']}" + ("_checked" if checked else "")
  c.env.workflow = "learned_stop_checked" if checked else "learned_stop"
  c.algo.group_by = "problem_turn_agent"
  if checked:
    c.algo.estimator, c.algo.group_by = "at_grpo", "turn_agent_state"
    c.loss.kl_coef = 0.0 if choice["models"] == "lora" else 1.0
  common.apply_models(c, choice["models"])
  common.data_fields(c, **common.MATH_DATA)
  c.env.kwargs.round_cost = 0.1
  c.env.kwargs.premature_penalty = 0.0
  if cpu:
    common.cpu_preset(c)
    c.eval.k = 2
  return c
