"""DAPO dynamic sampling (algo.filter="zero_variance" + rollout.max_refills) through the trainer.

The toy env rewards a reply with its vowel fraction only on seeds that are multiples of `every`;
every other seed scores 0 whatever the reply, so its group has zero reward variance. The rollouts
the trainer makes are recorded (seeds and rewards), and the expected kept problems are derived
here: the first `problems_per_step` problems, in seed order, whose recorded rewards are not all
equal.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import toy_task
from marl_jax.envs import base as envs_base
from marl_jax.training import config as config_lib
from marl_jax.training import refill, trainer
from marl_jax.training.metrics import read_metrics
from marl_jax.workflows import registry
from marl_jax.workflows.rollout import Generation, RolloutResult, Sample

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest

SPARSE = "toy_sparse_vowels"


class SparseEnv(toy_task.VowelEnv):

  def __init__(self, seed: int, every: int, turn: int = 0, reward: float = 0.0):
    super().__init__(seed, turn, reward)
    self.every = every

  def clone(self):
    return SparseEnv(self.seed, self.every, self.turn, self.reward)

  def step(self, agent, response):
    result = super().step(agent, response)
    if self.seed % self.every:
      self.reward = 0.0
      result = dataclasses.replace(result, rewards={agent: 0.0})
    return result


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  registry.register(SPARSE, envs_base.Task(
      lambda *, seed, every: SparseEnv(seed, every),
      {"single": envs_base.Workflow(("writer",), max_turns=1, fixed_turns=True)},
      lambda v, t, seed: dict(seed=seed)), replace=True)
  return tiny_model_dir


@pytest.fixture
def recorded(monkeypatch):
  """Every rollout the trainer makes: (seeds, per-problem reward lists), and every batch."""
  log = {"rollouts": [], "batches": []}
  real_rollout, real_make = trainer.rollout, trainer.make_train_step

  def rollout(problems, *args, **kwargs):
    result = real_rollout(problems, *args, **kwargs)
    rewards = {p.problem_id: [] for p in problems}
    for s in result.samples:
      rewards[s.problem_id].append(s.reward)
    log["rollouts"].append(([p.kwargs["seed"] for p in problems],
                            [rewards[p.problem_id] for p in problems]))
    return result

  def make(cfg, mesh, *args, **kwargs):
    fns = real_make(cfg, mesh, *args, **kwargs)

    def prepare(batch):  # the rollout's whole batch, once per step
      log["batches"].append(jax.device_get(batch))
      return fns.prepare(batch)

    return fns._replace(prepare=prepare)

  monkeypatch.setattr(trainer, "rollout", rollout)
  monkeypatch.setattr(trainer, "make_train_step", make)
  return log


def _config(model_dir, steps: int, every: int, max_refills: int):
  c = toy_task.toy_config(model_dir, steps)
  c.env.name = SPARSE
  c.env.kwargs.every = every
  c.algo.filter = "zero_variance"
  c.rollout.max_refills = max_refills
  c.eval.every = 100
  return c


def _expected(rollouts, n: int, max_refills: int):
  """Per step: the kept problems' reward lists and the number of rollouts, from the records."""
  steps, i = [], 0
  while i < len(rollouts):
    found, tries = [], 0
    while True:
      seeds, rewards = rollouts[i + tries]
      tries += 1
      found += [r for r in rewards if len(set(r)) > 1]
      if len(found) >= n or tries > max_refills:
        break
    steps.append((found[:n], tries))
    i += tries
  return steps


def _batch_rewards(batch) -> list[list[float]]:
  s = batch.samples
  ids = sorted(set(s.problem_id[s.sample_mask].tolist()))
  return [s.rewards[s.sample_mask & (s.problem_id == p)].tolist() for p in ids]


def test_refill_until_the_batch_holds_n_qualifying_problems(model_dir, recorded, tmp_path):
  n, refills = 2, 4
  trainer.train(_config(model_dir, 2, every=3, max_refills=refills), str(tmp_path))
  seeds = [s for seeds, _ in recorded["rollouts"] for s in seeds]
  assert seeds == list(range(len(seeds)))  # fresh, consecutive, never reused
  expected = _expected(recorded["rollouts"], n, refills)
  assert len(expected) == len(recorded["batches"]) == 2
  metrics = {r["step"]: r for r in read_metrics(str(tmp_path))}
  for step, ((kept, tries), batch) in enumerate(zip(expected, recorded["batches"])):
    assert len(kept) == n and tries > 1  # seeds 1, 2 (mod 3) never qualify: a refill happened
    got = _batch_rewards(batch)
    assert len(got) == n and [sorted(r) for r in got] == [sorted(np.float32(kept_r).tolist())
                                                          for kept_r in kept]
    m = metrics[step + 1]
    assert m["rollout/tries"] == tries and m["rollout/problems_kept"] == n
    assert m["rollout/problems_rolled"] == tries * n and m["rollout/refill_cap_hit"] == 0.0
    assert m["train/adv/groups_kept"] == n


def test_cap_trains_on_what_it_has(model_dir, recorded, tmp_path):
  n, refills = 2, 1
  trainer.train(_config(model_dir, 1, every=7, max_refills=refills), str(tmp_path))
  # Seeds 0..3 in two tries: only seed 0 can qualify.
  assert [seeds for seeds, _ in recorded["rollouts"]] == [[0, 1], [2, 3]]
  (kept, tries), = _expected(recorded["rollouts"], n, refills)
  assert tries == 2 and len(kept) == 1
  assert [sorted(r) for r in _batch_rewards(recorded["batches"][0])] == [
      sorted(np.float32(kept[0]).tolist())]
  m, = read_metrics(str(tmp_path))
  assert m["rollout/refill_cap_hit"] == 1.0 and m["rollout/problems_kept"] == 1
  assert m["rollout/qualifying_found"] == 1 and m["rollout/tries"] == 2


def test_resume_continues_the_same_seeds(model_dir, recorded, tmp_path):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  trainer.train(_config(model_dir, 3, every=3, max_refills=4), str(straight))
  want_seeds = [seeds for seeds, _ in recorded["rollouts"]]
  trainer.train(_config(model_dir, 2, every=3, max_refills=4), str(resumed))
  first = len(recorded["rollouts"]) - len(want_seeds)
  del recorded["rollouts"][:]
  trainer.train(_config(model_dir, 3, every=3, max_refills=4), str(resumed))
  # The resumed run's step 3 rolls out exactly the seeds the straight run's step 3 did.
  assert [seeds for seeds, _ in recorded["rollouts"]] == want_seeds[first:]
  drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}
  want = {r["step"]: drop(r) for r in read_metrics(str(straight))}
  got = {r["step"]: drop(r) for r in read_metrics(str(resumed))}
  assert got[3] == want[3]


def _sample(problem: int, traj: int, reward: float, turn: int = 0, parent: int = -1,
            state: int = 0) -> Sample:
  gen = Generation("x", (1,), (2,), (-0.5,), "stop")
  return Sample(problem_id=problem, traj_id=traj, turn=turn, agent="a", agent_id=0, policy_id=0,
                branch=0, parent=parent, messages=[], generation=gen, reward=reward, state=state)


def test_state_matched_groups_qualify_by_their_own_variance():
  """Problem 0's rewards differ only between states (each state's group is constant); problem
  1's vary within state 1: only problem 1 qualifies under state-matched groups."""
  samples = [_sample(0, 0, 1.0, state=1), _sample(0, 1, 1.0, state=1),
             _sample(0, 2, 0.0, state=0), _sample(1, 3, 0.0, state=1),
             _sample(1, 4, 1.0, state=1)]
  assert refill.qualifying_problems(samples, "problem_turn_agent", 0.0) == [0, 1]
  assert refill.qualifying_problems(samples, "problem_turn_agent_state", 0.0) == [1]
  with pytest.raises(ValueError, match="'turn_agent_state' pools problems"):
    refill.qualifying_problems(samples, "turn_agent_state", 0.0)


def test_select_renumbers_problems_trajectories_and_parents():
  """Tree mode (one trajectory per problem), groups (problem, turn, agent): problem 0 of try 0
  is constant at both turns; problem 1 varies at turn 1 only; try 1's problem 0 varies."""
  try0 = [_sample(0, 0, 1.0), _sample(0, 0, 1.0), _sample(1, 1, 0.0), _sample(1, 1, 0.0),
          _sample(1, 1, 0.0, turn=1, parent=2), _sample(1, 1, 1.0, turn=1, parent=2)]
  try1 = [_sample(0, 0, 0.0), _sample(0, 0, 0.5), _sample(1, 1, 1.0), _sample(1, 1, 0.3)]
  results = [RolloutResult(try0, []), RolloutResult(try1, [])]
  assert refill.qualifying_problems(try0, "problem_turn_agent", 0.0) == [1]
  assert refill.qualifying_problems(try0, "problem", 0.0) == [1]
  qualifying = [refill.qualifying_problems(r.samples, "problem_turn_agent", 0.0) for r in results]
  samples, metrics = refill.select(results, qualifying, 2, trajs_per_problem=1)
  assert [(s.problem_id, s.traj_id, s.turn, s.reward, s.parent) for s in samples] == [
      (0, 0, 0, 0.0, -1), (0, 0, 0, 0.0, -1), (0, 0, 1, 0.0, 0), (0, 0, 1, 1.0, 0),
      (1, 1, 0, 0.0, -1), (1, 1, 0, 0.5, -1)]
  assert metrics == {"rollout/tries": 2.0, "rollout/problems_rolled": 4.0,
                     "rollout/qualifying_found": 3.0, "rollout/problems_kept": 2.0,
                     "rollout/refill_cap_hit": 0.0}


def test_max_refills_errors():
  c = config_lib.base_config()
  c.rollout.max_refills = -1
  with pytest.raises(config_lib.UserInputError, match="config.rollout.max_refills"):
    config_lib.build(c)
