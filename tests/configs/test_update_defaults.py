"""Each paper config's updates per rollout, old log-probs and learner temperature (issue 11,
items 1 and 7), and the refusal of off-policy updates for MAGRPO's REINFORCE.

Values from the papers' public code: PettingLLMs `ppo_mini_batch_size: 16`, `ppo_epochs: 1` and
"recompute old_log_probs"; verl-agent's DrMAS scripts `ppo_mini_update_num=1` (one update per
agent batch) with verl's recomputed old log-probs; MARFT's launch script `--num_mini_batch 1
--ppo_epoch 1` and log_softmax(logits) (temperature 1); CoMLRL's MAGRPO on-policy at temperature 1.
"""

from __future__ import annotations

import importlib

import pytest

from marl_jax.training import config as config_lib

WANT = {  # (mini_batch_size, epochs, recompute_old_logp, learner_temperature)
    "atgrpo_math": (16, 1, True, None),
    "atgrpo_code": (16, 1, True, None),
    "atgrpo_sokoban": (16, 1, True, None),
    "drmas_math": (None, 1, True, None),
    "drmas_search": (None, 1, True, None),
    "marft_math": (None, 1, True, 1.0),
    "magrpo_tldr": (None, 1, False, 1.0),
    "magrpo_arxiv": (None, 1, False, 1.0),
    "magrpo_humaneval": (None, 1, False, 1.0),
}


@pytest.mark.parametrize("name", sorted(WANT))
def test_paper_update_settings(name):
  c = importlib.import_module(f"configs.{name}").get_config(None)
  t = c.train
  assert (t.mini_batch_size, t.epochs, t.recompute_old_logp, t.learner_temperature) == WANT[name]
  assert t.tis_cap is None
  config_lib.build(c)


def test_learner_temperature_defaults_to_sampling():
  c = importlib.import_module("configs.drmas_math").get_config(None)
  c.sampling.temperature = 0.6
  assert config_lib.learner_temperature(c) == 0.6
  c.sampling.temperature = 0.0  # greedy sampling: log-probs at temperature 1
  assert config_lib.learner_temperature(c) == 1.0
  c = importlib.import_module("configs.magrpo_tldr").get_config(None)
  assert c.sampling.temperature == 0.7 and config_lib.learner_temperature(c) == 1.0


@pytest.mark.parametrize("field, value", [("epochs", 2), ("mini_batch_size", 8)])
def test_magrpo_refuses_off_policy_updates(field, value):
  c = importlib.import_module("configs.magrpo_tldr").get_config(None)
  c.train[field] = value
  with pytest.raises(ValueError, match="'reinforce' is on-policy .* expected 1 and None"):
    config_lib.build(c)
