"""Trainer: end to end on a tiny model, exact resume after SIGKILL, config errors before compute."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import host
import toy_task
from marl_jax.algos import logprobs
from marl_jax.traces import store
from marl_jax.training import config as config_lib
from marl_jax.training import trainer
from marl_jax.training.metrics import read_metrics
from marl_jax.workflows.rollout import Generation, Sample

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest

STEPS = 4


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  toy_task.register()  # conftest's registration may have been replaced by another module's
  return tiny_model_dir


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="disabled")
  env["XLA_FLAGS"] = host.SUITE_XLA_FLAGS  # one device, as in a plain run
  return env


def _worker(model_dir, workdir):
  """A training process rolling out through the continuous engine (the static one's resumes are
  the in-process tests'); the runs beside `workdir` share compiled programs through one cache
  (the resumed run loads the programs the others built, as a restarted job on a cluster would)."""
  env = dict(_env(), JAX_COMPILATION_CACHE_DIR=str(workdir.parent / "xla_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return toy_task.start_worker(model_dir, workdir, STEPS, "--engine=continuous", env=env)


def _by_step(workdir):
  return {r["step"]: {k: v for k, v in r.items() if not k.startswith("time/")}
          for r in read_metrics(workdir)}


def test_sigkill_and_restart_continues_exactly(model_dir, tmp_path):
  straight = _worker(model_dir, tmp_path / "straight")
  assert straight.wait(timeout=600) == 0, straight.stderr.read().decode()[-2000:]
  toy_task.kill_after_checkpoint(_worker(model_dir, tmp_path / "killed"), tmp_path / "killed", 2)
  resumed = _worker(model_dir, tmp_path / "killed")
  assert resumed.wait(timeout=600) == 0, resumed.stderr.read().decode()[-2000:]
  want, got = _by_step(tmp_path / "straight"), _by_step(tmp_path / "killed")
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  for step in range(3, STEPS + 1):
    assert got[step] == want[step], f"step {step} differs after the resume"
  # The toy reward moves: the run really trains (params change, losses are not all zero).
  assert any(abs(want[s]["train/loss"]) > 0 for s in want)


def test_end_to_end_outputs(model_dir, tmp_path):
  c = toy_task.toy_config(model_dir, steps=2)
  c.logging.learning_curve = True  # the default; toy_config turns it off for speed
  summary = trainer.train(c, str(tmp_path))
  assert summary["steps"] == 2 and "eval/accuracy" in summary
  for name in ("metrics.jsonl", "learning_curve.png", "summary.md", "summary.json",
               "config.json", "traces/eval_step2.jsonl"):
    assert (tmp_path / name).exists(), name
  from marl_jax.traces import replay, store
  from marl_jax.traces.schema import validate
  traces = [t for _, t in store.iter_traces(tmp_path / "traces" / "eval_step2.jsonl")]
  content = store.read_content(tmp_path / "traces" / "eval_step2.jsonl")
  assert len(traces) == 2
  for t in traces:
    validate(t)
    assert replay.replay(t, content) == []  # the recorded rewards follow from the stored text


@pytest.mark.parametrize("field, value, message", [
    ("algo.estimator", "grpoo", "unknown estimator 'grpoo'"),
    ("env.name", "chess", "config.env.name='chess'"),
    ("env.workflow", "mas", "unknown workflow 'mas' for environment 'toy_vowels'"),
    ("policy.kind", "lora", "gives every role its own policy, .* expected kind='shared'"),
    ("rollout.k", 0, "config.rollout.k=0"),
    ("model", "/no/such/model", "neither a known preset"),
    ("eval.top_p", 1.5, r"config.eval.top_p=1.5; expected a number in \(0, 1\]"),
    ("train.epochs", 0, "config.train.epochs=0; expected an integer >= 1"),
    ("train.mini_batch_size", 0, "config.train.mini_batch_size=0; expected an integer >= 1"),
    ("train.logits_chunk", 0, "config.train.logits_chunk=0; expected an integer >= 1 or None"),
    ("train.tis_cap", 2.0, "config.train.tis_cap=2.0 needs .*recompute_old_logp=True"),
    ("train.learner_temperature", 0.0, "config.train.learner_temperature=0.0; expected a finite"),
    ("train.learner_temperature", 0.5, "differs from the sampling temperature 1.0"),
    ("train.agents", "writer,critic", r"train.agents='writer,critic' names \['critic'\]; "
     r"expected comma-separated agents of \['writer'\]"),
])
def test_bad_config_fails_before_compute(model_dir, field, value, message):
  c = toy_task.toy_config(model_dir, steps=1)
  group, _, name = field.rpartition(".")
  (c[group] if group else c)[name] = value
  with pytest.raises(ValueError, match=message):
    config_lib.build(c)


def test_agent_grad_norms_are_logged(model_dir, tmp_path):
  """train.agent_grad_norms logs `agent/grad_norm/<agent>`. The toy team is one agent whose
  loss share, normalised by its own tokens, is the whole loss (no entropy or KL term), so its
  gradient norm is the step's pre-clip norm; without the option nothing is logged."""
  c = toy_task.toy_config(model_dir, steps=1)
  c.train.agent_grad_norms = True
  trainer.train(c, str(tmp_path / "on"))
  (row,) = read_metrics(tmp_path / "on")
  assert row["train/grad_norm"] > 0
  np.testing.assert_allclose(row["agent/grad_norm/writer"], row["train/grad_norm"], rtol=1e-5)
  trainer.train(toy_task.toy_config(model_dir, steps=1), str(tmp_path / "off"))
  assert not any(k.startswith("agent/grad_norm") for k in read_metrics(tmp_path / "off")[0])
  # toy_config's logging.learning_curve=False: the run ends with its summary and no PNG.
  assert (tmp_path / "off" / "summary.md").exists()
  assert not (tmp_path / "off" / "learning_curve.png").exists()


def test_cli_reports_config_errors_in_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=configs/atgrpo_plan_path.py:cpu",
       f"--workdir={tmp_path}", "--config.algo.estimator=nope"],
      env=_env(), capture_output=True, text=True, timeout=300,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].startswith("error: config.algo: unknown estimator")
  typo = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=configs/atgrpo_plan_path.py:cpu",
       f"--workdir={tmp_path}", "--config.algo.estimatr=grpo"],
      env=_env(), capture_output=True, text=True, timeout=300,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert typo.returncode != 0 and "estimatr" in typo.stderr


def test_mini_batch_updates_resume_exactly(model_dir, tmp_path):
  """PPO mini-batches x epochs: the shuffles come from (run key, step), so a run resumed from
  its step-2 checkpoint repeats step 3 of an uninterrupted run bit for bit; every step made
  2 epochs x 2 mini-batches of 8 (16 samples) and the later updates moved the ratio off 1."""

  def config(steps):
    c = toy_task.toy_config(model_dir, steps)
    c.rollout.problems_per_step = 4
    c.train.mini_batch_size, c.train.epochs = 8, 2
    return c

  trainer.train(config(3), str(tmp_path / "straight"))
  trainer.train(config(2), str(tmp_path / "resumed"))
  trainer.train(config(3), str(tmp_path / "resumed"))
  want, got = _by_step(tmp_path / "straight"), _by_step(tmp_path / "resumed")
  assert sorted(got) == sorted(want) == [1, 2, 3]
  assert got[3] == want[3], "step 3 differs after the resume"
  assert all(want[s]["train/updates"] == 4 for s in want)
  assert any(abs(want[s]["train/ratio"] - 1.0) > 1e-3 for s in want)
  # Resuming under a config that changes the computation is refused, naming the change,
  # and leaves the workdir as it was.
  changed = config(4)
  changed.optim.lr *= 2
  before = sorted(os.listdir(tmp_path / "resumed" / "checkpoints"))
  with pytest.raises(config_lib.UserInputError,
                     match=rf"another config \(optim.lr: {config(4).optim.lr!r} -> "
                           rf"{changed.optim.lr!r}\)"):
    trainer.train(changed, str(tmp_path / "resumed"))
  assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == before


def test_shared_prompts_train_like_unshared(model_dir, tmp_path, monkeypatch):
  """train.share_prompts computes each group's prompt once in the learner's forwards (and
  train.logits_chunk=4 slices the 16-position LM head): one problem x K = 16 samples on 8
  devices, so the recompute pass and the update (2 rows per device) run one prompt row per
  device. They give the train metrics of an unshared, unsliced run to float32 rounding (as
  tests/parallel/test_multihost compares runs whose programs differ), from the same rollout.
  One update: after an AdamW step, rounding-level gradient differences in near-zero components
  move params by up to lr, so later updates are not comparable."""

  def config(share):
    c = toy_task.toy_config(model_dir, steps=1)
    c.rollout.problems_per_step, c.rollout.k = 1, 16
    c.train.recompute_old_logp = True
    c.train.share_prompts, c.train.logits_chunk = share, 4 if share else None
    return c

  trainer.train(config(False), str(tmp_path / "unshared"))
  shared_calls = []  # num_prompts of each shared forward traced
  inner = logprobs._shared_prompt_hidden
  monkeypatch.setattr(logprobs, "_shared_prompt_hidden", lambda *a, **k: shared_calls.append(
      a[-1]) or inner(*a, **k))
  trainer.train(config(True), str(tmp_path / "shared"))
  assert shared_calls and set(shared_calls) == {1}
  want, got = _by_step(tmp_path / "unshared"), _by_step(tmp_path / "shared")
  assert {k: v for k, v in got[1].items() if k.startswith("rollout/")} == {
      k: v for k, v in want[1].items() if k.startswith("rollout/")}
  for key, value in want[1].items():
    if key.startswith("train/"):
      np.testing.assert_allclose(got[1][key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def _eval_texts(run, step):
  """The texts (prompts and replies) of `run`'s evaluation at `step`: {content hash: text}."""
  run.evaluate(step)
  return store.read_content(os.path.join(run.workdir, "traces", f"eval_step{step}.jsonl"))


def test_evaluations_share_one_key_stream(model_dir, tmp_path):
  """Every evaluation of a run draws with the same keys (common random numbers), so two
  evaluations of the same params at different steps sample the same replies, and a curve's
  step-to-step difference is the policy's. The draw is a real sample: another seed's differs."""
  c = toy_task.toy_config(model_dir, steps=1)
  c.eval.temperature, c.eval.k = 1.0, 2
  run = trainer.Run(c, str(tmp_path / "seed0"), trains=False)
  at_0, at_3 = _eval_texts(run, 0), _eval_texts(run, 3)
  assert at_0 and at_0 == at_3
  c.seed = 1
  assert _eval_texts(trainer.Run(c, str(tmp_path / "seed1"), trains=False), 0) != at_0


def _sample(agent, finish_reason):
  return Sample(problem_id=0, traj_id=0, turn=0, agent=agent, agent_id=0, policy_id=0, branch=0,
                parent=-1, messages=[], generation=Generation("reply", (1,), (2, 3), (-0.5, -0.5),
                                                               finish_reason), reward=1.0)


def test_overlong_filter_masks_truncated_replies_only():
  """train.overlong_filter leaves a reply the token budget cut off (finish reason "length") out of
  the loss, keeping its reward; replies ended by a stop token or string, and every reply without
  the filter, train; an agent outside train.agents never does."""
  samples = [_sample("writer", "length"), _sample("writer", "stop_token"),
             _sample("writer", "stop_string"), _sample("critic", "stop_token")]
  agents = frozenset({"writer"})
  assert [s.trained for s in trainer.trained_samples(samples, agents)] == [True, True, True, False]
  filtered = trainer.trained_samples(samples, agents, overlong_filter=True)
  assert [s.trained for s in filtered] == [False, True, True, False]
  assert [s.reward for s in filtered] == [1.0] * 4


def test_overlong_filter_trains_on_the_finished_replies(model_dir, tmp_path, monkeypatch):
  """End to end: the update's loss has tokens of the rollout's finished replies only; the share
  of truncated ones is `rollout/truncated`. The toy's random model never ends a reply in its 8
  tokens; a stop string ends some."""
  batches = []
  run_updates = trainer.update.run

  def recording(fns, cfg, state, frozen, batch, *args):
    batches.append(jax.device_get(batch))
    return run_updates(fns, cfg, state, frozen, batch, *args)

  monkeypatch.setattr(trainer.update, "run", recording)
  c = toy_task.toy_config(model_dir, steps=1)
  c.train.overlong_filter, c.sampling.stop = True, ("y",)
  trainer.train(c, str(tmp_path))
  (row,), (batch,) = read_metrics(tmp_path), batches
  samples = c.rollout.problems_per_step * c.rollout.k
  assert 0 < row["rollout/truncated"] < 1
  s = batch.samples
  assert s.sample_mask.sum() == samples
  assert s.token_mask.any(axis=-1).sum() == round(samples * (1 - row["rollout/truncated"]))
