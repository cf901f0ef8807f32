"""KL to a frozen reference through the trainer (loss.kl_coef > 0), on tiny models.

The reference's log-probs are checked against an independent forward: transformers (PyTorch) on
the tiny model's HF directory, which holds the initial (pretrained) params, i.e. the LoRA base and
the full models' starting point. The logged `train/kl` is re-derived in NumPy from the sampler's
recorded log-probs (the policy that sampled is the one the step differentiates) and those
reference log-probs, with the k1 / k3 formulas written here.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

import toy_task
from marl_jax.models.loading import load_model
from marl_jax.training import config as config_lib
from marl_jax.training import evaluation, trainer

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  toy_task.register()
  toy_task.register_pair()
  return tiny_model_dir


def _config(model_dir: str, kind: str, estimator: str):
  c = toy_task.toy_config(model_dir, steps=2)
  c.loss.kl_coef, c.loss.kl_estimator = 0.5, estimator
  c.eval.at_start = False
  if kind != "shared":
    c.env.name, c.env.workflow = toy_task.PAIR, "mas"
    c.policy.kind = kind
  return c


def _torch_logp(model, prompt, prompt_mask, response, token_mask) -> np.ndarray:
  """log_softmax(logits) of each row's response tokens, one unpadded row at a time, float64."""
  out = np.zeros(response.shape)
  for i in range(len(response)):
    p = prompt[i][prompt_mask[i]]
    r = response[i][token_mask[i]]
    if not len(r):
      continue
    ids = torch.tensor(np.concatenate([p, r])[None].astype(np.int64))
    with torch.no_grad():
      logits = model(ids).logits[0].double()
    logp = torch.log_softmax(logits[len(p) - 1:-1], dim=-1)
    out[i, :len(r)] = logp[torch.arange(len(r)), torch.tensor(r.astype(np.int64))].numpy()
  return out


def _rows(batch) -> list:
  """The flat TrainBatch pieces of any layout: a dict (mapped), [P, n] blocks, or flat."""
  parts = list(batch.values()) if isinstance(batch, dict) else [batch]
  out = []
  for b in parts:
    if b.response.ndim == 3:  # stacked
      out += [jax.tree.map(lambda x, p=p: x[p], b) for p in range(b.response.shape[0])]
    else:
      out.append(b)
  return out


def _np_kl(logp: np.ndarray, ref: np.ndarray, estimator: str) -> np.ndarray:
  if estimator == "k1":
    return logp - ref
  return np.exp(ref - logp) - (ref - logp) - 1.0


@pytest.mark.parametrize("kind,estimator", [("shared", "k1"), ("stacked", "k3"),
                                            ("mapped", "k1"), ("lora", "k3")])
def test_kl_to_reference_through_the_trainer(model_dir, tmp_path, kind, estimator):
  c = _config(model_dir, kind, estimator)
  run = trainer.Run(c, str(tmp_path))
  initial = jax.device_get(run.state.params["policy"])
  seen = []
  step_fn = run.fns.step

  def recording(state, frozen, batch, targets):
    seen.append(jax.device_get(batch))
    return step_fn(state, frozen, batch, targets)

  run.fns = run.fns._replace(step=recording)
  metrics = [run.train_step(0), run.train_step(1)]
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  for i, batch in enumerate(seen):
    logp, ref, pass_ref = [], [], []
    for b in _rows(batch):
      rows, tm = b.samples.sample_mask, b.samples.token_mask
      want = _torch_logp(model, b.prompt[rows], b.prompt_mask[rows], b.response[rows], tm[rows])
      # The reference pass: the initial params (LoRA: the base without adapters).
      np.testing.assert_allclose(b.ref_logp[rows][tm[rows]], want[tm[rows]], atol=1e-4)
      logp.append(b.old_logp[rows][tm[rows]])
      ref.append(want[tm[rows]])
      pass_ref.append(b.ref_logp[rows][tm[rows]])
    logp, ref = np.concatenate(logp), np.concatenate(ref)
    # token_mean over every response token of the step (grpo, no filter: all samples count).
    expected = _np_kl(logp.astype(np.float64), ref, estimator).mean()
    if i == 0:  # the first rollout samples the reference itself
      np.testing.assert_allclose(logp, ref, atol=2e-4)
    else:  # one update later the policy has moved away from it
      assert abs(expected) > 5e-3, expected
    np.testing.assert_allclose(metrics[i]["train/kl"], expected, atol=3e-4, rtol=1e-3)
  # The reference never moves: full models keep a frozen copy equal bit for bit to the initial
  # params (own buffers, the trained ones differ); LoRA has no copy at all.
  trained = jax.device_get(run.state.params["policy"])
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(initial),
                                                      jax.tree.leaves(trained)))
  if kind == "lora":
    assert run.reference is None
  else:
    loaded = load_model(model_dir).params
    ref_params = jax.device_get(run.reference)
    ref_one = {"shared": lambda r: r, "stacked": lambda r: jax.tree.map(lambda x: x[1], r),
               "mapped": lambda r: r["second"]}[kind](ref_params)
    for a, b in zip(jax.tree.leaves(ref_one), jax.tree.leaves(loaded)):
      assert np.array_equal(a, np.asarray(b))
    for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(initial)):
      assert np.array_equal(a, b)


def test_kl_coef_errors():
  c = config_lib.base_config()
  for bad in (-0.1, float("nan"), float("inf")):
    c.loss.kl_coef = bad
    with pytest.raises(config_lib.UserInputError, match="config.loss.kl_coef"):
      config_lib.build(c)
  c.loss.kl_coef, c.policy.kind, c.sft.steps = 0.1, "lora", 2  # the reference would be the base
  with pytest.raises(config_lib.UserInputError, match=r"kl_coef=0.1 with LoRA adapters that RL "
                                                      r"starts from trained \(sft.steps"):
    config_lib.build(c)


def test_evaluation_holds_no_reference(model_dir, tmp_path, monkeypatch):
  """Evaluating a kl_coef > 0 run builds no frozen copy (a model's worth of memory); a Run
  built to evaluate refuses to train rather than train against a missing reference."""
  c = _config(model_dir, "stacked", "k3")
  seen = []
  evaluate = trainer.Run.evaluate

  def recording(self, *args, **kwargs):
    seen.append(self.reference)
    return evaluate(self, *args, **kwargs)

  monkeypatch.setattr(trainer.Run, "evaluate", recording)
  evaluation.evaluate_checkpoint(c, str(tmp_path / "eval"))
  assert seen == [None]
  run = trainer.Run(c, str(tmp_path / "train"))
  assert run.reference is not None  # training holds it (checked bit for bit above)
  with pytest.raises(RuntimeError, match=r"built to evaluate \(trains=False\)"):
    trainer.Run(c, str(tmp_path / "eval2"), trains=False).train_step(0)


def test_partial_team_reference_pass_runs_on_trained_rows(model_dir, tmp_path):
  """train.agents='second' of a stacked pair: the reference copies the second policy's block
  alone and the reference pass sees that block alone (the first agent's rows are in no loss
  term, so the trainer no longer computes their reference log-probs), its log-probs are the
  initial model's (transformers), and the logged KL is the NumPy mean over the second agent's
  tokens."""
  c = _config(model_dir, "stacked", "k3")
  c.train.agents = "second"
  run = trainer.Run(c, str(tmp_path))
  policy = jax.device_get(run.state.params["policy"])
  for ref, full in zip(jax.tree.leaves(jax.device_get(run.reference)), jax.tree.leaves(policy)):
    np.testing.assert_array_equal(ref, full[1:])  # [1, ...]: the second block, bit for bit
  passes, steps = [], []
  ref_fn, step_fn = run.fns.ref_logp, run.fns.step

  def reference_pass(reference, frozen, batch):
    passes.append(jax.device_get(batch))
    return ref_fn(reference, frozen, batch)

  def recording(state, frozen, batch, targets=None):
    steps.append(jax.device_get(batch))
    return step_fn(state, frozen, batch, targets)

  run.fns = run.fns._replace(ref_logp=reference_pass, step=recording)
  metrics = run.train_step(0)
  assert len(passes) == len(steps) == 1
  assert passes[0].policies == steps[0].policies == (1,)
  assert passes[0].response.shape[0] == 1
  (b,) = _rows(steps[0])
  rows, tm = b.samples.sample_mask, b.samples.token_mask
  assert set(b.samples.agent_id[rows]) == {1} and tm[rows].any()
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  want = _torch_logp(model, b.prompt[rows], b.prompt_mask[rows], b.response[rows], tm[rows])
  np.testing.assert_allclose(b.ref_logp[rows][tm[rows]], want[tm[rows]], atol=1e-4)
  expected = _np_kl(b.old_logp[rows][tm[rows]].astype(np.float64), want[tm[rows]], "k3").mean()
  np.testing.assert_allclose(metrics["train/kl"], expected, atol=3e-4, rtol=1e-3)
