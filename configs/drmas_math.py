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

Schedules of the cpu run (a third preset option, default `smoke`):
  smoke  the sizes above: every stage end to end in a few minutes.
  rl     the README's main job, sized so that its RL steps themselves could lift the team past
         its warm-start in 15 minutes on 2 cores (RESULTS.md, row 1: over 3 seeds not yet
         beyond noise): one-operation problems (`env.kwargs.level=one_step`); a 3-step
         warm-start (8 problems per step, lr 1e-4) that teaches both roles the protocol and
         leaves the solver's sampled arithmetic wrong about half the time; then 8 Dr. MAS steps
         of 4 problems x K = 4 at lr 2e-5 (at 5e-5 the Plan-Path team collapsed:
         docs/experiments/atgrpo_plan_path.md) with DAPO dynamic sampling (groups without
         reward variance dropped, one refill of fresh problems), sampled at T = 1 (at the
         evaluation's 0.6 most groups had no reward variance and seeds 0-2 gained 0.000 +-
         0.089: docs/experiments/main_job.md); held-out success on 32 problems x 2 samples
         at the paper's T = 0.6, top-p 0.95, before and after the warm-start and every 2 RL
         steps. 32-token replies (a one-operation answer and a verdict take 15-30). Old
         log-probs are the sampler's: on the CPU the sampler and the learner compute in fp32
         from the same weights (their approximate KL was below 1e-8 at every step), so
         recomputing them would spend a forward pass on the same numbers.
         Checkpoints at steps 0, 4 and 8. With `grpo` the run is refused when the config is
         built: the dynamic-sampling filter does not apply to traj_grpo's groups.
"""

from __future__ import annotations

from configs import common

MODELS = common.MODELS + ("hetero",)
SCHEDULES = ("smoke", "rl")
# hetero: one model per agent in agent order (config.policy.kind 'mapped').
HETERO = ("qwen3-4b", "llama-3.2-3b")


def get_config(preset: str | None = None):
  choice, cpu = common.parse_preset(preset, {"estimator": common.DRMAS_ESTIMATORS,
                                             "models": MODELS, "schedule": SCHEDULES})
  c = common.drmas_config("math", choice["estimator"], model="qwen3-4b", max_turns=2,
                          questions=32, k=8, entropy_coef=0.0)
  c.name += f"_{choice['models']}"
  common.apply_team(c, choice["models"], HETERO)
  common.data_fields(c, **common.MATH_DATA)
  common.cpu_only_schedule(preset, choice["schedule"], SCHEDULES, cpu)
  if cpu:
    common.cpu_preset(c)
    c.eval.k = 2
  if choice["schedule"] == "rl":
    c.name += "_rl"
    c.env.kwargs.level = "one_step"
    c.sampling.max_new_tokens = 32
    c.sft.steps, c.sft.problems_per_step, c.sft.lr = 3, 8, 1e-4
    c.rollout.problems_per_step, c.rollout.k = 4, 4
    c.algo.filter, c.rollout.max_refills = "zero_variance", 1
    c.optim.lr = 2e-5
    c.train.steps, c.train.recompute_old_logp = 8, False
    c.eval.every, c.eval.num_problems, c.eval.at_start = 2, 32, True
    c.checkpoint.every_steps = 4
  return c
