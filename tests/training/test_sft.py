"""Supervised warm-start (training/sft.py): demonstrations as the sampler would tokenise them, the
rejection of failed episodes, the warm-start's loss against transformers (PyTorch), the stage in a
trainer run, the rows without RL that evaluate the warm-started policy, spawning teams' episodes,
its one-line refusals, and the warm-start's checkpoint 0 (resumed, and forked with `init_from`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

import toy_task
from configs import (atgrpo_plan_path, atgrpo_sokoban, drmas_math, orchestration_spawn,
                     orchestration_stop)
from marl_jax.envs.math import answers as math_answers
from marl_jax.errors import UserInputError
from marl_jax.parallel.policies import PolicyConfig
from marl_jax.traces import store
from marl_jax.models import config as model_config
from marl_jax.models.loading import load_model
from marl_jax.training import config as config_lib
from marl_jax.training import evaluation, preflight, setup, sft, trainer
from marl_jax.training.checkpoint import Checkpointer, saved_steps
from marl_jax.training.llm_policy import prompt_ids
from marl_jax.training.metrics import read_metrics
from marl_jax.workflows.rollout import RolloutConfig

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  return tiny_model_dir


@pytest.fixture(scope="module")
def tokenizer():
  return toy_task.embedded_tokenizer()  # the embedded GGUF tokenizer, built once per process


def _config(model_dir, preset="cpu"):
  c = atgrpo_plan_path.get_config(preset)
  c.model = model_dir
  c.sampling.max_new_tokens = 8
  c.sft.steps, c.sft.problems_per_step, c.sft.lr = 2, 2, 1e-2
  c.train.steps, c.eval.num_problems, c.eval.at_start = 1, 2, True
  toy_task.quiet_logging(c)
  return c


def _demonstrations(c, tokenizer, seeds):
  built = config_lib.build(c)
  policy = PolicyConfig(models=(model_config.get_preset("tiny-llama"),))
  problems = setup.problems(c, seeds, c.sft.problems_per_step)
  return sft.demonstrations(problems, built.spec, sft.Demonstrator(policy, [tokenizer]),
                            RolloutConfig())


def test_demonstrations_are_tokenised_as_the_sampler_would(model_dir, tokenizer):
  c = _config(model_dir)
  samples, metrics = _demonstrations(c, tokenizer, sft.first_seed(c, 0))
  assert metrics["sft/solved"] == 1.0
  n = c.sft.problems_per_step
  assert sorted((s.problem_id, s.agent) for s in samples) == sorted(
      (i, a) for i in range(n) for a in ("tool", "plan"))
  for s in samples:
    assert s.generation.prompt_ids == tuple(prompt_ids(tokenizer, s.messages))
    assert s.generation.token_ids == (*tokenizer.encode(s.generation.text),
                                      tokenizer.end_of_reply_id)
    assert s.generation.text.startswith("```python" if s.agent == "tool" else "#### [")
  assert metrics["sft/reply_tokens"] == np.mean([len(s.generation.token_ids) for s in samples])


def test_failed_demonstration_episodes_are_dropped(model_dir, tokenizer, monkeypatch):
  """Rejection sampling: an episode that does not solve its problem gives no samples."""
  from marl_jax.envs.games.env import GameEnv
  c = _config(model_dir)
  right = GameEnv.demonstration
  wrong_once = {"left": 1}

  def demonstration(self, agent):
    if agent == "plan" and wrong_once["left"]:
      wrong_once["left"] -= 1
      return "#### []"
    return right(self, agent)

  monkeypatch.setattr(GameEnv, "demonstration", demonstration)
  samples, metrics = _demonstrations(c, tokenizer, sft.first_seed(c, 0))
  assert metrics["sft/solved"] == 0.5
  assert len(samples) == 2 and {s.problem_id for s in samples} == {1}


def _math_demonstrations(model_dir, tokenizer, workflow, rate, n):
  """(problems, kept samples, metrics) of n demonstration episodes of a math team."""
  c = (drmas_math if workflow == "drmas" else orchestration_stop).get_config("cpu")
  c.model = model_dir
  c.sft.steps, c.sft.problems_per_step, c.sft.mistake_rate = 1, n, rate
  built = config_lib.build(c)
  policy = PolicyConfig(models=(model_config.get_preset("tiny-llama"),))
  problems = setup.problems(c, sft.first_seed(c, 0), n)
  return (problems, *sft.demonstrations(
      problems, built.spec, sft.Demonstrator(policy, [tokenizer], rate), RolloutConfig()))


@pytest.mark.parametrize("workflow", ["drmas", "learned_stop"])
def test_demonstrations_recover_from_mistakes(model_dir, tokenizer, workflow):
  """mistake_rate 1: every episode opens with the solver's mistake, which is not trained on; the
  kept samples are the recovery: the verifier rejects it (the coordinator asks for another
  round), the solver then answers right in a prompt that shows its mistake, and the loop ends
  (learned_stop: on an approval and a stop)."""
  problems, samples, metrics = _math_demonstrations(model_dir, tokenizer, workflow, 1.0, 3)
  assert metrics["sft/solved"] == 1.0 and metrics["sft/mistakes"] == 1.0
  expected = [("verifier", 0, "reject"), ("solver", 1, None)]
  if workflow == "learned_stop":
    expected[1:] = [("coordinator", 0, "#### continue"), ("solver", 1, None),
                    ("verifier", 1, "approve"), ("coordinator", 1, "#### stop")]
  for problem in problems:
    episode = [s for s in samples if s.problem_id == problem.problem_id]
    assert [(s.agent, s.turn) for s in episode] == [(a, t) for a, t, _ in expected]
    math_problem = problem.make().problem
    # the mistake's answer, then the right one: what the verifier restates in its check
    proposed = [math_answers.last_boxed(math_problem.mistake()), math_problem.answer]
    for s, (agent, turn, text) in zip(episode, expected):
      assert s.generation.token_ids == (*tokenizer.encode(s.generation.text),
                                        tokenizer.end_of_reply_id)
      if agent == "verifier":
        text = (f"Proposed answer: {proposed[turn]}. Checking: {math_problem.solution}.\n"
                f"<verify>{text}</verify>")
      assert s.generation.text == (text or math_problem.demonstration())
      if agent == "solver":  # its prompt shows the mistake it recovers from
        assert math_problem.mistake() in s.messages[-1]["content"]
  _, plain, metrics = _math_demonstrations(model_dir, tokenizer, workflow, 0.0, 3)
  agents = ("solver", "verifier") + (("coordinator",) if workflow == "learned_stop" else ())
  assert metrics["sft/mistakes"] == 0.0
  assert sorted((s.problem_id, s.agent, s.turn) for s in plain) == sorted(
      (p, a, 0) for p in range(3) for a in agents)
  _, _, metrics = _math_demonstrations(model_dir, tokenizer, workflow, 0.5, 16)
  assert 0.0 < metrics["sft/mistakes"] < 1.0 and metrics["sft/solved"] == 1.0


@pytest.mark.parametrize("decision", ["count", "delegate", "checked"])
def test_spawning_teams_demonstrate_every_call(model_dir, tokenizer, decision):
  """A spawning team's demonstration episode trains every call it makes: the dispatcher's
  decision, each worker it spawned and the aggregator, each on its demonstration."""
  c = orchestration_spawn.get_config(f"{decision},cpu")
  c.model = model_dir
  c.sft.steps, c.sft.problems_per_step = 1, 4
  built = config_lib.build(c)
  policy = PolicyConfig(models=(model_config.get_preset("tiny-llama"),))
  problems = setup.problems(c, sft.first_seed(c, 0), 4)
  samples, metrics = sft.demonstrations(problems, built.spec,
                                        sft.Demonstrator(policy, [tokenizer]), RolloutConfig())
  assert metrics["sft/solved"] == 1.0
  for problem in problems:
    env = problem.make()
    workers = env.choose(env.demonstration("dispatcher"))
    episode = [s for s in samples if s.problem_id == problem.problem_id]
    assert sorted(s.agent for s in episode) == sorted(("dispatcher", *workers, "aggregator"))
    for s in episode:
      assert s.generation.text == env.demonstration(s.agent)
      assert s.generation.token_ids == (*tokenizer.encode(s.generation.text),
                                        tokenizer.end_of_reply_id)


def _torch_nll(model, samples):
  """Token-mean -log p of every demonstrated reply token, transformers in float64 sums."""
  total, count = 0.0, 0
  for s in samples:
    prompt, reply = list(s.generation.prompt_ids), list(s.generation.token_ids)
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
      logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(reply)[:, None])[:, 0]
    total, count = total - float(logp.sum()), count + len(reply)
  return total / count


def test_warm_start_in_a_trainer_run(model_dir, tokenizer, tmp_path):
  """Step 0 logs the policy before (pretrained/) and after (eval/) the warm-start; the warm-start's
  first loss is the demonstrations' NLL under the pretrained weights (transformers reference, at
  temperature 1 although RL samples at 0.6: a demonstration is not a sample of the policy), and
  at lr 1e-2 the second step's demonstrations already cost less."""
  c = _config(model_dir)
  c.sampling.temperature = 0.6
  trainer.train(c, str(tmp_path))
  step0 = next(r for r in read_metrics(str(tmp_path)) if r["step"] == 0)
  assert {"pretrained/accuracy", "eval/accuracy", "sft/loss", "sft/first_loss"} <= set(step0)
  assert step0["sft/solved"] == 1.0 and step0["sft/steps"] == 2
  assert (tmp_path / "traces" / "pretrained_step0.jsonl").exists()
  assert (tmp_path / "traces" / "eval_step0.jsonl").exists()
  first, _ = _demonstrations(c, tokenizer, sft.first_seed(c, 0))
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  np.testing.assert_allclose(step0["sft/first_loss"], _torch_nll(model, first), rtol=1e-4)
  assert step0["sft/loss"] < step0["sft/first_loss"] - 1.0


def test_a_row_without_rl_evaluates_the_warm_started_policy(model_dir, tmp_path):
  """The game table's "MAS (no RL)" row at cpu scale is the policy the "MAS + AT-GRPO" row starts
  RL from: evaluating it in an empty workdir warm-starts first, and replies exactly as the RL
  run's step-0 evaluation (same seed) does, not as the pretrained model."""
  rl = _config(model_dir, "mas_shared,cpu")
  trainer.train(rl, str(tmp_path / "rl"))
  step0 = next(r for r in read_metrics(str(tmp_path / "rl")) if r["step"] == 0)
  result = evaluation.evaluate_checkpoint(_config(model_dir, "mas_norl,cpu"),
                                         str(tmp_path / "norl"))
  assert result["step"] == 0 and result["sft/steps"] == 2
  assert result["sft/first_loss"] == step0["sft/first_loss"]
  assert result["eval/accuracy"] == step0["eval/accuracy"]
  replies = {name: store.read_content(tmp_path / name / "traces" / f"{prefix}_step0.jsonl")
             for name, prefix in (("rl", "eval"), ("norl", "evaluate"))}  # trainer, evaluate
  pretrained = store.read_content(tmp_path / "rl" / "traces" / "pretrained_step0.jsonl")
  assert replies["norl"] == replies["rl"] != pretrained


def test_refusals(model_dir, tmp_path):
  c = atgrpo_sokoban.get_config("cpu")
  c.sft.steps = 1
  with pytest.raises(UserInputError, match=r"env 'sokoban' has none for agents \['tool'\]"):
    preflight.check(c, str(tmp_path))
  for field, value, match in (("steps", -1, "config.sft.steps=-1; expected an integer >= 0"),
                              ("lr", 0.0, "config.sft.lr=0.0; expected a finite number > 0"),
                              ("problems_per_step", 0, "config.sft.problems_per_step=0"),
                              ("mistake_rate", 1.5,
                               r"config.sft.mistake_rate=1.5; expected a number in \[0, 1\]")):
    c = _config(model_dir)
    c.sft[field] = value
    with pytest.raises(UserInputError, match=match):
      config_lib.build(c)
  c = _config(model_dir)
  c.sft.steps, c.sft.mistake_rate = 0, 0.5
  with pytest.raises(UserInputError, match=r"mistake_rate=0.5 without a warm-start"):
    config_lib.build(c)
  c = _config(model_dir)  # Plan-Path demonstrates both roles but has no mistakes
  c.sft.mistake_rate = 0.5
  with pytest.raises(UserInputError, match=r"env 'plan_path' has none for agents \['tool', "
                                           r"'plan'\]; expected sft.mistake_rate=0"):
    preflight.check(c, str(tmp_path / "plan_path"))


def _by_step(workdir) -> dict[int, dict]:
  return {r["step"]: {k: v for k, v in r.items() if not k.startswith("time/")}
          for r in read_metrics(str(workdir))}


def _params(workdir, step: int) -> list[np.ndarray]:
  with Checkpointer(workdir / "checkpoints") as source:
    return jax.tree.leaves(source.restore(step).state["train"]["params"])


def test_warm_start_is_checkpointed_resumed_and_forked(model_dir, tmp_path, monkeypatch):
  """A run with a warm-start saves checkpoint 0 right after it and its step-0 evaluation. A
  run killed in step 1 resumes from it without warming up again and repeats the uninterrupted
  run's step 1 bit for bit; so does a fork (`init_from=WORKDIR:0`, no warm-start of its own),
  whose step-0 evaluation is the warm-started policy's."""
  c = _config(model_dir)  # 2 warm-start steps, 1 RL step, a step-0 evaluation
  trainer.train(c, str(tmp_path / "straight"))
  assert saved_steps(tmp_path / "straight") == [0, 1]

  def killed(self, step, rolled=None):
    raise RuntimeError(f"killed in step {step + 1}")

  with monkeypatch.context() as m:
    m.setattr(trainer.Run, "train_step", killed)
    with pytest.raises(RuntimeError, match="killed in step 1"):
      trainer.train(c, str(tmp_path / "resumed"))
  assert saved_steps(tmp_path / "resumed") == [0]

  def warm_start(self):
    raise AssertionError("warm-started again")

  fork = _config(model_dir)
  fork.sft.steps, fork.init_from = 0, f"{tmp_path / 'straight'}:0"
  with monkeypatch.context() as m:
    m.setattr(trainer.Run, "warm_start", warm_start)
    trainer.train(c, str(tmp_path / "resumed"))
    trainer.train(fork, str(tmp_path / "fork"))
  want = _by_step(tmp_path / "straight")
  for name in ("resumed", "fork"):
    got = _by_step(tmp_path / name)
    assert got[1] == want[1], name
    for x, y in zip(_params(tmp_path / name, 1), _params(tmp_path / "straight", 1)):
      np.testing.assert_array_equal(x, y)
  step0 = _by_step(tmp_path / "fork")[0]
  assert step0["eval/accuracy"] == want[0]["eval/accuracy"] and "sft/loss" not in step0
  replies = [store.read_content(tmp_path / name / "traces" / "eval_step0.jsonl")
             for name in ("straight", "fork")]
  assert replies[0] == replies[1]


def test_kl_reference_is_the_policy_rl_starts_from(model_dir, tmp_path, monkeypatch):
  """With `loss.kl_coef` > 0 the KL reference is the policy RL starts from: the warm-started
  params of checkpoint 0 (not the pretrained ones), in the run that warm-started, in that run
  resumed after step 1 (rebuilt from checkpoint 0) and in a fork of checkpoint 0. So step 1
  samples the reference itself: its KL is 0 up to float error."""
  c = _config(model_dir)
  c.loss.kl_coef, c.loss.kl_estimator, c.eval.at_start = 0.5, "k3", False  # no step-0 evals
  seen = {}
  train_step = trainer.Run.train_step

  def recording(self, step, rolled=None):
    seen[self.workdir, step] = jax.tree.leaves(jax.device_get(self.reference))
    return train_step(self, step, rolled)

  monkeypatch.setattr(trainer.Run, "train_step", recording)
  straight = str(tmp_path / "straight")
  trainer.train(c, straight)
  c.train.steps = 2
  trainer.train(c, straight)  # resumed from checkpoint 1
  fork = _config(model_dir)
  fork.loss.kl_coef, fork.loss.kl_estimator, fork.eval.at_start = 0.5, "k3", False
  fork.sft.steps, fork.init_from = 0, f"{straight}:0"
  trainer.train(fork, str(tmp_path / "fork"))
  with Checkpointer(tmp_path / "straight" / "checkpoints") as source:
    warm = jax.tree.leaves(source.restore(0).state["train"]["params"]["policy"])
  assert set(seen) == {(straight, 0), (straight, 1), (str(tmp_path / "fork"), 0)}
  for leaves in seen.values():
    for x, y in zip(leaves, warm, strict=True):
      np.testing.assert_array_equal(x, y)
  pretrained = jax.tree.leaves(load_model(model_dir).params)
  assert any(not np.array_equal(x, np.asarray(y)) for x, y in zip(warm, pretrained))
  for workdir in (straight, str(tmp_path / "fork")):
    assert abs(_by_step(workdir)[1]["train/kl"]) < 1e-5


def test_init_from_refusals(model_dir, tmp_path):
  """`init_from` names a saved checkpoint of a run of the same team, and replaces the
  warm-start: each refusal in one line, before any compute, or when the checkpoint is read."""
  source = _config(model_dir)
  source.sft.steps, source.train.steps, source.eval.at_start = 0, 1, False
  trainer.train(source, str(tmp_path / "source"))
  cases = [(str(tmp_path / "nothing"), 0, rf"{tmp_path / 'nothing'} has no checkpoint; expected "
                                          "a run's workdir, optionally with :STEP"),
           (f"{tmp_path / 'source'}:7", 0, r"has checkpoints \[1\], not 7"),
           (str(tmp_path / "source"), 2, r"starts from trained params, so it has no warm-start "
                                         r"of its own; expected config.sft.steps=0, got 2")]
  for value, sft_steps, message in cases:
    c = _config(model_dir)
    c.init_from, c.sft.steps = value, sft_steps
    with pytest.raises(UserInputError, match=message) as info:
      config_lib.build(c)
    assert "\n" not in str(info.value)
  other = _config(model_dir, "mas_lora,cpu")  # adapters: another params tree
  other.init_from, other.sft.steps = str(tmp_path / "source"), 0
  with pytest.raises(UserInputError, match=r"config.init_from='.*source': checkpoint 1 does not "
                                           r"fit this config's team and "
                                           r"optimizer \(.*\); expected a run of the same"):
    trainer.train(other, str(tmp_path / "other"))
