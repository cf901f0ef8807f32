"""AT-GRPO Sokoban: 6x6 room, one box (docs/papers.md section 1). Variants and the `cpu` preset: see
configs/atgrpo_games.py."""

from configs.atgrpo_games import game_config, parse_game_preset


def get_config(preset: str | None = None):
  variant, cpu = parse_game_preset(preset)
  return game_config("sokoban", dict(height=6, width=6, num_boxes=1), 2 if cpu else 4, variant,
                     cpu)
