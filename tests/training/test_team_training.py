"""Team training through `trainer.train`: heterogeneous (mapped) teams and the MARFT critic.

Models are tiny random HF directories with the embedded SmolLM2 tokenizer: a Llama and a Qwen2
(its tokenizer copy pads with another id, so per-policy pad ids are visible in the batch). The real
135M model would make every run here minutes long. The train step is wrapped to record what the
trainer feeds it (the batch, params before and after), and the checks use references written here:
a NumPy value head over the frozen base's hidden states, a NumPy teacher-forced log-prob.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

import toy_task
from configs import marft_math
from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.batch import GroupSpace, TrainBatch, make_batch
from marl_jax.algos.losses import LossConfig
from marl_jax.envs import base as envs_base
from marl_jax.models import config as model_config
from marl_jax.models import decoder, hf
from marl_jax.models.loading import load_model
from marl_jax.models.lora import LoraConfig
from marl_jax.parallel import layouts, policies
from marl_jax.parallel.mesh import make_mesh
from marl_jax.parallel.train_config import TrainConfig
from marl_jax.parallel.train_step import make_train_step
from marl_jax.traces import replay, store
from marl_jax.traces.schema import validate
from marl_jax.training import config as config_lib
from marl_jax.training import trainer
from marl_jax.training.metrics import read_metrics
from marl_jax.workflows import registry
from host import FAST_COMPILE, cpu_devices

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest

PAIR = "toy_vowel_pair"
TRIO, TRIO_AGENTS = "toy_vowel_trio", ("lead", "worker_a", "worker_b")
QWEN_PAD = 0  # '<|endoftext|>'; the SmolLM2 tokenizer itself pads with 2 ('<|im_end|>')


class VowelPairEnv:
  """Two agents (or `agents`), one turn: each is rewarded with the vowel fraction of its own
  reply, except that the second agent's reward is 0 on seeds < `quiet_below` (its advantages are
  then all 0)."""

  def __init__(self, seed: int, quiet_below: int, turn: int = 0,
               agents: tuple[str, ...] = ("first", "second")):
    self.seed, self.quiet_below, self.turn, self.agents = seed, quiet_below, turn, agents

  done = property(lambda self: self.turn >= len(self.agents))
  solved = property(lambda self: False)

  def clone(self):
    return VowelPairEnv(self.seed, self.quiet_below, self.turn, self.agents)

  def observe(self, agent):
    return envs_base.Observation(agent, 0, f"You are the {agent} agent.", f"Vowels ({self.seed}).")

  def step(self, agent, response):
    text = response or ""
    reward = sum(ch in "aeiouAEIOU" for ch in text) / max(len(text), 1)
    if agent == "second" and self.seed < self.quiet_below:
      reward = 0.0
    self.turn += 1
    return envs_base.StepResult(agent, None, {agent: reward}, self.done, {})


def make_pair_env(*, seed: int, quiet_below: int = 0) -> VowelPairEnv:
  return VowelPairEnv(seed, quiet_below)


def make_trio_env(*, seed: int) -> VowelPairEnv:
  return VowelPairEnv(seed, 0, agents=TRIO_AGENTS)


def _register_pair() -> None:
  for name, make, agents in ((PAIR, make_pair_env, ("first", "second")),
                             (TRIO, make_trio_env, TRIO_AGENTS)):
    registry.register(name, envs_base.Task(
        make, {"mas": envs_base.Workflow(agents, max_turns=1, fixed_turns=True)},
        lambda v, t, seed: dict(seed=seed)), replace=True)


def _write_tiny_qwen(path: str, tokenizer_dir: str) -> None:
  """A random 2-layer Qwen2 with the tokenizer files of `tokenizer_dir` (copied: building the
  tokenizer again costs seconds), re-declared to pad with QWEN_PAD."""
  config = model_config.get_preset("tiny-qwen2").replace(vocab_size=49152)
  hf.export_hf_dir(decoder.init_params(config, jax.random.key(1), scale=0.5), config, path)
  for name in ("tokenizer.json", "chat_template.jinja"):
    shutil.copy(os.path.join(tokenizer_dir, name), path)
  edits = {"tokenizer_config.json": dict(pad_token="<|endoftext|>"),
           "generation_config.json": dict(pad_token_id=QWEN_PAD),
           "config.json": dict(bos_token_id=1, eos_token_id=2, pad_token_id=QWEN_PAD)}
  for name, fields in edits.items():
    source = os.path.join(tokenizer_dir if name != "config.json" else path, name)
    with open(source) as f:
      data = json.load(f)
    with open(os.path.join(path, name), "w") as f:
      json.dump(dict(data, **fields), f)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  llama, qwen = (str(tmp_path_factory.mktemp(name)) for name in ("llama", "qwen"))
  toy_task.write_tiny_model(llama)
  _write_tiny_qwen(qwen, llama)
  _register_pair()
  return llama, qwen


@pytest.fixture
def recorded(monkeypatch):
  """Every train step the trainer takes: host copies of (batch, params before, params after,
  frozen params, metrics) and the rollout's whole batch (`rollout`: the one `prepare` saw, when
  the update trains on rows of it, else the step's own)."""
  steps, prepared = [], []
  make = trainer.make_train_step

  def recording_make(cfg, mesh, *args, **kwargs):
    fns = make(cfg, mesh, *args, **kwargs)

    def prepare(batch):
      prepared.append(jax.device_get(batch))
      return fns.prepare(batch)

    def step(state, frozen, batch, targets):
      before = jax.device_get(state.params)  # the step donates `state`
      new_state, metrics = fns.step(state, frozen, batch, targets)
      batch = jax.device_get(batch)
      steps.append(dict(batch=batch, rollout=prepared.pop() if prepared else batch,
                        before=before, after=jax.device_get(new_state.params),
                        frozen=jax.device_get(frozen), metrics=jax.device_get(metrics)))
      return new_state, metrics

    return fns._replace(step=step, prepare=prepare)

  monkeypatch.setattr(trainer, "make_train_step", recording_make)
  return steps


def _pair_config(models, quiet_below: int):
  c = toy_task.toy_config(models[0], steps=2)
  c.env.name, c.env.workflow = PAIR, "mas"
  c.env.kwargs.quiet_below = quiet_below
  c.policy.kind, c.policy.models = "mapped", models
  c.algo.estimator, c.algo.alpha = "drmas", 0.0
  c.optim.weight_decay = 0.0  # a policy with zero gradients must keep its params bit for bit
  return c


def _ref_logp(params, config, prompt, prompt_mask, response, token_mask) -> np.ndarray:
  """Teacher-forced log-probs of the response tokens: one forward over the full prompt +
  response, log-softmax in NumPy (float64)."""
  tokens = np.concatenate([prompt, response], axis=1)
  mask = np.concatenate([prompt_mask, token_mask], axis=1)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  logits = np.asarray(decoder.forward(params, tokens, positions, config, attn_mask=mask)[0],
                      np.float64)
  tp = prompt.shape[1]
  logits = logits[:, tp - 1:-1]
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                         ) - logits.max(-1, keepdims=True)
  return np.take_along_axis(logp, response[..., None], axis=-1)[..., 0]


def test_mapped_team_trains_each_model_on_its_own_samples(models, recorded, tmp_path):
  """Llama plays 'first', Qwen2 plays 'second'. On step 1 (seeds 0, 1 < quiet_below) the second
  agent's rewards are all 0, so only the Llama may move; on step 2 both move."""
  trainer.train(_pair_config(models, quiet_below=2), str(tmp_path))
  assert len(recorded) == 2
  configs = [load_model(m).config for m in models]
  for i, rec in enumerate(recorded):
    batch = rec["batch"]
    assert sorted(batch) == ["first", "second"]
    for name, config, pad in (("first", configs[0], 2), ("second", configs[1], QWEN_PAD)):
      b = batch[name]
      s = b.samples
      assert s.sample_mask.sum() == 8 and set(s.agent_id[s.sample_mask]) == {int(name == "second")}
      assert np.all(b.prompt[~b.prompt_mask] == pad) and np.all(b.response[~s.token_mask] == pad)
      # The behaviour log-probs are this agent's own model's (the right sampler and weights).
      rows = s.sample_mask
      want = _ref_logp(rec["before"]["policy"][name], config, b.prompt[rows], b.prompt_mask[rows],
                       b.response[rows], s.token_mask[rows])
      tm = s.token_mask[rows]
      np.testing.assert_allclose(b.old_logp[rows][tm], want[tm], atol=2e-4)
    changed = {name: any(not np.array_equal(x, y) for x, y in zip(
        jax.tree.leaves(rec["before"]["policy"][name]),
        jax.tree.leaves(rec["after"]["policy"][name]))) for name in ("first", "second")}
    assert changed == {"first": True, "second": i == 1}, (i, changed)
  rewards = recorded[0]["batch"]["second"].samples.rewards
  assert not rewards.any() and recorded[1]["batch"]["second"].samples.rewards.any()
  # The checkpoint holds both models under their role names.
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]


def test_train_agents_trains_only_the_named_agents(models, recorded, tmp_path):
  """train.agents='first': the second agent acts (its samples and rewards are in the rollout's
  batch, so its groups keep their statistics) but has no tokens in any loss, the update computes
  none of its rows (its block is one masked row per device), and its model stays bit for bit; the first
  agent's update is exactly that of the run training both (per-agent groups)."""
  c = _pair_config(models, quiet_below=0)
  c.train.steps = 1
  c.rollout.problems_per_step *= 2  # 16 samples per agent: the second's block can shrink to 8
  trainer.train(c, str(tmp_path / "both"))
  c.train.agents = "first"
  trainer.train(c, str(tmp_path / "first"))
  both, first = recorded
  second = first["rollout"]["second"].samples
  assert second.sample_mask.sum() == 16 and not second.token_mask.any()
  np.testing.assert_array_equal(second.rewards, both["batch"]["second"].samples.rewards)
  assert second.rewards.any()
  learner = first["batch"]["second"].samples  # one masked row for each device (8 in the suite)
  assert learner.sample_mask.shape == (jax.device_count(),) and not learner.sample_mask.any()
  assert first["batch"]["first"].samples.sample_mask.shape == (16,)
  np.testing.assert_array_equal(first["batch"]["first"].samples.token_mask,
                                both["batch"]["first"].samples.token_mask)
  for name, moved in (("first", True), ("second", False)):
    before, after = (jax.tree.leaves(first[k]["policy"][name]) for k in ("before", "after"))
    assert any(not np.array_equal(x, y) for x, y in zip(before, after)) == moved, name
  for x, y in zip(jax.tree.leaves(first["after"]["policy"]["first"]),
                  jax.tree.leaves(both["after"]["policy"]["first"])):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_shared_worker_policy_stays_fixed_while_its_lead_trains(models, recorded, tmp_path):
  """A stacked team with `policy.share`: the two workers act with one model (policy 1), the lead
  with its own (policy 0), and RL trains the lead alone (the spawn preset `split`). Both workers'
  behaviour log-probs are policy 1's model's; the update sees policy 0's block only; policy 1's
  params stay bit for bit although AdamW decays weights (its optimizer is frozen), while the
  lead's move."""
  c = toy_task.toy_config(models[0], steps=1)
  c.env.name, c.env.workflow = TRIO, "mas"
  c.policy.kind, c.policy.share = "stacked", ("worker_a+worker_b",)
  c.algo.estimator, c.algo.alpha = "drmas", 0.0
  c.optim.weight_decay = 0.5  # decay alone would move every weight of a trained policy
  c.train.agents = "lead"
  trainer.train(c, str(tmp_path))
  (rec,) = recorded
  config = load_model(models[0]).config
  rollout = rec["rollout"]  # [P = 2, N / P] blocks, policy p's samples in block p
  assert rollout.response.shape[0] == 2
  for p, agents in ((0, {0}), (1, {1, 2})):
    s = rollout.samples
    rows = s.sample_mask[p]
    assert set(s.agent_id[p][rows]) == agents and set(s.policy_id[p][rows]) == {p}
    params = jax.tree.map(lambda x: x[p], rec["before"]["policy"])
    want = _ref_logp(params, config, rollout.prompt[p][rows], rollout.prompt_mask[p][rows],
                     rollout.response[p][rows], s.token_mask[p][rows])
    tm = s.token_mask[p][rows]
    np.testing.assert_allclose(rollout.old_logp[p][rows][tm], want[tm], atol=2e-4)
  assert rec["batch"].policies == (0,) and rec["batch"].response.shape[0] == 1
  before, after = (jax.tree.leaves(rec[k]["policy"]) for k in ("before", "after"))
  for x, y in zip(before, after):
    np.testing.assert_array_equal(x[1], y[1])
  assert all(not np.array_equal(x[0], y[0]) for x, y in zip(before, after))


def _np_values(frozen_base, config, critic, b) -> np.ndarray:
  """Values [n, R] of the states before each response token: NumPy MLP over the hidden states
  of one full forward of the frozen base over prompt + response."""
  tokens = np.concatenate([b.prompt, b.response], axis=1)
  mask = np.concatenate([b.prompt_mask, np.ones_like(b.response, bool)], axis=1)
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  hidden, _ = decoder.hidden_states(frozen_base, tokens, positions, config, attn_mask=mask)
  tp, r = b.prompt.shape[1], b.response.shape[1]
  x = np.asarray(hidden, np.float64)[:, tp - 1:tp - 1 + r]
  layers = critic["layers"]
  for layer in layers[:-1]:
    x = np.maximum(x @ np.asarray(layer["w"], np.float64) + layer["b"], 0.0)
  return (x @ np.asarray(layers[-1]["w"], np.float64) + layers[-1]["b"])[..., 0]


@pytest.mark.parametrize("variant", ["action", "token"])
def test_marft_cpu_preset_with_critic(models, recorded, tmp_path, variant):
  """The marft_math cpu preset (model overridden to the tiny Llama, shorter replies) trains 2
  steps; the old values in each batch are the critic's, the critic learns, traces validate."""
  c = marft_math.get_config(f"{variant},cpu")
  c.model = models[0]
  c.env.max_turns, c.sampling.max_new_tokens = 2, 8  # one retry after "The answer is incorrect."
  toy_task.quiet_logging(c)
  summary = trainer.train(c, str(tmp_path))
  assert summary["steps"] == 2 and len(recorded) == 2
  config = load_model(models[0]).config
  for rec in recorded:
    b = rec["batch"]
    s = b.samples
    values = _np_values(rec["frozen"]["base"], config, rec["before"]["critic"], b)
    tm = s.token_mask & s.sample_mask[:, None]
    scale = np.abs(values[tm]).max()
    np.testing.assert_allclose(s.token_values[tm], values[tm], rtol=1e-4, atol=1e-4 * scale)
    assert np.all(s.token_values[~tm] == 0)
    np.testing.assert_allclose(s.values[s.sample_mask], values[s.sample_mask, 0], rtol=1e-4,
                               atol=1e-4 * scale)
    assert any(not np.array_equal(x, y) for x, y in zip(
        jax.tree.leaves(rec["before"]["critic"]), jax.tree.leaves(rec["after"]["critic"])))
    assert rec["metrics"]["value_abs_err"] > 0
  # The second batch's values come from the critic after the first update.
  for x, y in zip(jax.tree.leaves(recorded[1]["before"]["critic"]),
                  jax.tree.leaves(recorded[0]["after"]["critic"])):
    np.testing.assert_array_equal(x, y)
  assert [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r] == [1, 2]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
  path = tmp_path / "traces" / "eval_step2.jsonl"
  traces, content = [t for _, t in store.iter_traces(path)], store.read_content(path)
  assert len(traces) == c.eval.num_problems
  for t in traces:
    validate(t)
    assert replay.replay(t, content) == []


def _set(**fields):
  """An edit of the marft cpu config: dotted field -> value."""

  def edit(c):
    for dotted, value in fields.items():
      group, name = dotted.split("__")
      c[group][name] = value

  return edit


@pytest.mark.parametrize("edit, message", [
    (_set(policy__kind="mapped", policy__models=("smollm2-135m-instruct",) * 3),
     r"config.policy.models has 3 model\(s\) for policy.kind='mapped' with 2 policies; "
     r"expected 2 \(one per policy, in agent order\)"),
    (_set(policy__kind="stacked", policy__models=("smollm2-135m-instruct",) * 2),
     r"config.policy.models has 2 model\(s\) for policy.kind='stacked' .* expected 1 "
     r"\(per-policy models are for kind 'mapped'\)"),
    (_set(policy__kind="mapped", policy__models=("smollm2-135m-instruct", "/no/such/model")),
     r"config.policy.models\[1\]='/no/such/model' is neither a known preset"),
    (_set(algo__estimator="grpo", algo__gamma=None, algo__lam=None),  # grpo reads neither
     r"config.policy.critic=\(1024, 512\) but config.algo.estimator='grpo' uses no critic"),
    (_set(policy__critic=None), "config.algo.estimator='gae_action' needs a critic"),
    (_set(policy__kind="stacked"),
     r"config.policy.critic=\(1024, 512\) needs policy.kind='lora' \(the frozen base"),
    (_set(policy__critic=(64, 0)), r"config.policy.critic=\(64, 0\); expected hidden sizes"),
    (_set(rollout__mode="tree"), "config.rollout.mode='tree' puts K samples in one"),
    (_set(train__target_kl=-1.0),
     "config.train.target_kl=-1.0; expected a finite number > 0 or None"),
    (_set(loss__policy_loss="reinforce", train__target_kl=0.1),
     r"config.train.target_kl=0.1 uses the approximate KL of a ratio loss; expected "
     r"loss.policy_loss in \['ppo'\]"),
])
def test_team_config_errors_fail_before_compute(edit, message):
  c = marft_math.get_config("action,cpu")
  edit(c)
  with pytest.raises(ValueError, match=message) as info:
    config_lib.build(c)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["drmas_math", "drmas_search"])
@pytest.mark.parametrize("cpu", [False, True])
def test_drmas_hetero_presets_map_one_model_per_agent(name, cpu):
  """The Dr. MAS `hetero` variants: a mapped team with one model per agent, in agent order."""
  module = importlib.import_module(f"configs.{name}")
  c = module.get_config("hetero,cpu" if cpu else "hetero")
  config_lib.build(c)
  spec = registry.workflow_spec(c.env.name, c.env.workflow, c.env.max_turns,
                                layouts.of(c.policy).per_role)
  assert c.policy.kind == "mapped" and len(c.policy.models) == len(spec.agents)
  assert c.policy.models == ((c.model,) * len(spec.agents) if cpu else module.HETERO)


def test_old_values_on_fsdp_mesh_match_numpy():
  """`TrainFns.old_values` with the frozen base FSDP-sharded over (data=2, fsdp=4): every valid
  token's value and each sample's first-token value equal the NumPy value head; padding is 0."""
  model = model_config.get_preset("tiny-llama")
  n, tp, r = 16, 6, 5
  policy = policies.PolicyConfig(kind="lora", models=(model,), num_policies=2,
                                 lora=LoraConfig(rank=2, alpha=4.0), critic=(12, 8))
  space = GroupSpace(num_problems=n // 2, max_turns=1, num_agents=2, num_trajs=n // 2)
  cfg = TrainConfig(policy=policy, advantage=AdvantageConfig("gae_token"), loss=LossConfig(),
                    space=space)
  fns = make_train_step(cfg, make_mesh(2, 4, 1, devices=cpu_devices(8)),
                        compiler_options=FAST_COMPILE)
  trainable, frozen = policies.init_params(policy, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompt_mask = np.arange(tp)[None] >= rng.integers(0, 3, n)[:, None]
  token_mask = np.arange(r)[None] < rng.integers(1, r + 1, n)[:, None]
  agent = np.arange(n) % 2
  samples = make_batch(np.zeros(n, np.float32), token_mask=token_mask, agent_id=agent,
                       policy_id=agent, problem_id=np.arange(n) // 2, traj_id=np.arange(n) // 2,
                       sample_mask=np.arange(n) < n - 2, values=np.full(n, 7.0),
                       token_values=np.full((n, r), 7.0))
  batch = TrainBatch(prompt=rng.integers(1, model.vocab_size, (n, tp)).astype(np.int32),
                     prompt_mask=prompt_mask,
                     response=rng.integers(1, model.vocab_size, (n, r)).astype(np.int32),
                     old_logp=np.zeros((n, r), np.float32), samples=samples)
  sharded, frozen_sharded = fns.shard_params(trainable, frozen)
  out = jax.device_get(fns.old_values(sharded, frozen_sharded, fns.shard_batch(batch)))
  want = _np_values(jax.device_get(frozen["base"]), model, jax.device_get(trainable["critic"]),
                    batch)
  valid = np.asarray(samples.sample_mask)
  tm = token_mask & valid[:, None]
  scale = np.abs(want[tm]).max()
  np.testing.assert_allclose(out.samples.token_values[tm], want[tm], rtol=1e-4, atol=1e-5 * scale)
  assert np.all(out.samples.token_values[~tm] == 0) and np.all(out.samples.values[~valid] == 0)
  np.testing.assert_allclose(out.samples.values[valid], want[valid, 0], rtol=1e-4,
                             atol=1e-5 * scale)
  np.testing.assert_array_equal(out.response, batch.response)  # everything else passes through
