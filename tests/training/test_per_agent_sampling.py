"""Per-agent sampling (`config.sampling.per_agent`, issue 41 item 5): the sampler bridge honours
each agent's temperature, budget and stop strings, the config gives the rollout, evaluation and
learner each agent's settings, and bad overrides are refused in one line.

The learner's per-agent temperature against a NumPy forward: tests/parallel/test_update.py
(`test_each_agent_rows_at_its_own_temperature`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

import entry_points
import toy_task
from marl_jax.parallel import policies
from marl_jax.sampling.engine import request_key
from marl_jax.sampling.params import SamplingParams
from marl_jax.sampling.sampler import Sampler
from marl_jax.training import config as config_lib
from marl_jax.training import setup
from marl_jax.training.llm_policy import LLMPolicy, prompt_ids
from marl_jax.workflows.rollout import Request

KEY = jax.random.key(7)


@pytest.fixture(scope="module")
def tiny():
  """(PolicyConfig, sampler params, tokenizer) of the tests' tiny random model."""
  config, params, tokenizer = toy_task._tiny_model()  # pylint: disable=protected-access
  policy = policies.PolicyConfig(kind="shared", models=(config,))
  return policy, ({"policy": params}, {}), tokenizer


def _requests():
  """Two agents, interleaved, 4 copies of one prompt each (a group) plus one other prompt; each
  request with its own identity (its key)."""
  def one(agent, text, i):
    return Request([{"role": "system", "content": f"You are {agent}."},
                    {"role": "user", "content": text}], agent, None, (i, 0))
  out = []
  for i in range(4):
    out += [one("first", "Say vowels (1).", 2 * i), one("second", "Say vowels (2).", 2 * i + 1)]
  return out + [one("second", "Say vowels (3).", 8)]


def _direct(policy, params, tokenizer, requests, sampling):
  """What one sampler call at `sampling` gives these requests, each with its own key."""
  sampler = Sampler(policy.models[0], tokenizer)
  prompts = [prompt_ids(tokenizer, r.messages) for r in requests]
  keys = jax.numpy.stack([request_key(KEY, *r.ids) for r in requests])
  return sampler.generate(params[0]["policy"], prompts, sampling, keys)


def _serve(llm, requests, params):
  """The replies an LLMPolicy's Responder gives `requests` (policy 0), in request order."""
  served = llm.serve(params)
  served.submit([(i, r, 0) for i, r in enumerate(requests)])
  replies = {}
  while served.pending:
    replies.update(served.collect())
  return [replies[i] for i in range(len(requests))]


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_each_agent_samples_with_its_own_settings(tiny, monkeypatch, engine):
  """Agent "first" greedy with 3 new tokens, "second" at temperature 1.5 with 10 and a stop
  string: every reply keeps its agent's budget, the greedy group's 4 copies agree while the
  sampled group's differ, and each agent's replies are those of one sampler call of its own
  requests at its settings with each request's own key; the static engine makes exactly one
  call per setting, in the order the agents first appear, and the continuous engine mixes both
  settings in its batches and returns the same replies. The stop string (a piece of a reply
  drawn without it: the same key draws the same tokens) cuts that reply's text just before
  it."""
  policy, params, tokenizer = tiny
  default = SamplingParams(max_new_tokens=6, temperature=1.0)
  first = SamplingParams(max_new_tokens=3, temperature=0.0)
  second = SamplingParams(max_new_tokens=10, temperature=1.5)
  requests = _requests()
  by_agent = {a: [r for r in requests if r.agent == a] for a in ("first", "second")}
  plain = _direct(policy, params, tokenizer, by_agent["second"], second)
  text = plain[0].text
  assert len(text) >= 6, text
  stop = text[3:6]
  second = second.replace(stop_strings=(stop,))
  calls = []
  real = Sampler.generate
  monkeypatch.setattr(Sampler, "generate", lambda self, p, prompts, s, *a, **k: calls.append(
      (len(prompts), s)) or real(self, p, prompts, s, *a, **k))
  llm = LLMPolicy(policy, [tokenizer], default, KEY, {"first": first, "second": second},
                  engine=engine)
  got = _serve(llm, requests, params)
  assert calls == ([(4, first), (5, second)] if engine == "static" else [])
  mine = {a: [g for r, g in zip(requests, got) if r.agent == a] for a in by_agent}
  assert all(len(g.token_ids) <= 3 for g in mine["first"])
  assert all(len(g.token_ids) <= 10 for g in mine["second"])
  assert len({g.token_ids for g in mine["first"]}) == 1  # greedy: one reply for one prompt
  assert len({g.token_ids for g in mine["second"][:4]}) > 1  # sampled
  monkeypatch.setattr(Sampler, "generate", real)
  for agent, sampling in (("first", first), ("second", second)):
    want = _direct(policy, params, tokenizer, by_agent[agent], sampling)
    assert [g.token_ids for g in mine[agent]] == [tuple(int(t) for t in w.tokens) for w in want]
    assert [g.text for g in mine[agent]] == [w.text for w in want]
    assert [g.finish_reason for g in mine[agent]] == [w.finish_reason for w in want]
  cut = mine["second"][0]
  assert cut.finish_reason == "stop_string" and cut.text == text[:text.index(stop)]
  assert all(stop not in g.text for g in mine["second"])


def test_agents_that_share_settings_share_one_sampler_call(tiny, monkeypatch):
  """No override (or one equal to the default): the static engine makes one sampler call for
  every request, as before per-agent sampling existed."""
  policy, params, tokenizer = tiny
  default = SamplingParams(max_new_tokens=4, temperature=1.0)
  requests = _requests()
  calls = []
  real = Sampler.generate
  monkeypatch.setattr(Sampler, "generate", lambda self, p, prompts, s, *a, **k: calls.append(
      len(prompts)) or real(self, p, prompts, s, *a, **k))
  got = _serve(LLMPolicy(policy, [tokenizer], default, KEY, {"first": default.replace()},
                         engine="static"), requests, params)
  assert calls == [len(requests)]
  monkeypatch.setattr(Sampler, "generate", real)
  want = _direct(policy, params, tokenizer, requests, default)
  assert [g.token_ids for g in got] == [tuple(int(t) for t in w.tokens) for w in want]


def _pair_config(**per_agent):
  toy_task.register_pair()
  c = config_lib.base_config()  # after the registration: it declares "first" and "second"
  c.env.name, c.env.workflow, c.env.max_turns = toy_task.PAIR, "mas", 1
  c.rollout.mode, c.rollout.k = "independent", 2
  c.algo.estimator, c.algo.filter = "grpo", "none"
  c.sampling.temperature, c.sampling.top_p, c.sampling.max_new_tokens = 0.9, 0.95, 16
  c.sampling.stop = ("END",)
  c.eval.temperature, c.eval.top_p = 0.0, 0.8
  for agent, fields in per_agent.items():
    for name, value in fields.items():
      c.sampling.per_agent[agent][name] = value
  return c


def test_config_gives_rollout_evaluation_and_learner_each_agents_settings():
  """Overrides of "second" over the global values; "first" keeps them. Evaluation samples every
  agent at config.eval's temperature and top_p, with each agent's budget and stop strings. The
  learner's temperature is each agent's sampling temperature (1 for greedy), or
  train.learner_temperature for all when set."""
  c = _pair_config(second=dict(temperature=0.0, top_p=0.5, max_new_tokens=4,
                               stop=("</answer>",)))
  built = config_lib.build(c)
  rollout = setup.agent_sampling_params(c, built.spec.agents)
  assert rollout["first"] == SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95,
                                            stop_strings=("END",))
  assert rollout["second"] == SamplingParams(max_new_tokens=4, temperature=0.0, top_p=0.5,
                                             stop_strings=("</answer>",))
  evaluation = setup.agent_sampling_params(c, built.spec.agents, for_eval=True)
  assert evaluation["first"] == SamplingParams(max_new_tokens=16, temperature=0.0, top_p=0.8,
                                               stop_strings=("END",))
  assert evaluation["second"] == SamplingParams(max_new_tokens=4, temperature=0.0, top_p=0.8,
                                                stop_strings=("</answer>",))
  assert config_lib.learner_temperatures(c, built.spec.agents) == (0.9, 1.0)
  c.train.learner_temperature = 1.0
  c.train.recompute_old_logp = True  # PPO: the learner's own old log-probs
  config_lib.build(c)
  assert config_lib.learner_temperatures(c, built.spec.agents) == (1.0, 1.0)


@pytest.mark.parametrize("field, value, message", [
    ("verifier.temperature", 0.7, "config.sampling.per_agent.verifier.temperature=0.7 names "
     "agent 'verifier', which workflow 'mas' of 'toy_vowel_pair' does not have; expected an "
     "agent of ['first', 'second']"),
    ("first.temperature", -1.0, "config.sampling.per_agent.first.temperature=-1.0; expected a "
     "finite number >= 0 (0 = greedy)"),
    ("first.top_p", 0.0, "config.sampling.per_agent.first.top_p=0.0; expected a number in "
     "(0, 1]"),
    ("second.max_new_tokens", 0, "config.sampling.per_agent.second.max_new_tokens=0; expected "
     "an integer >= 1"),
    ("second.stop", ("",), "config.sampling.per_agent.second.stop contains ['']; expected "
     "non-empty strings"),
])
def test_bad_overrides_are_refused(field, value, message):
  agent, name = field.split(".")
  with pytest.raises(config_lib.UserInputError) as e:
    config_lib.build(_pair_config(**{agent: {name: value}}))
  assert str(e.value).startswith(message)


def test_ppo_refuses_a_learner_temperature_other_than_an_agents_sampling_one():
  c = _pair_config(second=dict(temperature=0.7))
  c.train.learner_temperature = 0.9  # first samples at 0.9: only second's differs
  with pytest.raises(config_lib.UserInputError, match=r"config.train.learner_temperature=0.9 "
                     r"differs from the sampling temperature 0.7 of agent 'second' \(config."
                     r"sampling.per_agent.second.temperature\), so PPO ratios"):
    config_lib.build(c)
  c.train.recompute_old_logp = True
  config_lib.build(c)


@pytest.mark.parametrize("override, needles", [
    ("--config.sampling.per_agent.verifier.temperature=0.7",
     ["config.sampling.per_agent.verifier.temperature=0.7 names agent 'verifier'",
      "workflow 'mas' of 'plan_path'"]),
    ("--config.sampling.per_agent.plan.top_p=1.5",
     ["config.sampling.per_agent.plan.top_p=1.5; expected a number in (0, 1]"]),
    ("--config.sampling.per_agent.nobody.temperature=1.0",
     ["--config.sampling.per_agent.nobody.temperature: no config field 'nobody'"]),
])
def test_train_cli_refuses_bad_overrides_in_one_line(override, needles, tmp_path):
  result = entry_points.run("train", "--config=configs/atgrpo_plan_path.py:cpu",
                            f"--workdir={tmp_path / 'run'}", override)
  entry_points.error_line(result, *needles)
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_every_workflow_agent_has_a_section_and_listing_them_leaves_jax_unstarted():
  """`base_config` declares a per-agent section for every agent of every registered workflow,
  importing every task to list them; that must not start jax's backend (bm25s runs a jax op when
  imported), or an entry point could no longer initialise jax.distributed or set fake devices
  after parsing its config. Checked in a fresh process: jax there still takes a device count."""
  from marl_jax.workflows import registry
  c = config_lib.base_config()
  for name in registry.TASKS:
    for workflow in registry.TASKS.get(name).workflows.values():
      assert set(workflow.agents) <= set(c.sampling.per_agent), (name, workflow.agents)
  code = ("import jax\n"
          "from marl_jax.training.config import base_config\n"
          "c = base_config()\n"
          "assert 'verifier' in c.sampling.per_agent\n"
          "jax.config.update('jax_num_cpu_devices', 3)\n"
          "print(jax.device_count())\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=entry_points.REPO,
                          env=dict(env, JAX_PLATFORMS="cpu", PYTHONPATH=entry_points.REPO))
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split()[-1] == "3"
