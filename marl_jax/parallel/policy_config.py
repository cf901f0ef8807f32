"""A team's policy config (`PolicyConfig`), the names of the policy layouts (`LAYOUTS`) and the
rule a layout sets for a team's models and critic (`check_team`).

The layouts' code is in `parallel/layouts.py`, whose every method takes a `PolicyConfig`; this
module sits below it and names each layout lazily ("module:OBJECT", docs/design.md), so the two
import each other nowhere. A new layout is its class in `layouts.py` and one `register` line
below.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marl_jax.algos import optim as optim_lib
from marl_jax.models import lora as lora_lib
from marl_jax.models.config import ModelConfig
from marl_jax.registry import Registry

# kind -> its `layouts.Layout` object (typed Any here: naming the class would import layouts.py)
LAYOUTS: Registry[Any] = Registry("policy kind")
LAYOUTS.register("shared", "marl_jax.parallel.layouts:SHARED")
LAYOUTS.register("lora", "marl_jax.parallel.layouts:LORA")
LAYOUTS.register("stacked", "marl_jax.parallel.layouts:STACKED")
LAYOUTS.register("mapped", "marl_jax.parallel.layouts:MAPPED")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """The policy layout of a team.

  Attributes:
    kind: a policy layout, one of `LAYOUTS` (their code: `parallel/layouts.py`).
    models: one ModelConfig, or (for "mapped") one per policy, in `names` order.
    num_policies: P. "shared" has 1; "lora"/"stacked"/"mapped" usually one per agent.
    names: "mapped" only: policy names, the keys of its params and batch dicts.
    lora: adapter settings ("lora" only).
    optim: one OptimConfig for every policy, or one per policy (Dr. MAS per-agent settings).
    critic: hidden sizes of MARFT's value head MLP over the frozen base (MARFT: (1024, 512));
      None: no critic. Needs kind "lora" (the frozen base is the critic's trunk).
    critic_optim: the value head's optimizer (MARFT clips gradients at 0.5).
  """
  kind: str = "shared"
  models: tuple[ModelConfig, ...] = ()
  num_policies: int = 1
  names: tuple[str, ...] = ()
  lora: lora_lib.LoraConfig | None = None
  optim: tuple[optim_lib.OptimConfig, ...] = (optim_lib.OptimConfig(),)
  critic: tuple[int, ...] | None = None
  critic_optim: optim_lib.OptimConfig = optim_lib.OptimConfig(lr=1e-4, weight_decay=0.0,
                                                              max_grad_norm=0.5)

  def __post_init__(self):
    layout = LAYOUTS.get(self.kind)
    P = self.num_policies
    if not isinstance(P, int) or P < 1:
      raise ValueError(f"num_policies must be an int >= 1, got {P!r}")
    if not layout.per_role and P != 1:
      raise ValueError(f"a {self.kind} policy has num_policies=1, got {P}")
    check_team(self.kind, P, len(self.models), self.critic)
    if layout.per_policy_models and (len(self.names) != P or len(set(self.names)) != P):
      raise ValueError(f"{self.kind} policies need {P} distinct names, got {self.names!r}")
    if not layout.per_policy_models and self.names:
      raise ValueError(f"names are for mapped policies, not {self.kind!r}")
    if layout.adapters != (self.lora is not None):
      raise ValueError(f"a LoraConfig is required by kind 'lora' and only by it (kind "
                       f"{self.kind!r}, lora={self.lora!r})")
    if len(self.optim) not in (1, P):
      raise ValueError(f"optim has {len(self.optim)} configs; expected 1 or num_policies={P}")
    if len({m.compute_dtype for m in self.models}) > 1:
      raise ValueError(f"models compute in {[m.compute_dtype for m in self.models]}; expected "
                       "one compute dtype for the team")

  @property
  def compute_dtype(self) -> str:
    """The dtype every model of the team computes in (`models/precision.py`)."""
    return self.models[0].compute_dtype

  @property
  def sample_axis(self) -> int:
    """Axis of batch arrays that indexes samples (1 for stacked: [P, N/P, ...])."""
    return LAYOUTS.get(self.kind).sample_axis

  def optim_of(self, p: int) -> optim_lib.OptimConfig:
    return self.optim[p if len(self.optim) > 1 else 0]


def check_team(kind: str, num_policies: int, num_models: int,
               critic: tuple[int, ...] | None) -> None:
  """What a policy layout asks of a team's models and critic; the ValueError names the config
  fields (`policy.models`, `policy.critic`, `policy.kind`)."""
  layout = LAYOUTS.get(kind)
  want = num_policies if layout.per_policy_models else 1
  if num_models != want:
    raise ValueError(f"policy.models has {num_models} model(s) for policy.kind={kind!r} with "
                     f"{num_policies} policies; expected {want} ("
                     + ("one per policy, in agent order)" if layout.per_policy_models else
                        "per-policy models are for kind 'mapped')"))
  if critic is not None and not layout.adapters:
    raise ValueError(f"policy.critic={tuple(critic)} needs policy.kind='lora' (the frozen base "
                     f"model is the critic's trunk), got {kind!r}")
