"""AT-GRPO Plan-Path: 10x10 grid, 22% blocked cells (docs/papers.md section 1). Variants and the
`cpu` preset: see configs/atgrpo_games.py.

The cpu preset (the README's main job until issue 39) is a CPU-sized variant: a 4x4 grid, one
turn per episode, compact prompts (the plan agent sees the tool's output, not its program), and a
supervised warm-start before RL (`training/sft.py`): each role first learns its part of the
protocol from the env's demonstrations (the tool agent a BFS program over the grid, the plan agent
the checked answer), so that RL starts from replies that parse; then one AT-GRPO step.

Schedules of the cpu run (a second preset option, default `main`):
  main  the main job until issue 39: 8 warm-start steps, then one RL step. The warm-started team is
        nearly deterministic (token entropy 0.006-0.04), so its RL step has no within-group
        variance and a zero gradient (RESULTS.md).
  rl    the RL comparison of the game table's rows: 4 warm-start steps, which leave the team's
        sampled replies varied (some programs fail, some answers are wrong), then 8 RL steps of
        4 problems x K = 4 at lr 2e-5, evaluated every 4 steps (at 5e-5 the shared team of
        seed 0 collapsed to empty replies by step 6: RESULTS.md).
"""

from configs.atgrpo_games import VARIANTS, game_config
from configs.common import cpu_only_schedule, parse_preset

SCHEDULES = ("main", "rl")


def get_config(preset: str | None = None):
  choice, cpu = parse_preset(preset, {"variant": VARIANTS, "schedule": SCHEDULES})
  variant, schedule = choice["variant"], choice["schedule"]
  cpu_only_schedule(preset, schedule, SCHEDULES, cpu)
  if not cpu:
    return game_config("plan_path", dict(height=10, width=10, block_ratio=0.22), 4, variant, cpu)
  c = game_config("plan_path", dict(height=4, width=4, prompt="compact"), 1, variant, cpu)
  c.sampling.max_new_tokens = 256  # the tool agent's search program is about 240 tokens
  c.sft.steps, c.sft.problems_per_step, c.sft.lr = 8, 4, 3e-4
  if c.policy.kind == "lora":
    # Rank-16 adapters learn the demonstrations at 10x the full model's lr: at 3e-4 their 8
    # steps ended at loss 0.84 (the full model's at 0.005) and the team never parsed.
    c.sft.lr = 3e-3
  c.eval.num_problems, c.eval.at_start = 16, True
  # One AT-GRPO step after the warm-start. The learner keeps the preset's per-layer remat: on
  # this CPU keeping every activation was slower, not faster (8 rows of 256 + 256 tokens: 35.4 s
  # per step at 13.7 GB peak RSS vs 32.5 s at 4.8 GB), and it took the job to 22.7 GB.
  c.train.steps = 1
  if schedule == "rl":
    c.name += "_rl"
    c.sft.steps = 4
    c.train.steps, c.eval.every = 8, 4
    c.rollout.problems_per_step, c.rollout.k = 4, 4
    c.optim.lr = 2e-5
  return c
