"""A trained run's policies as Hugging Face model directories (`experiments/export.py`), and as
plain (config, params, tokenizer) models for tools that read a workdir (the lm-eval adapter).

A workdir holds orbax checkpoints of the run's trainable params, each with the config it was
trained under (`run_identity`; `config.json` is its readable copy). The team's
layout (`parallel/layouts.py`) says which params act for which agent: one exported model per
policy, named after the agents it acts for (`solver`, `tool+reasoner` for a shared model). A LoRA
team's adapters are either merged into the base (`lora='merge'`: plain models) or written as PEFT
adapter files (`lora='adapters'`, `models/peft.py`) beside one export of the frozen base
(`base/`), which every adapter_config.json names. `export.json` lists what was written.

The checkpoint is restored onto one device from its own metadata, so a run trained on any mesh
exports on one host; the base model comes from the run's `config.model` (or
`policy.models`), as in training. A MARFT critic's value head is not a language model and is not
exported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax

from marl_jax.errors import UserInputError
from marl_jax.models import lora as lora_lib
from marl_jax.models import peft
from marl_jax.models.config import ModelConfig
from marl_jax.models.hf import export_hf_dir
from marl_jax.models.tokenizer import Tokenizer
from marl_jax.parallel import layouts, policies
from marl_jax.training import config as config_lib
from marl_jax.training import run_identity, setup
from marl_jax.training.checkpoint import CHECKPOINT_DIR, Checkpointer, holding

LORA_MODES = ("merge", "adapters")
MANIFEST = "export.json"
BASE_DIR = "base"


@dataclasses.dataclass(frozen=True)
class Team:
  """A run's trained policies at one checkpoint, on one device."""

  workdir: str
  step: int
  names: tuple[str, ...]  # per policy id: its agents joined with '+'
  agents: tuple[tuple[str, ...], ...]  # per policy id: the agents it acts for
  policy: policies.PolicyConfig
  trainable: Any  # trainable['policy'] as checkpointed
  frozen: Any  # the LoRA base ({'base': params}), {} for full models
  tokenizers: tuple[Tokenizer, ...]  # one per model config


def _check_lora(lora: str, kind: str) -> None:
  """`--lora` is a mode, and 'adapters' needs a team of adapters."""
  if lora not in LORA_MODES:
    raise UserInputError(f"--lora={lora!r}; expected one of {LORA_MODES}")
  if lora == "adapters" and not (kind in layouts.LAYOUTS.names()
                                 and layouts.LAYOUTS.get(kind).adapters):
    raise UserInputError(f"--lora=adapters: the run's policies are full models (policy.kind "
                         f"{kind!r}), not LoRA adapters; expected --lora=merge")


def restore_team(workdir: str, step: int | None = None, lora: str | None = None) -> Team:
  """The run's policies at checkpoint `step` (default: the latest), read as a reader of a run
  that may be training (`workdir_lock`): the store is opened read-only, the step is held
  against the writer's rotation while it loads, and the team is built from the config that
  checkpoint carries (`run_identity.saved_config`), not from config.json. `lora`, when given, is
  the export's LoRA mode, checked against the run before the params load."""
  with holding(workdir, step) as step:
    c = run_identity.saved_config(workdir, step)
    if lora is not None:
      _check_lora(lora, c.policy.kind)
    try:
      built = config_lib.build(c)
    except ValueError as e:
      raise UserInputError(f"{workdir} checkpoint {step}: its config: {e}") from None
    with Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), read_only=True) as checkpoints:
      restored = checkpoints.restore_on_one_device(step)
  policy, base, tokenizers = setup.load_team(c, built)
  spec = built.spec
  agents = tuple(tuple(a for a in spec.agents if spec.policy_id(a) == p)
                 for p in range(spec.num_policies))
  frozen = policies.init_params(policy, jax.random.key(0), base)[1] if (
      layouts.of(policy).adapters) else {}
  return Team(workdir, step, tuple("+".join(a) for a in agents), agents, policy,
              restored.state["train"]["params"]["policy"], frozen, tuple(tokenizers))


def policy_model(team: Team, p: int) -> tuple[ModelConfig, Any, Tokenizer]:
  """Policy `p` as a plain model of its architecture: (config, params, tokenizer), a LoRA
  policy's adapter merged into the base (`lora.merge_lora`)."""
  layout = layouts.of(team.policy)
  model, params, adapters = layout.acting_params(team.policy, {"policy": team.trainable},
                                                 team.frozen, p, 1)
  if adapters is not None:
    params = lora_lib.merge_lora(params, team.trainable, team.policy.lora, p)
  return team.policy.models[model], params, team.tokenizers[model]


def export_team(team: Team, out: str, lora: str = "merge") -> dict[str, Any]:
  """Writes one HF directory per policy under `out` (module doc) and `out/export.json`; returns
  that manifest."""
  _check_lora(lora, team.policy.kind)
  has_adapters = layouts.of(team.policy).adapters
  adapters = lora == "adapters"
  os.makedirs(out, exist_ok=True)
  models: dict[str, Any] = {}
  if adapters:
    config, tokenizer = team.policy.models[0], team.tokenizers[0]
    export_hf_dir(team.frozen["base"], config, os.path.join(out, BASE_DIR), tokenizer)
  for p, name in enumerate(team.names):
    path = os.path.join(out, name)
    if adapters:
      peft.write_adapter(team.trainable, team.policy.lora, p, path,
                         os.path.abspath(os.path.join(out, BASE_DIR)))
      team.tokenizers[0].save(path)
    else:
      config, params, tokenizer = policy_model(team, p)
      export_hf_dir(params, config, path, tokenizer)
    models[name] = {"agents": list(team.agents[p]), "path": name,
                    "format": "peft_adapter" if adapters else "model"}
  manifest = {"workdir": os.path.abspath(team.workdir), "step": team.step,
              "policy_kind": team.policy.kind, "lora": lora if has_adapters else None,
              "base": BASE_DIR if adapters else None, "models": models}
  with open(os.path.join(out, MANIFEST), "w") as f:
    json.dump(manifest, f, indent=2)
  return manifest
