"""Checkpointer: bitwise round trips, keep-last-k, failed writes, SIGKILL-then-resume and damaged
checkpoints (flipped bytes, truncated or missing items)."""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from etils import epath
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

from marl_jax.training import checkpoint
from marl_jax.training.checkpoint import Checkpointer, CheckpointWriteError
from marl_jax.training.checkpoint_integrity import CheckpointDamagedError
import host
from host import cpu_devices

REPO = Path(__file__).resolve().parents[2]


def _train_state(seed: int = 0):
  """params (sharded fp32 + a bf16 leaf), adamw state after one update, keys, step."""
  mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=cpu_devices(8))
  rng = np.random.default_rng(seed)
  params = {
      "w": jax.device_put(rng.normal(size=(8, 6)).astype(np.float32),
                          NamedSharding(mesh, P("fsdp", None))),
      "scale": jnp.asarray(rng.normal(size=(5,)), jnp.bfloat16),
  }
  opt = optax.adamw(1e-2, weight_decay=0.01)
  opt_state = opt.init(params)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
  updates, opt_state = opt.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return {
      "params": params,
      "opt_state": opt_state,
      "rng": jax.random.split(jax.random.key(seed), 3),  # typed keys [3]
      "legacy_rng": jax.random.PRNGKey(seed + 1),  # raw uint32[2] key data
      "step": jnp.int32(7),
  }


def _host_state(seed: int = 0) -> dict:
  gen = np.random.default_rng(seed)
  gen.integers(0, 100, size=5)  # advance the generator so its state is not the seed's
  return {"cursor": 42, "epoch": 1, "order": [3, 1, 2], "numpy_rng": gen.bit_generator.state}


def _assert_bitwise_equal(expected, actual):
  assert jax.tree.structure(expected) == jax.tree.structure(actual)
  for e, a in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)):
    assert e.dtype == a.dtype, (e.dtype, a.dtype)
    assert e.sharding == a.sharding, (e.sharding, a.sharding)
    if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
      e, a = jax.random.key_data(e), jax.random.key_data(a)
    assert np.asarray(e).tobytes() == np.asarray(a).tobytes()


def test_roundtrip_is_bitwise_with_abstract_target(tmp_path):
  state, host = _train_state(), _host_state()
  ckpt = Checkpointer(tmp_path, max_to_keep=3)
  assert ckpt.latest_step() is None
  assert ckpt.save(7, state, host)
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

  restored = ckpt.restore(target=target)

  assert restored.step == 7
  _assert_bitwise_equal(state, restored.state)
  assert restored.host_state == host
  # The numpy generator continues exactly where the saved one was.
  gen = np.random.default_rng()
  gen.bit_generator.state = restored.host_state["numpy_rng"]
  reference = np.random.default_rng(0)
  reference.integers(0, 100, size=5)
  np.testing.assert_array_equal(gen.normal(size=4), reference.normal(size=4))
  # A restored typed key draws the same numbers as the original.
  np.testing.assert_array_equal(jax.random.normal(restored.state["rng"][1], (3,)),
                                jax.random.normal(state["rng"][1], (3,)))


def test_restore_or_init_starts_fresh_then_resumes(tmp_path):
  init, host = _train_state(seed=1), {"cursor": 0}
  ckpt = Checkpointer(tmp_path)
  fresh = ckpt.restore_or_init(init, host)
  assert fresh.step is None and fresh.state is init and fresh.host_state == host

  later = _train_state(seed=2)
  ckpt.save(3, later, {"cursor": 9})
  resumed = Checkpointer(tmp_path).restore_or_init(init, host)  # a new process on the same dir
  assert resumed.step == 3 and resumed.host_state == {"cursor": 9}
  _assert_bitwise_equal(later, resumed.state)


def test_keeps_last_k_and_saves_every_n_steps(tmp_path):
  state = {"w": jnp.zeros(3), "step": jnp.int32(0)}
  ckpt = Checkpointer(tmp_path, max_to_keep=2, every_steps=2)
  written = [ckpt.save(s, state, {"s": s}) for s in range(1, 8)]
  assert written == [False, True, False, True, False, True, False]
  assert ckpt.save(7, state, {"s": 7}, force=True)
  assert not ckpt.save(7, state, {"s": 7}, force=True)  # already saved: no duplicate-step error
  assert ckpt.all_steps() == [6, 7]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["6", "7"]
  assert ckpt.restore(6).host_state == {"s": 6}


def test_rotation_keeps_step_zero(tmp_path):
  """Step 0 (the warm-start's checkpoint, the fork point of `init_from`) outlives rotation; the
  other steps rotate as before, also when the checkpointer is reopened."""
  state = {"w": jnp.zeros(3)}
  ckpt = Checkpointer(tmp_path, max_to_keep=2)
  for s in range(5):
    ckpt.save(s, state, {"s": s})
  assert ckpt.all_steps() == [0, 3, 4]
  reopened = Checkpointer(tmp_path, max_to_keep=1)
  reopened.save(5, state, {"s": 5})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "5"]
  assert reopened.restore(0).host_state == {"s": 0}


def test_async_save_then_wait_restores_bitwise(tmp_path):
  state, host = _train_state(seed=3), _host_state(seed=3)
  ckpt = Checkpointer(tmp_path, async_save=True)
  assert ckpt.save(5, state, host)
  ckpt.wait_until_finished()
  assert Checkpointer(tmp_path).all_steps() == [5]
  restored = ckpt.restore(target=state)
  _assert_bitwise_equal(state, restored.state)
  assert restored.host_state == host
  ckpt.close()


def test_restore_errors_name_the_problem(tmp_path):
  ckpt = Checkpointer(tmp_path)
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):
    ckpt.restore()
  ckpt.save(1, {"w": jnp.zeros(2)}, {})
  with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 5 .*have \[1\]"):
    ckpt.restore(5)
  with pytest.raises(TypeError, match="JSON-serialisable"):
    ckpt.save(2, {"w": jnp.zeros(2)}, {"rng": np.random.default_rng(0)})
  with pytest.raises(ValueError, match="max_to_keep=0"):
    Checkpointer(tmp_path / "other", max_to_keep=0)


def test_write_failure_raises_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
  state, host = _train_state(), _host_state()
  ckpt = Checkpointer(tmp_path, max_to_keep=2)
  ckpt.save(1, state, host)
  ckpt.save(2, state, host)

  # Disk full in the middle of step 3: arrays are already in orbax's temporary directory when the
  # JSON write fails. (Tests run as root, so a read-only directory would not stop the write.)
  path_cls = type(epath.Path(tmp_path))
  original_write_text = path_cls.write_text

  def full_disk(self, *args, **kwargs):
    if str(self).startswith(str(tmp_path)):
      raise OSError(errno.ENOSPC, "No space left on device", str(self))
    return original_write_text(self, *args, **kwargs)

  monkeypatch.setattr(path_cls, "write_text", full_disk)
  newer = state | {"step": jnp.int32(8)}
  with pytest.raises(CheckpointWriteError, match=r"step 3 .*No space left.*step 2\) is intact"):
    ckpt.save(3, newer, host)
  monkeypatch.undo()

  names = sorted(p.name for p in tmp_path.iterdir())
  assert "3" not in names, names  # never committed: orbax writes into a temporary dir first
  assert [n for n in names if n not in ("1", "2")] == ["3.orbax-checkpoint-tmp"], names
  resumed = Checkpointer(tmp_path, max_to_keep=2)  # the restarted run
  assert resumed.all_steps() == [1, 2]
  restored = resumed.restore(target=state)
  assert restored.step == 2 and restored.host_state == host
  _assert_bitwise_equal(state, restored.state)
  # The restarted run can write step 3 again; orbax removes the stale temporary dir first.
  assert resumed.save(3, newer, host)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3"]
  _assert_bitwise_equal(newer, Checkpointer(tmp_path).restore(target=state).state)


# A tiny deterministic "training" loop: the child runs it under a Checkpointer; the test replays it
# in-process as the uninterrupted reference.
_STEP_SRC = """
def train_step(state, host):
  rng, sub = jax.random.split(state["rng"])
  w = state["w"] * 0.5 + jax.random.normal(sub, state["w"].shape)
  return {"w": w, "rng": rng, "step": state["step"] + 1}, {"cursor": host["cursor"] + 3}

INIT_STATE = {"w": jnp.zeros((4,)), "rng": jax.random.key(0), "step": jnp.int32(0)}
"""

_CHILD_SRC = """
import sys
import jax, jax.numpy as jnp, numpy as np
from marl_jax.training.checkpoint import Checkpointer
""" + _STEP_SRC + """
ckpt = Checkpointer(sys.argv[1], max_to_keep=2)
restored = ckpt.restore_or_init(INIT_STATE, {"cursor": 0})
state, host = restored.state, restored.host_state
start = restored.step or 0
print("start", start, np.asarray(state["w"]).tobytes().hex(), host["cursor"], flush=True)
for step in range(start + 1, start + 1 + int(sys.argv[2])):
  state, host = train_step(state, host)
  ckpt.save(step, state, host)
  print("saved", step, np.asarray(state["w"]).tobytes().hex(), host["cursor"], flush=True)
"""


def _reference(num_steps: int) -> list[tuple[str, int]]:
  scope = {"jax": jax, "jnp": jnp}
  exec(_STEP_SRC, scope)  # pylint: disable=exec-used
  state, host = scope["INIT_STATE"], {"cursor": 0}
  out = [(np.asarray(state["w"]).tobytes().hex(), 0)]
  for _ in range(num_steps):
    state, host = scope["train_step"](state, host)
    out.append((np.asarray(state["w"]).tobytes().hex(), host["cursor"]))
  return out


def _child(workdir: Path, num_steps: int) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
             XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {host.SUITE_XLA_FLAGS}")
  return subprocess.Popen([sys.executable, "-c", _CHILD_SRC, str(workdir), str(num_steps)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                          cwd=REPO)


def test_sigkill_mid_run_resumes_from_last_completed_checkpoint(tmp_path):
  reference = _reference(40)
  first = _child(tmp_path, 1000)
  printed = []
  for line in first.stdout:
    printed.append(line.split())
    if printed[-1][:2] == ["saved", "3"]:
      first.send_signal(signal.SIGKILL)  # the child is already writing step 4 or later
      break
  rest, _ = first.communicate(timeout=60)
  assert first.returncode == -signal.SIGKILL
  printed += [line.split() for line in rest.splitlines()]
  last_reported = max(int(p[1]) for p in printed if p[0] == "saved")
  for kind, step, w_hex, cursor in printed[1:]:
    assert (w_hex, int(cursor)) == reference[int(step)], f"{kind} {step}"

  second = _child(tmp_path, 2)
  out, _ = second.communicate(timeout=60)
  assert second.returncode == 0, out
  lines = [line.split() for line in out.splitlines()]
  start = int(lines[0][1])
  # Every save that returned before the kill survived; the resumed run continues the same run.
  assert start >= last_reported >= 3
  assert lines[0][0] == "start" and (lines[0][2], int(lines[0][3])) == reference[start]
  for kind, step, w_hex, cursor in lines[1:]:
    assert kind == "saved" and (w_hex, int(cursor)) == reference[int(step)], step
  assert [int(l[1]) for l in lines[1:]] == [start + 1, start + 2]
  assert Checkpointer(tmp_path).all_steps() == [start + 1, start + 2]


def test_checkpointer_from_config(tmp_path):
  cfg = checkpoint.default_config()
  cfg.every_steps = 5
  ckpt = Checkpointer.from_config(cfg, tmp_path)
  assert str(ckpt.directory) == str(tmp_path / checkpoint.CHECKPOINT_DIR)
  assert not ckpt.save(4, {"w": jnp.zeros(1)}, {})
  assert ckpt.save(5, {"w": jnp.zeros(1)}, {})


# ------------------------------------------------------------------------------ damaged checkpoints

def _three_steps(directory: Path) -> dict[int, dict]:
  """Steps 1..3 of distinct states (big enough that the arrays fill a data file of their own)."""
  states = {}
  ckpt = Checkpointer(directory, max_to_keep=3)
  for step in (1, 2, 3):
    rng = np.random.default_rng(step)
    states[step] = {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32),
                    "b": jnp.asarray(rng.integers(0, 9, size=(7,)), jnp.int32)}
    ckpt.save(step, states[step], {"cursor": step})
  ckpt.close()
  return states


def _tree_digest(directory: Path) -> dict[str, str]:
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def _largest_data_file(step_dir: Path) -> Path:
  return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)


def _flip_bytes(step_dir: Path) -> None:
  path = _largest_data_file(step_dir)
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  for i in range(middle, middle + 64):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def _truncate(step_dir: Path) -> None:
  path = _largest_data_file(step_dir)
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 3])


def _delete_state_item(step_dir: Path) -> None:
  shutil.rmtree(step_dir / "state")


def _delete_host_item(step_dir: Path) -> None:
  shutil.rmtree(step_dir / "host")


@pytest.mark.parametrize("damage, why", [
    (_flip_bytes, r"1 state array\(s\) do not match their saved checksums \(w\)"),
    (_truncate, r"its items cannot be read"),
    (_delete_state_item, r"its items cannot be read"),
    (_delete_host_item, r"its items cannot be read"),
])
def test_damaged_latest_step_falls_back_to_newest_intact_one(tmp_path, caplog, damage, why):
  states = _three_steps(tmp_path)
  damage(tmp_path / "3")
  damaged_files = _tree_digest(tmp_path / "3")
  target = {"w": jnp.zeros((64, 64), jnp.float32), "b": jnp.zeros((7,), jnp.int32)}

  with caplog.at_level(logging.WARNING):
    restored = Checkpointer(tmp_path).restore_or_init(target, {"cursor": 0})

  assert restored.step == 2 and restored.host_state == {"cursor": 2}
  _assert_bitwise_equal(states[2], restored.state)
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and "checkpoint step" in r.getMessage()]
  assert len(warnings) == 1 and "\n" not in warnings[0], warnings
  assert re.fullmatch(rf"skipping checkpoint step 3: {why}.*; kept it aside as "
                      rf"{re.escape(str(tmp_path / '3.damaged'))}", warnings[0]), warnings[0]
  # Kept aside untouched, never deleted; orbax no longer lists it.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3.damaged"]
  assert Checkpointer(tmp_path).all_steps() == [1, 2]  # a restarted run: orbax leaves it alone
  assert _tree_digest(tmp_path / "3.damaged") == damaged_files


def test_two_damaged_steps_fall_back_twice_and_keep_both_aside(tmp_path, caplog):
  states = _three_steps(tmp_path)
  _flip_bytes(tmp_path / "3")
  _truncate(tmp_path / "2")
  with caplog.at_level(logging.WARNING):
    restored = Checkpointer(tmp_path).restore(target=states[1])
  assert restored.step == 1
  _assert_bitwise_equal(states[1], restored.state)
  skipped = [r.getMessage().split(":")[0] for r in caplog.records
             if "skipping checkpoint" in r.getMessage()]
  assert skipped == ["skipping checkpoint step 3", "skipping checkpoint step 2"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.damaged", "3.damaged"]


def test_every_step_damaged_raises_one_line(tmp_path):
  _three_steps(tmp_path)
  for step in (1, 2, 3):
    _flip_bytes(tmp_path / str(step))
  with pytest.raises(CheckpointDamagedError, match=r"every checkpoint in .* is damaged "
                     r"\(steps \[1, 2, 3\]"):
    Checkpointer(tmp_path).restore_or_init({"w": jnp.zeros((64, 64)), "b": jnp.zeros(7, jnp.int32)},
                                           {"cursor": 0})
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1.damaged", "2.damaged", "3.damaged"]


def test_explicit_damaged_step_raises_and_is_left_in_place(tmp_path):
  _three_steps(tmp_path)
  _flip_bytes(tmp_path / "2")
  with pytest.raises(CheckpointDamagedError, match="do not match their saved checksums"):
    Checkpointer(tmp_path).restore(2)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3"]


def test_target_mismatch_is_not_damage(tmp_path):
  """A changed state layout must fail loudly, never rename intact checkpoints aside."""
  _three_steps(tmp_path)
  with pytest.raises(Exception) as raised:
    Checkpointer(tmp_path).restore(target={"w": jnp.zeros((32, 64)), "b": jnp.zeros(7, jnp.int32)})
  assert not isinstance(raised.value, CheckpointDamagedError)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3"]


def test_saved_steps_lists_complete_steps_without_a_manager(tmp_path):
  """`saved_steps` (the evaluate CLI's check before loading) agrees with the manager's list and
  ignores a save left half-written."""
  from marl_jax.training.checkpoint import CHECKPOINT_DIR, saved_steps
  assert saved_steps(tmp_path) == []
  ckpt = Checkpointer(tmp_path / CHECKPOINT_DIR)
  for step in (1, 2):
    ckpt.save(step, {"w": jnp.zeros(2)}, {"s": step})
  (tmp_path / CHECKPOINT_DIR / "3.orbax-checkpoint-tmp-7").mkdir()
  assert saved_steps(tmp_path) == ckpt.all_steps() == [1, 2]


@pytest.mark.parametrize("when", ["opening", "listing again"])
def test_a_reader_lists_again_when_rotation_deletes_a_listed_step(tmp_path, monkeypatch, when):
  """A reader beside a live trainer: the writer's rotation deletes step 2 after the reader listed
  it, as orbax looks for its metadata file, so orbax falls back to the directory's time stamp of a
  directory that is gone (seen in CI as FileNotFoundError from `export`). The reader lists again
  and sees the steps that are left; with one try it fails."""
  directory = tmp_path / "checkpoints"
  writer = Checkpointer(directory, max_to_keep=5)
  for step in (1, 2, 3):
    writer.save(step, {"w": jnp.zeros(2)}, {"s": step})
  rotated, kept = str(directory / "2"), str(tmp_path / "2")
  shutil.copytree(rotated, kept)
  real_stat = os.stat
  rotations = []

  def stat_after_rotation(path, *args, **kwargs):
    if os.fspath(path) == os.path.join(rotated, "_CHECKPOINT_METADATA") and not rotations:
      rotations.append(rotated)
      shutil.rmtree(rotated)
    return real_stat(path, *args, **kwargs)

  def race(read, tries):
    shutil.copytree(kept, rotated, dirs_exist_ok=True)
    rotations.clear()
    monkeypatch.setattr(checkpoint, "_LISTING_TRIES", tries)
    monkeypatch.setattr(os, "stat", stat_after_rotation)
    try:
      return read()
    finally:
      monkeypatch.setattr(os, "stat", real_stat)

  read = ((lambda: Checkpointer(directory, read_only=True).all_steps()) if when == "opening"
          else Checkpointer(directory, read_only=True).all_steps)
  with pytest.raises(FileNotFoundError, match=rotated):
    race(read, tries=1)
  assert race(read, tries=5) == [1, 3]
  assert rotations == [rotated]
  assert Checkpointer(directory, read_only=True).restore(3).host_state == {"s": 3}
