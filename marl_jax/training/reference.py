"""Where RL starts from, and its KL reference.

RL starts from the pretrained params, unless a warm-start (`config.sft.steps`) or a fork
(`config.init_from`) made others: then they are saved in a checkpoint (`start_point`), the run's
own checkpoint 0 or `init_from`'s.

The KL reference (`loss.kl_coef > 0`) is the policy RL starts from, in its own buffers, never
updated and not checkpointed. LoRA: the base without adapters (no extra memory; RL from trained
adapters is refused). Full models (shared, stacked, mapped): a compute copy of the params RL
starts from (`models/precision.py`; a stacked team that RL trains in part copies the trained
policies' blocks alone, `TrainConfig.reference_policies`), so after a warm-start the KL keeps
RL near the warm-started policy, not the pretrained one (which never saw the reply format). A
resumed run rebuilds it from the start point, as its first process had it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import ml_collections
from absl import logging

from marl_jax.errors import UserInputError
from marl_jax.parallel.train_step import TrainFns
from marl_jax.training import config as config_lib
from marl_jax.training.checkpoint import CHECKPOINT_DIR, Checkpointer, holding
from marl_jax.training.checkpoint_integrity import one_line


def start_point(c: ml_collections.ConfigDict, workdir: str) -> tuple[str, int] | None:
  """(workdir, step) of the checkpoint holding the params RL starts from: `config.init_from`'s,
  or this run's checkpoint 0 after its warm-start; None when they are the pretrained ones."""
  if c.init_from:
    return config_lib.init_from(c)
  return (workdir, 0) if c.sft.steps else None


def copy(fns: TrainFns, trainable: Any) -> Any:
  """The KL reference of a run starting from `trainable` (None without a KL term, or with LoRA,
  whose base is the reference); logs what it holds."""
  if fns.reference_params is None:
    return None
  reference = fns.reference_params(trainable)
  size = sum(x.nbytes for x in jax.tree.leaves(reference))
  logging.info("KL reference: %s", "the LoRA base without adapters (no extra memory)"
               if reference is None else
               f"a frozen copy of the policy params RL starts from, {size} bytes "
               f"({size / 2**20:.1f} MiB)")
  return reference


def restore_params(workdir: str, step: int, target: dict[str, Any], source: str) -> Any:
  """The trainable params of checkpoint `step` of `workdir`, restored into `target`'s layout
  ({"train": a TrainState, "rng": a key}, read only); `source` names where the step came from in
  the one-line refusal of a checkpoint of another team. Another run's writer may be live: the
  step is held against its rotation while it loads (`holding`)."""
  with holding(workdir, step), Checkpointer(os.path.join(workdir, CHECKPOINT_DIR),
                                            read_only=True) as checkpoints:
    try:
      restored = checkpoints.restore(step, target=target)
    except (ValueError, TypeError, KeyError) as e:
      raise UserInputError(f"{source}: checkpoint {step} does not fit this config's team and "
                           f"optimizer ({one_line(e)}); expected a run of the same models, "
                           "policy layout and trained agents") from None
  return restored.state["train"].params
