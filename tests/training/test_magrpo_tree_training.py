"""The trainer on a MAGRPO joint-action tree: a two-turn, two-agent toy task, G = 2 (item 4).

Checks that the trainer's batch ids follow the rollout's tree: per problem G + G^2 = 6 joint
actions (nodes), and the advantages are not all zero after turn 0.
"""

from __future__ import annotations

import pytest

import toy_task
from marl_jax.envs import base as envs_base
from marl_jax.training import trainer
from marl_jax.training.metrics import read_metrics
from marl_jax.workflows import registry

NAME = "toy_vowels_duo"


class _DuoVowels:
  """'a' then 'b' reply each turn for two turns; b's step pays both the vowel fraction of the
  turn's two replies together."""

  agents = ("a", "b")

  def __init__(self, seed: int, turn: int = 0, first: str = "", reward: float = 0.0):
    self.seed, self.turn, self.first, self.reward = seed, turn, first, reward

  done = property(lambda self: self.turn >= 2)
  solved = property(lambda self: self.reward > 0.5)

  def clone(self):
    return _DuoVowels(self.seed, self.turn, self.first, self.reward)

  def observe(self, agent):
    return envs_base.Observation(agent, self.turn, "Answer briefly.",
                                 f"Say vowels ({self.seed}, turn {self.turn}).")

  def step(self, agent, response):
    if agent == "a":
      self.first = response or ""
      return envs_base.StepResult(agent, None, {"a": 0.0}, False, {})
    text = self.first + (response or "")
    self.reward = sum(ch in "aeiouAEIOU" for ch in text) / max(len(text), 1)
    self.turn += 1
    return envs_base.StepResult(agent, None, {"a": self.reward, "b": self.reward}, self.done, {})


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  registry.register(NAME, envs_base.Task(
      lambda *, seed: _DuoVowels(seed),
      {"duo": envs_base.Workflow(("a", "b"), max_turns=2, fixed_turns=True)},
      lambda v, t, seed: dict(seed=seed)), replace=True)
  return tiny_model_dir


def test_magrpo_tree_trains_with_one_node_per_joint_action(model_dir, tmp_path):
  c = toy_task.toy_config(model_dir, steps=1)
  c.env.name, c.env.workflow, c.env.max_turns = NAME, "duo", 2
  c.rollout.mode, c.rollout.k, c.rollout.problems_per_step = "magrpo_tree", 2, 1
  c.algo.estimator, c.algo.filter = "magrpo", "none"
  c.loss.policy_loss, c.loss.aggregation = "reinforce", "seq_sum"
  c.eval.every, c.eval.num_problems = 10, 1
  trainer.train(c, str(tmp_path))
  train = [r for r in read_metrics(tmp_path) if "train/loss" in r]
  assert len(train) == 1
  metrics = train[0]
  nodes = [v for k, v in metrics.items() if k.endswith("nodes")]
  assert nodes and all(v == 2 + 2 * 2 for v in nodes), metrics
  assert any(k.endswith("adv_std") and v > 0 for k, v in metrics.items()), metrics
