"""AT-GRPO Plan-Path: 10x10 grid, 22% blocked cells (PAPERS.md section 1). Variants and the `cpu`
preset: see configs/atgrpo_games.py. The cpu preset (the README's main job) uses a 4x4 grid and
one turn per episode, so it finishes in about 10 minutes on 2 CPU cores."""

from configs.atgrpo_games import game_config, parse_game_preset


def get_config(preset: str | None = None):
  variant, cpu = parse_game_preset(preset)
  size = dict(height=4, width=4) if cpu else dict(height=10, width=10, block_ratio=0.22)
  return game_config("plan_path", size, 1 if cpu else 4, variant, cpu)
