"""See the samples (issue 41 item 4): every `logging.samples_every` steps the trainer writes a
table of a few episodes (prompt tail, reply, parsed action, reward, advantage) to the metrics
writer and to `samples/step{N}.md`.

References written here: the rollout's own samples (recorded from `Run.rollout`), the test env's
action parse, and GRPO's advantage re-derived in NumPy, (r - mean_g) / (std_g + eps) over each
problem's samples (docs/papers.md section 1; `AdvantageConfig` defaults: population std,
eps 1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest

import toy_task
from marl_jax.envs import base as envs_base
from marl_jax.training import metrics, samples, trainer
from marl_jax.workflows import registry

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest

ENV = "toy_action_pair"


def first_word(text: str) -> str | None:
  """The test env's action: the reply's first word, None for a blank reply."""
  words = text.split()
  return words[0] if words else None


class ActionPairEnv(toy_task.PairEnv):
  """The toy pair (two agents, vowel-fraction rewards) whose step reports a parsed action."""

  def clone(self):
    return ActionPairEnv(self.seed, self.turn)

  def step(self, agent, response):
    result = super().step(agent, response)
    word = first_word(response or "")
    return envs_base.StepResult(agent, None if word is None else (word,), result.rewards,
                                result.done, {"format_error": word is None})


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  registry.register(ENV, envs_base.Task(
      lambda *, seed: ActionPairEnv(seed),
      {"mas": envs_base.Workflow(("first", "second"), max_turns=1, fixed_turns=True)},
      lambda v, t, seed: dict(seed=seed)), replace=True)
  return tiny_model_dir


class Recorder(metrics.MetricWriter):
  """A writer that keeps the tables it receives (as the wandb backend would log them)."""

  def __init__(self):
    self.tables = []

  def write_scalars(self, step, scalars):
    del step, scalars

  def write_hparams(self, hparams):
    del hparams

  def write_summary(self, summary):
    del summary

  def write_table(self, step, name, columns, rows):
    self.tables.append((step, name, tuple(columns), [tuple(r) for r in rows]))


def grpo(rewards: np.ndarray, groups: np.ndarray, eps: float = 1e-6) -> np.ndarray:
  r = rewards.astype(np.float32).astype(np.float64)  # the batch holds float32 rewards
  return np.array([(r[i] - r[groups == g].mean()) / (r[groups == g].std() + eps)
                   for i, g in enumerate(groups)])


def test_trainer_writes_the_samples_of_every_nth_step(model_dir, tmp_path, monkeypatch):
  """2 steps, samples_every=2, samples_episodes=2 of a two-agent team whose agents sample with
  their own budgets (first: 3 new tokens at temperature 0.7; second: the global 8): only step 2
  has a page; it holds episodes (problem 0, trajectories 0 and 1), one row per agent, each with
  the reply, the action the env parsed from it, the reward of the rollout's sample and its GRPO
  advantage over its problem's 8 samples; the writer received the same table."""
  c = toy_task.toy_config(model_dir, steps=2)
  c.env.name, c.env.workflow = ENV, "mas"
  c.eval.every = 10  # the last step still evaluates
  c.logging.samples_every, c.logging.samples_episodes = 2, 2
  c.sampling.per_agent.first.max_new_tokens = 3
  c.sampling.per_agent.first.temperature = 0.7
  rollouts = []
  real_rollout = trainer.Run.rollout
  monkeypatch.setattr(trainer.Run, "rollout",
                      lambda run, *args: rollouts.append(real_rollout(run, *args)) or rollouts[-1])
  recorder = Recorder()
  real_writer = trainer.make_writer
  monkeypatch.setattr(trainer, "make_writer", lambda *a, **k: metrics.MultiWriter(
      [real_writer(*a, **k), recorder]))
  trainer.train(c, str(tmp_path))

  assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step2.md"]
  step2 = rollouts[1].samples
  # Each agent kept its own budget (the rollout honours sampling.per_agent).
  for s in [s for r in rollouts for s in r.samples]:
    assert len(s.generation.token_ids) <= {"first": 3, "second": 8}[s.agent]
  assert max(len(s.generation.token_ids) for s in step2 if s.agent == "second") > 3
  rows = toy_task.read_samples_page(tmp_path / "samples" / "step2.md")
  assert [(r["problem"], r["trajectory"], r["agent"]) for r in rows] == [
      ("0", "0", "first"), ("0", "0", "second"), ("0", "1", "first"), ("0", "1", "second")]
  advantages = grpo(np.array([s.reward for s in step2]), np.array([s.problem_id for s in step2]))
  by_key = {(s.problem_id, s.traj_id, s.turn, s.agent): (s, a)
            for s, a in zip(step2, advantages)}
  assert len(by_key) == len(step2)
  for row in rows:
    s, want = by_key[(int(row["problem"]), int(row["trajectory"]), int(row["turn"]),
                      row["agent"])]
    assert row["reply"] == s.generation.text
    assert s.action == first_word(s.generation.text)  # carried from the env's StepResult
    assert row["action"] == (s.action or "")
    np.testing.assert_allclose(float(row["reward"]), s.reward, rtol=1e-5)
    np.testing.assert_allclose(float(row["advantage"]), want, rtol=1e-4, atol=1e-5)
    assert row["in_loss"] == "yes" and row["selected"] == "yes"
    assert s.messages[-1]["content"].endswith(row["prompt_tail"])
  assert np.ptp(advantages) > 0.1  # the rewards differ: the advantages are not all 0

  (step, name, columns, table), = recorder.tables
  assert (step, name, columns) == (2, samples.TABLE, samples.COLUMNS)
  assert [(r[0], r[1], r[3], r[7], r[8]) for r in table] == [
      (int(r["problem"]), int(r["trajectory"]), r["agent"], r["reply"], r["action"] or None)
      for r in rows]
  for r in table:
    s, want = by_key[(r[0], r[1], r[2], r[3])]
    np.testing.assert_allclose(r[11], want, rtol=1e-5, atol=1e-6)
    assert r[9] == s.reward


@pytest.mark.parametrize("result, want", [
    (envs_base.StepResult("plan", ("U", "R"), {}, False, {}), "U, R"),
    (envs_base.StepResult("solver", None, {}, False, {"answer": "42", "format_error": False}),
     "42"),
    (envs_base.StepResult("verifier", None, {}, False, {"verdict": "approve"}), "approve"),
    (envs_base.StepResult("coordinator", None, {}, False,
                          {"decision": "stop", "format_error": True}), None),
    (envs_base.StepResult("coder", None, {}, False, {"gt_pass_ratio": 1.0}), None),
])
def test_parsed_action_is_the_envs_actions_or_its_parsed_value(result, want):
  assert envs_base.parsed_action(result) == want


def test_wandb_offline_logs_the_table(tmp_path, monkeypatch):
  """The wandb backend logs a wandb.Table with the columns and rows at the step (offline: no
  account or network)."""
  import wandb
  monkeypatch.delenv("WANDB_MODE", raising=False)
  monkeypatch.setenv("WANDB_API_KEY", "")
  writer = metrics.WandbWriter(tmp_path, mode="offline", project="marl_jax")
  logged = []
  real = writer._run.log  # pylint: disable=protected-access
  writer._run.log = lambda data, step: logged.append((data, step)) or real(data, step=step)
  rows = [(0, 0, 0, "first", 0, True, "tail", "reply", None, 0.5, 0.0, 1.25, True)]
  writer.write_table(3, samples.TABLE, samples.COLUMNS, rows)
  writer.close()
  (data, step), = logged
  table = data[samples.TABLE]
  assert step == 3 and isinstance(table, wandb.Table)
  assert tuple(table.columns) == samples.COLUMNS and [tuple(r) for r in table.data] == rows
