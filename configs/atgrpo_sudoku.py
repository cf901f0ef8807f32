"""AT-GRPO Sudoku: 4x4 with a unique solution (docs/papers.md section 1). Variants and the `cpu`
preset: see configs/atgrpo_games.py."""

from configs.atgrpo_games import game_config, parse_game_preset


def get_config(preset: str | None = None):
  variant, cpu = parse_game_preset(preset)
  return game_config("sudoku", dict(size=4), 2 if cpu else 4, variant, cpu)
