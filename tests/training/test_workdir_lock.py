"""One writer per workdir: a second writer is refused in one line naming the holder, and readers
leave a writer's checkpoints (its in-progress temporary directories included) alone, while the
step a reader holds outlives the writer's rotation."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from marl_jax.errors import UserInputError
from marl_jax.training import checkpoint, trainer, workdir_lock
from marl_jax.training.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HOLD = ("import sys, time\nfrom marl_jax.training import workdir_lock\n"
         "with workdir_lock.exclusive(sys.argv[1]):\n  print('held', flush=True)\n"
         "  time.sleep(60)\n")


@pytest.fixture
def held(tmp_path):
  """The workdir's lock held by another process (killed at the end of the test)."""
  workdir = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(workdir), "--marker=holder"],
                          stdout=subprocess.PIPE, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
  assert proc.stdout.readline() == "held\n"
  yield workdir, proc
  proc.kill()
  proc.wait()


def test_second_writer_is_refused_naming_the_holder(held):
  workdir, proc = held
  with pytest.raises(workdir_lock.WorkdirBusy) as refused:
    with workdir_lock.exclusive(workdir):
      pass
  line = refused.value.report()
  assert "\n" not in line and line.startswith(f"error: workdir '{workdir}' is being written by")
  assert f"pid {proc.pid} on {socket.gethostname()}" in line and "--marker=holder" in line
  proc.kill()
  proc.wait()  # the kernel drops a dead holder's lock: no stale lock to clean up
  with workdir_lock.exclusive(workdir):
    assert f"pid {os.getpid()}" in workdir_lock._holder(os.open(workdir / "writer.lock",
                                                                os.O_RDONLY))


def test_train_is_refused_before_any_compute(held):
  workdir, proc = held
  start = time.monotonic()
  with pytest.raises(workdir_lock.WorkdirBusy, match=f"pid {proc.pid}"):
    trainer.train(None, str(workdir))  # no config needed: refused before it is read
  assert time.monotonic() - start < 5.0
  assert sorted(os.listdir(workdir)) == ["writer.lock"]


def test_lock_is_held_within_one_process_too(tmp_path):
  with workdir_lock.exclusive(tmp_path):
    with pytest.raises(workdir_lock.WorkdirBusy):
      with workdir_lock.exclusive(tmp_path):
        pass


def _in_progress_save(directory, stamp: int) -> str:
  """A writer's save of step 2 that has not been committed yet (orbax's temporary directory)."""
  name = f"2{checkpoint.ocp.utils.TMP_DIR_SUFFIX}-{stamp}"
  os.makedirs(os.path.join(directory, name, "state"))
  return name


def test_readers_leave_a_writers_temporary_directories(tmp_path):
  directory = tmp_path / "checkpoints"
  with Checkpointer(directory) as writer:
    writer.save(1, {"w": jnp.arange(3.0)}, {"next_step": 1})
  # A writer opening the directory removes interrupted saves (safe: it is the only writer); orbax
  # does so in a background thread.
  tmp = _in_progress_save(directory, 1700000000)
  start = time.monotonic()
  with Checkpointer(directory):
    while tmp in os.listdir(directory) and time.monotonic() - start < 10:
      time.sleep(0.02)
  took = time.monotonic() - start
  assert tmp not in os.listdir(directory)
  tmp = _in_progress_save(directory, 1700000001)
  with Checkpointer(directory, read_only=True) as reader:
    assert reader.restore().step == 1
    with pytest.raises(RuntimeError, match="read-only"):
      reader.save(3, {"w": jnp.arange(3.0)})
    time.sleep(max(0.5, 3 * took))
  assert tmp in os.listdir(directory)


def test_reader_skips_a_damaged_step_without_renaming_it(tmp_path):
  directory = tmp_path / "checkpoints"
  with Checkpointer(directory) as writer:
    for step in (1, 2):
      writer.save(step, {"w": jnp.arange(3.0) + step}, {"next_step": step})
  (directory / "2" / "checksums" / "metadata").write_text("{}")  # step 2 now fails its checks
  for name in os.listdir(directory / "2" / "checksums"):
    (directory / "2" / "checksums" / name).write_bytes(b"not json")
  with Checkpointer(directory, read_only=True) as reader:
    assert reader.restore().step == 1
  assert sorted(os.listdir(directory)) == ["1", "2"]


def test_checkpoint_of_another_model_is_one_line(tmp_path):
  directory = tmp_path / "checkpoints"
  with Checkpointer(directory) as writer:
    writer.save(1, {"w": jnp.zeros((3, 4))}, {})
  with Checkpointer(directory, read_only=True) as reader:
    with pytest.raises(checkpoint.CheckpointMismatchError) as refused:
      reader.restore(1, target={"w": jnp.zeros((5, 4))})
  line = refused.value.report()
  assert "\n" not in line and "does not fit this config's model and team" in line


def test_a_step_a_reader_holds_outlives_the_writers_rotation(tmp_path):
  """max_to_keep=1 keeps only the newest step, and the one a reader holds while it reads; the
  first save after the reader let go rotates that away too."""
  with Checkpointer(tmp_path / "checkpoints", max_to_keep=1) as writer:
    writer.save(1, {"w": jnp.zeros(2)})
    with workdir_lock.reading(tmp_path, 1):
      assert workdir_lock.held_steps(tmp_path) == {1}
      for step in (2, 3):
        writer.save(step, {"w": jnp.full(2, step)})
      assert checkpoint.saved_steps(tmp_path) == [1, 3]
      with Checkpointer(tmp_path / "checkpoints", read_only=True) as reader:
        assert int(reader.restore(1).state["w"][0]) == 0
    assert workdir_lock.held_steps(tmp_path) == set()
    writer.save(4, {"w": jnp.full(2, 4)})
  assert checkpoint.saved_steps(tmp_path) == [4]


def test_holding_takes_the_newest_step_or_refuses_a_missing_one(tmp_path):
  with pytest.raises(UserInputError, match=f"{tmp_path} has no checkpoint; expected the workdir"):
    with checkpoint.holding(tmp_path):
      pass
  with Checkpointer(tmp_path / "checkpoints") as writer:
    for step in (2, 5):
      writer.save(step, {"w": jnp.zeros(2)})
  with checkpoint.holding(tmp_path) as step:
    assert step == 5 and workdir_lock.held_steps(tmp_path) == {5}
  with pytest.raises(UserInputError, match=r"--checkpoint=3: .* has checkpoints \[2, 5\]; "
                                           "expected a saved step"):
    with checkpoint.holding(tmp_path, 3):
      pass
