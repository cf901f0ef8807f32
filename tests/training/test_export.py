"""Exporting trained runs (experiments.export): tiny runs are trained and checkpointed, exported,
loaded with transformers (PyTorch) and compared with our logits on held-out prompts; LoRA
adapters are checked as PEFT files (names, shapes, a NumPy merge, and peft itself when installed);
an export loads back as `config.model`; bad input ends in one line.

Tolerance: both sides compute in fp32 and differ only in the order of operations, so the logits
differ by rounding. A length-K fp32 dot product is off by about sqrt(K) * eps relative to its
magnitude; the tiny model chains about 20 such products (q/k/v/o, attention, gate/up/down, per
layer, the LM head) with K <= 128, and RMSNorm passes relative errors on. So the bound is
20 * sqrt(128) * eps32 * max|logit| (about 5e-4 at |logit| ~ 20); a wrong layout (a transposed
kernel, a lost adapter, the wrong rope) is off by O(1), and every test also checks that what it
compares moves by more than 10x the bound (the adapters, the two policies).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import toy_task
from marl_jax.errors import UserInputError
from marl_jax.models import decoder
from marl_jax.models import lora as lora_lib
from marl_jax.models.lora import MODULE_GROUPS
from marl_jax.models.tokenizer import Tokenizer
from marl_jax.training import config as config_lib
from marl_jax.training import export, run_identity, setup, trainer

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELD_OUT = ["Count the vowels in 'orange juice'.", "Name a colour that starts with u.",
            "What comes after Tuesday?"]


def _train(model_dir: str, workdir: str, kind: str) -> None:
  c = toy_task.toy_config(model_dir, steps=1)
  c.env.name, c.env.workflow = toy_task.PAIR, "mas"
  c.eval.num_problems, c.eval.k = 1, 1
  if kind == "lora":
    c.policy.kind = "lora"
    c.lora.rank, c.lora.alpha = 4, 8.0
  trainer.train(c, workdir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Workdirs of two one-step runs on the two-agent toy task: a shared full model, and one
  LoRA adapter per agent."""
  root = tmp_path_factory.mktemp("export")
  model_dir = str(root / "model")
  toy_task.write_tiny_model(model_dir)
  toy_task.register_pair()
  out = {}
  for kind in ("shared", "lora"):
    out[kind] = str(root / kind)
    _train(model_dir, out[kind], kind)
  return out


def _prompts(tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """tokens, mask, positions [B, T] of the held-out chat prompts, left-padded."""
  ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
         for q in HELD_OUT]
  T = max(map(len, ids))
  tokens = np.full((len(ids), T), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(ids), T), bool)
  for i, row in enumerate(ids):
    tokens[i, T - len(row):], mask[i, T - len(row):] = row, True
  return tokens, mask, np.asarray(decoder.positions_from_mask(jnp.asarray(mask)))


def _ours(params, config, tokens, mask, positions, adapters=None) -> np.ndarray:
  logits, _ = decoder.forward(params, jnp.asarray(tokens), jnp.asarray(positions), config,
                              attn_mask=jnp.asarray(mask), adapters=adapters)
  return np.asarray(logits)


def _torch(model, tokens, mask, positions) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long),
                 position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()


def _tolerance(reference: np.ndarray) -> float:
  return 20 * math.sqrt(128) * float(np.finfo(np.float32).eps) * float(np.abs(reference).max())


def _adapters(team: export.Team, p: int, rows: int):
  return lora_lib.adapters(team.trainable, jnp.full((rows,), p, jnp.int32), team.policy.lora)


def test_full_model_export_matches_transformers(runs, tmp_path):
  team = export.restore_team(runs["shared"])
  manifest = export.export_team(team, str(tmp_path))
  assert team.names == ("first+second",) and manifest["models"] == {
      "first+second": {"agents": ["first", "second"], "path": "first+second", "format": "model"}}
  path = str(tmp_path / "first+second")
  for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json"):
    assert os.path.isfile(os.path.join(path, name)), name
  exported_tokenizer = transformers.AutoTokenizer.from_pretrained(path)
  tokenizer = team.tokenizers[0]
  chat = [{"role": "user", "content": HELD_OUT[0]}]
  assert exported_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) \
      == tokenizer.apply_chat_template(chat)  # the chat template travels with the model
  tokens, mask, positions = _prompts(tokenizer)
  ref = _torch(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
               tokens, mask, positions)
  config = team.policy.models[0]
  ours = _ours(team.trainable, config, tokens, mask, positions)
  assert np.abs(ours - ref)[mask].max() <= _tolerance(ref[mask])
  # The export is the trained policy, not the model it started from.
  c = run_identity.saved_config(runs["shared"], 1)
  start = _ours(setup.load_team(c, config_lib.build(c))[1], config, tokens, mask, positions)
  assert np.abs(start - ours)[mask].max() > 10 * _tolerance(ref[mask])


def test_merged_lora_export_matches_our_adapter_forward(runs, tmp_path):
  team = export.restore_team(runs["lora"])
  export.export_team(team, str(tmp_path), lora="merge")
  assert team.names == ("first", "second")
  tokens, mask, positions = _prompts(team.tokenizers[0])
  config, base = team.policy.models[0], team.frozen["base"]
  without = _ours(base, config, tokens, mask, positions)
  logits = []
  for p, name in enumerate(team.names):
    ref = _torch(transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / name), dtype=torch.float32), tokens, mask, positions)
    ours = _ours(base, config, tokens, mask, positions, _adapters(team, p, len(tokens)))
    tol = _tolerance(ref[mask])
    assert np.abs(ours - ref)[mask].max() <= tol, name
    assert np.abs(ours - without)[mask].max() > 10 * tol, name  # the adapter matters
    logits.append(ours)
  assert np.abs(logits[0] - logits[1])[mask].max() > 10 * tol  # two different policies


def _peft_names(config, lora_config) -> dict[str, tuple[int, int]]:
  """PEFT's documented LoRA tensor names for a causal LM, with their [r, in] / [out, r] shapes,
  written out here from `module_shapes`."""
  shapes = lora_lib.module_shapes(config)
  r = lora_config.rank
  out = {}
  for i in range(config.num_hidden_layers):
    for name in lora_config.target_modules:
      stem = f"base_model.model.model.layers.{i}.{MODULE_GROUPS[name]}.{name}"
      d_in, d_out = shapes[name]
      out[f"{stem}.lora_A.weight"], out[f"{stem}.lora_B.weight"] = (r, d_in), (d_out, r)
  return out


@pytest.fixture(scope="module")
def lora_exports(runs, tmp_path_factory):
  team = export.restore_team(runs["lora"])
  root = tmp_path_factory.mktemp("lora_exports")
  export.export_team(team, str(root / "merge"), lora="merge")
  manifest = export.export_team(team, str(root / "adapters"), lora="adapters")
  return team, root, manifest


def test_adapter_files_follow_peft_and_merge_to_the_merged_export(lora_exports):
  team, root, manifest = lora_exports
  assert manifest["base"] == "base" and manifest["lora"] == "adapters"
  config, lora_config = team.policy.models[0], team.policy.lora
  base = safetensors.numpy.load_file(str(root / "adapters" / "base" / "model.safetensors"))
  for name in team.names:
    adapter = root / "adapters" / name
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert (settings["peft_type"], settings["r"], settings["lora_alpha"]) == ("LORA", 4, 8.0)
    assert sorted(settings["target_modules"]) == sorted(lora_config.target_modules)
    assert settings["base_model_name_or_path"] == str(root / "adapters" / "base")
    tensors = safetensors.numpy.load_file(str(adapter / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == _peft_names(config, lora_config)
    merged = safetensors.numpy.load_file(str(root / "merge" / name / "model.safetensors"))
    scale = settings["lora_alpha"] / settings["r"]
    for key, a in tensors.items():
      if ".lora_A." not in key:
        continue
      b = tensors[key.replace(".lora_A.", ".lora_B.")]
      weight = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
      by_hand = base[weight].astype(np.float64) + scale * (b.astype(np.float64) @ a)
      np.testing.assert_allclose(merged[weight], by_hand, rtol=1e-5, atol=1e-6)
    untouched = [k for k in merged if k not in {
        n.replace("base_model.model.", "").replace(".lora_A.weight", ".weight") for n in tensors}]
    assert untouched and all(np.array_equal(merged[k], base[k]) for k in untouched)


def test_peft_loads_the_adapters_over_the_exported_base(lora_exports):
  peft = pytest.importorskip("peft", reason="peft is not installed: the NumPy merge above "
                                            "checks the adapter files without it")
  team, root, _ = lora_exports
  tokens, mask, positions = _prompts(team.tokenizers[0])
  config, base = team.policy.models[0], team.frozen["base"]
  for p, name in enumerate(team.names):
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(
        str(root / "adapters" / "base"), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf_base, str(root / "adapters" / name))
    ref = _torch(model, tokens, mask, positions)
    ours = _ours(base, config, tokens, mask, positions, _adapters(team, p, len(tokens)))
    assert np.abs(ours - ref)[mask].max() <= _tolerance(ref[mask]), name


def test_export_loads_back_as_the_config_model(runs, tmp_path):
  """`--config.model=DIR`: the run's config pointed at its own export builds the same params
  (bitwise) and the same tokenizer."""
  team = export.restore_team(runs["shared"])
  export.export_team(team, str(tmp_path))
  c = run_identity.saved_config(runs["shared"], 1)
  c.model = str(tmp_path / "first+second")
  _, params, tokenizers = setup.load_team(c, config_lib.build(c))
  assert jax.tree.structure(params) == jax.tree.structure(team.trainable)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(team.trainable)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  chat = [{"role": "user", "content": HELD_OUT[1]}]
  prompt = tokenizers[0].apply_chat_template(chat)
  assert prompt == team.tokenizers[0].apply_chat_template(chat)
  assert tokenizers[0].encode(prompt) == team.tokenizers[0].encode(prompt)
  assert tokenizers[0].stop_token_ids == team.tokenizers[0].stop_token_ids


def test_export_builds_the_team_its_checkpoint_was_trained_as(runs):
  """config.json is only a copy: edited to another model and layout, or deleted, the export is
  still the checkpoint's team (its identity)."""
  path = os.path.join(runs["shared"], "config.json")
  with open(path) as f:
    original = f.read()
  try:
    edited = json.loads(original)
    edited["model"], edited["policy"]["kind"] = "/nowhere", "lora"
    with open(path, "w") as f:
      json.dump(edited, f)
    teams = [export.restore_team(runs["shared"])]
    os.remove(path)
    teams.append(export.restore_team(runs["shared"]))
  finally:
    with open(path, "w") as f:
      f.write(original)
  reference = export.restore_team(runs["shared"])
  for team in teams:
    assert team.policy == reference.policy and team.names == ("first+second",)
    for x, y in zip(jax.tree.leaves(team.trainable), jax.tree.leaves(reference.trainable)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bad_input_is_refused_in_one_line(runs, tmp_path):
  with pytest.raises(UserInputError, match=r"--checkpoint=7: .* has checkpoints \[1\]; "
                                           r"expected a saved step"):
    export.restore_team(runs["shared"], 7)

  def cli(*args):
    env = dict(os.environ, PYTHONPATH=_REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "experiments.export", *args], cwd=_REPO,
                          env=env, capture_output=True, text=True, timeout=300, check=False)

  missing = cli(f"--workdir={tmp_path}", f"--out={tmp_path / 'out'}")
  assert missing.returncode == 1
  assert missing.stderr.strip().splitlines()[-1] == (
      f"error: {tmp_path} has no checkpoint; expected the workdir of a run that saved one")
  full = cli(f"--workdir={runs['shared']}", f"--out={tmp_path / 'out'}", "--lora=adapters")
  assert full.returncode == 1 and full.stderr.strip().splitlines()[-1] == (
      "error: --lora=adapters: the run's policies are full models (policy.kind 'shared'), not "
      "LoRA adapters; expected --lora=merge")
  assert not (tmp_path / "out").exists()
