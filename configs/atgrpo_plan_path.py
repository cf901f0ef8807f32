"""AT-GRPO Plan-Path: 10x10 grid, 22% blocked cells (PAPERS.md section 1). Variants and the `cpu`
preset: see configs/atgrpo_games.py.

The cpu preset (the README's main job) is a CPU-sized variant: a 4x4 grid, one turn per episode,
compact prompts (the plan agent sees the tool's output, not its program), and a supervised
warm-start before RL (`training/sft.py`): each role first learns its part of the protocol from
the env's demonstrations (the tool agent a BFS program over the grid, the plan agent the checked
answer), so that RL starts from replies that parse; then one AT-GRPO step.
"""

from configs.atgrpo_games import game_config, parse_game_preset


def get_config(preset: str | None = None):
  variant, cpu = parse_game_preset(preset)
  if not cpu:
    return game_config("plan_path", dict(height=10, width=10, block_ratio=0.22), 4, variant, cpu)
  c = game_config("plan_path", dict(height=4, width=4, prompt="compact"), 1, variant, cpu)
  c.sampling.max_new_tokens = 256  # the tool agent's search program is about 240 tokens
  c.sft.steps, c.sft.problems_per_step, c.sft.lr = 8, 4, 3e-4
  c.eval.num_problems, c.eval.at_start = 16, True
  # One AT-GRPO step after the warm-start, without rematerialisation (8 rows of at most 576
  # tokens fit in a few GB; the same maths, a quarter less learner compute): the job stays
  # within 15 minutes on 2 cores, install included (RESULTS.md).
  c.train.steps, c.train.remat = 1, False
  return c
