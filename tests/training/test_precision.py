"""Mixed precision through the trainer: fp32 masters under bf16 compute move at the papers'
learning rates, checkpoint as fp32 and resume exactly; the precision config is checked.

bf16 keeps 8 significant bits, so an update below 2^-8 of a weight rounds away when the weight
itself is stored in bf16: AdamW's first step moves every weight by about lr, which at lr 1e-6 is
far below that for weights of the tiny model's scale (0.5), and far above fp32's 2^-24.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import entry_points
import toy_task
from marl_jax.errors import UserInputError
from marl_jax.models.loading import load_model
from marl_jax.training import config as config_lib
from marl_jax.training import trainer
from marl_jax.training.checkpoint import CHECKPOINT_DIR, Checkpointer
from marl_jax.training.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  toy_task.register()  # conftest's registration may have been replaced by another module's
  return tiny_model_dir


def _config(model_dir, steps=1, **precision):
  c = toy_task.toy_config(model_dir, steps=steps)
  c.optim.lr = 1e-6
  for name, value in precision.items():
    c[name] = value
  return c


def _fraction_moved(model_dir, tmp_path, **precision) -> float:
  """The fraction of the model's weights one RL step (AdamW at lr 1e-6) changes at all."""
  run = trainer.Run(_config(model_dir, **precision), str(tmp_path))
  dtype = precision.get("param_dtype", "float32")
  before = jax.tree.map(np.asarray, load_model(model_dir, param_dtype=dtype).params)
  run.train_step(0)
  after = jax.device_get(run.state.params["policy"])
  assert all(x.dtype == before_x.dtype
             for x, before_x in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
  moved = sum(int(np.sum(np.asarray(a, np.float32) != np.asarray(b, np.float32)))
              for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
  return moved / sum(x.size for x in jax.tree.leaves(before))


def test_bf16_compute_moves_as_many_weights_as_fp32_at_lr_1e6(model_dir, tmp_path):
  fp32 = _fraction_moved(model_dir, tmp_path / "fp32", compute_dtype="float32")
  mixed = _fraction_moved(model_dir, tmp_path / "mixed", compute_dtype="bfloat16")
  stored = _fraction_moved(model_dir, tmp_path / "stored", compute_dtype="bfloat16",
                           param_dtype="bfloat16", allow_bf16_params=True)
  assert fp32 > 0.9, fp32  # tied embeddings: the LM head's gradient reaches every weight
  assert mixed >= 0.95 * fp32, (mixed, fp32)
  assert stored < 0.1, stored  # what fp32 masters prevent: bf16 storage rounds the step away


def test_bf16_compute_checkpoints_fp32_masters_and_resumes_exactly(model_dir, tmp_path):
  straight = _config(model_dir, steps=3, compute_dtype="bfloat16")
  trainer.train(straight, str(tmp_path / "straight"))
  trainer.train(_config(model_dir, steps=2, compute_dtype="bfloat16"), str(tmp_path / "resumed"))
  trainer.train(_config(model_dir, steps=3, compute_dtype="bfloat16"), str(tmp_path / "resumed"))
  metrics = lambda d: {r["step"]: {k: v for k, v in r.items() if not k.startswith("time/")}
                       for r in read_metrics(d)}
  assert metrics(tmp_path / "resumed")[3] == metrics(tmp_path / "straight")[3]
  params = []
  for name in ("straight", "resumed"):
    with Checkpointer(str(tmp_path / name / CHECKPOINT_DIR)) as checkpoints:
      params.append(checkpoints.restore(3).state["train"]["params"]["policy"])
  for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1])):
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
  kernel = np.asarray(params[0]["layers"]["mlp"]["up_proj"]["kernel"])
  on_bf16_grid = kernel == kernel.astype(jax.numpy.bfloat16).astype(np.float32)
  assert on_bf16_grid.mean() < 0.1  # fp32 masters, not bf16 values kept in fp32 buffers


def test_precision_config_is_checked():
  c = config_lib.base_config()
  assert (c.param_dtype, c.compute_dtype, c.allow_bf16_params) == ("float32", "auto", False)
  c.param_dtype = "bfloat16"
  with pytest.raises(UserInputError, match="param_dtype='bfloat16' stores trainable params .* "
                     "expected param_dtype='float32' with compute_dtype='bfloat16', or "
                     "allow_bf16_params=True"):
    config_lib.build(c)
  c.allow_bf16_params = True
  config_lib.build(c)
  c = config_lib.base_config()
  c.compute_dtype = "float16"
  with pytest.raises(UserInputError, match=r"config.compute_dtype='float16'; expected one of "
                     r"\['auto', 'float32', 'bfloat16'\]"):
    config_lib.build(c)
  c = config_lib.base_config()
  c.dtype = "bfloat16"  # a config file of the old schema
  with pytest.raises(UserInputError, match="config.dtype was split into config.compute_dtype"):
    config_lib.build(c)


def test_old_dtype_flag_gets_one_line_pointing_at_compute_dtype(tmp_path):
  result = entry_points.run("train", "--config=configs/atgrpo_plan_path.py:cpu",
                            f"--workdir={tmp_path / 'run'}", "--config.dtype=bfloat16")
  entry_points.error_line(result, "--config.dtype", "--config.compute_dtype=bfloat16")
