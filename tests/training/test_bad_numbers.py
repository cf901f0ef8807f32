"""Numbers that passed every `x < 0` check: NaN and inf in any float field of a config, seeds out of
jax's range, env sizes out of range. Each is refused in one line naming the field, before any
model loads."""

from __future__ import annotations

import math

import pytest
from flax import traverse_util

from marl_jax.algos.losses import LossConfig
from marl_jax.algos.optim import OptimConfig
from marl_jax.errors import UserInputError
from marl_jax.training import config as config_lib
from marl_jax.training import preflight


def _float_fields() -> list[str]:
  """Every float field of the base config (set ones, and the float placeholders set to None)."""
  c = config_lib.base_config()
  flat = traverse_util.flatten_dict(c.to_dict(), sep=".")
  fields = [k for k, v in flat.items() if isinstance(v, float)]
  fields += ["train.target_kl", "train.tis_cap", "train.learner_temperature", "eval.top_p"]
  return sorted(fields)


def _set(c, field: str, value) -> None:
  *path, name = field.split(".")
  section = c
  for part in path:
    section = section[part]
  with c.unlocked():
    section[name] = value


def test_the_base_config_has_the_float_fields_the_issue_names():
  fields = _float_fields()
  assert {"optim.lr", "loss.kl_coef", "loss.clip_low", "loss.clip_high", "loss.dual_clip",
          "algo.alpha", "sft.lr", "rollout.tool_timeout_s"} <= set(fields)
  assert len(fields) > 25


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", _float_fields())
def test_every_float_field_refuses_nan_and_inf(field, value):
  c = config_lib.base_config()
  _set(c, field, value)
  if field == "algo.clamp" and value == math.inf:  # documented: no clip (AdvantageConfig)
    config_lib.build(c)
    return
  with pytest.raises(UserInputError) as refused:
    config_lib.build(c)
  message = str(refused.value)
  assert "\n" not in message and message.startswith(f"config.{field}={value!r}"), message


@pytest.mark.parametrize("kwargs, message", [
    (dict(b1=1.0), "b1=1.0"), (dict(b2=-0.1), "b2=-0.1"), (dict(eps=0.0), "eps=0.0"),
    (dict(end_lr_ratio=-1.0), "end_lr_ratio=-1.0"), (dict(lr=math.nan), "lr=nan"),
    (dict(weight_decay=math.inf), "weight_decay=inf"),
])
def test_optimizer_ranges(kwargs, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    OptimConfig(**kwargs)


def test_loss_ratio_limit_must_be_positive():
  with pytest.raises(ValueError, match="log_ratio_limit must be > 0"):
    LossConfig(log_ratio_limit=0.0)


@pytest.mark.parametrize("seed", [-1, 2**63, 2**70, True])
def test_seed_out_of_range(seed):
  c = config_lib.base_config()
  c.seed = seed
  with pytest.raises(UserInputError, match=r"config.seed=.*expected an integer in \[0, 2\*\*63\)"):
    config_lib.build(c)


@pytest.mark.parametrize("env, kwargs, message", [
    ("plan_path", dict(height=-3), "height=-3; expected an integer in [1, 50]"),
    ("plan_path", dict(height=3000, width=3000), "height=3000; expected an integer in [1, 50]"),
    ("plan_path", dict(width=2.5), "width=2.5; expected an integer"),
    ("plan_path", dict(block_ratio=math.nan), "block_ratio=nan; expected a finite number"),
    ("plan_path", dict(block_ratio=1.5), "block_ratio=1.5; expected a number in [0, 1)"),
    ("sokoban", dict(num_boxes=40), "num_boxes=40; expected an integer in [1, 4]"),
])
def test_env_kwargs_out_of_range_are_one_line(tmp_path, env, kwargs, message):
  c = config_lib.base_config()
  c.env.name, c.env.workflow = env, "mas"
  for key, value in kwargs.items():
    with c.unlocked():
      c.env.kwargs[key] = value
  c.model = str(tmp_path)  # an existing directory: the config check passes, nothing loads
  with pytest.raises(UserInputError) as refused:
    preflight.check(c, str(tmp_path / "run"))
  line = str(refused.value)
  assert "\n" not in line and line.startswith("config.env.kwargs") and message in line, line
