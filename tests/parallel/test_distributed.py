"""Multi-process start-up: launch detection, and two real CPU processes that train and checkpoint.

The two-process test runs this file as a script (`python tests/test_distributed.py WORKER ...`):
each process has 2 CPU devices, joins a localhost coordinator, runs the same jitted shard_map
gradient steps of a linear model on a global (data=2, fsdp=2) mesh (its half of the data assembled
with `make_array_from_process_local_data`), then saves and restores one orbax checkpoint together.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from marl_jax.parallel import distributed
from marl_jax.parallel.distributed import LaunchSpec, detect_launch
from marl_jax.parallel.mesh import BATCH_AXES, make_mesh

REPO = Path(__file__).resolve().parents[2]
NUM_PROCESSES, LOCAL_DEVICES, LOCAL_SAMPLES, DIM, STEPS, LR = 2, 2, 8, 3, 3, 0.1


def test_single_process_is_a_no_op():
  assert detect_launch(environ={}) == LaunchSpec("none")
  # One Slurm task (e.g. an interactive salloc shell) is still a single process.
  assert detect_launch(environ={"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
                       ).method == "none"
  assert detect_launch(environ={distributed.METHOD_ENV: "none",
                                "JAX_COORDINATOR_ADDRESS": "h:1"}).method == "none"


def test_explicit_flags_and_environment():
  assert detect_launch("10.0.0.1:1234", 4, 3, environ={}) == LaunchSpec(
      "explicit", "10.0.0.1:1234", 4, 3)
  env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:999", "JAX_NUM_PROCESSES": "2",
         "JAX_PROCESS_ID": "1"}
  assert detect_launch(environ=env) == LaunchSpec("explicit", "127.0.0.1:999", 2, 1)
  with pytest.raises(ValueError, match=r"missing \['process_id'\]"):
    detect_launch("h:1", 2, environ={})
  with pytest.raises(ValueError, match=r"process_id 2; expected 0 <= process_id < num_processes"):
    detect_launch("h:1", 2, 2, environ={})
  with pytest.raises(ValueError, match=r"coordinator_address 'h'; expected 'host:port'"):
    detect_launch("h", 2, 0, environ={})
  with pytest.raises(ValueError, match=r"JAX_NUM_PROCESSES='two'; expected an integer"):
    detect_launch(environ=env | {"JAX_NUM_PROCESSES": "two"})
  with pytest.raises(ValueError, match=r"\['JAX_PROCESS_ID'\]"):
    detect_launch(method="explicit", environ={"JAX_COORDINATOR_ADDRESS": "h:1",
                                              "JAX_NUM_PROCESSES": "2"})
  with pytest.raises(ValueError, match=r"unknown distributed method 'mpi'"):
    detect_launch(environ={distributed.METHOD_ENV: "mpi"})


def _slurm_env(**overrides):
  env = {"SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "gpu[007-008,012],cpu1",
         "SLURM_NTASKS": "32", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
         "SLURM_STEP_NUM_NODES": "4"}
  env.update(overrides)
  return env


def test_slurm_one_process_per_gpu_and_per_node():
  port = 61440 + 123456 % 4096
  # 4 nodes x 8 tasks, each task sees all 8 GPUs: the task takes the GPU of its local id.
  assert detect_launch(environ=_slurm_env()) == LaunchSpec(
      "slurm", f"gpu007:{port}", 32, 9, (1,))
  # --gpus-per-task=1: Slurm already narrowed CUDA_VISIBLE_DEVICES to the task's GPU.
  assert detect_launch(environ=_slurm_env(CUDA_VISIBLE_DEVICES="5")).local_device_ids is None
  # One task per node: the process drives every GPU of its node.
  spec = detect_launch(environ=_slurm_env(SLURM_NTASKS="4", SLURM_PROCID="2",
                                          CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
                                          JAX_COORDINATOR_PORT="5000"))
  assert spec == LaunchSpec("slurm", "gpu007:5000", 4, 2, None)
  with pytest.raises(ValueError, match="launch the processes with srun"):
    detect_launch(method="slurm", environ={"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize("nodelist, first", [
    ("node001", "node001"), ("a-1,b-2", "a-1"), ("gpu[12,15-16]", "gpu12"),
    ("rack[3-4]-n[07-09],x", "rack3-n07"), ("c[001-004]x", "c001x")])
def test_slurm_first_host(nodelist, first):
  assert distributed.slurm_first_host(nodelist) == first


def test_tpu_pod_detection():
  assert detect_launch(environ={distributed.METHOD_ENV: "tpu"}) == LaunchSpec("tpu")
  assert detect_launch(environ={"TPU_WORKER_HOSTNAMES": "t-w-0,t-w-1"}).method == "tpu"
  assert detect_launch(environ={"TPU_WORKER_HOSTNAMES": "localhost"}).method == "none"


def test_launch_scripts_parse():
  scripts = sorted((REPO / "launch").glob("*.sh")) + sorted((REPO / "launch").glob("*.sbatch"))
  assert {p.name for p in scripts} >= {"local.sh", "tpu_pod.sh", "slurm_gpu.sbatch"}
  for script in scripts:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, f"{script.name}: {result.stderr}"
    assert os.access(script, os.X_OK), f"{script.name} is not executable"


_PRINT_ENV = ("import os; print(os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'], "
              "os.environ['JAX_COORDINATOR_ADDRESS'], os.environ['MARL_JAX_DISTRIBUTED'])")


def test_local_launcher_starts_processes_and_propagates_failure():
  run = subprocess.run([str(REPO / "launch/local.sh"), "-n", "2", sys.executable, "-c", _PRINT_ENV],
                       capture_output=True, text=True, timeout=30)
  assert run.returncode == 0, run.stderr
  lines = sorted(run.stdout.splitlines())
  assert [l.split()[:3] for l in lines] == [["[p0]", "0", "2"], ["[p1]", "1", "2"]]
  assert lines[0].split()[3:] == lines[1].split()[3:]  # one coordinator for both
  assert lines[0].split()[3].startswith("127.0.0.1:") and lines[0].split()[4] == "explicit"

  # Process 1 fails at once; process 0 would sleep for a minute: it is stopped, status is kept.
  failing = ("import os, sys, time; pid = int(os.environ['JAX_PROCESS_ID']); "
             "time.sleep(0 if pid else 60); sys.exit(3)")
  run = subprocess.run([str(REPO / "launch/local.sh"), "-n", "2", sys.executable, "-c", failing],
                       capture_output=True, text=True, timeout=30)
  assert run.returncode == 3 and "failed (exit 3); stopping the others" in run.stderr


def _fake_tool(bin_dir: Path, name: str, body: str) -> None:
  path = bin_dir / name
  path.write_text("#!/usr/bin/env bash\n" + body)
  path.chmod(0o755)


def test_tpu_launcher_runs_the_quoted_command_on_all_workers(tmp_path):
  calls = tmp_path / "calls"
  _fake_tool(tmp_path, "gcloud", f'printf "%s\\n" "$@" >> {calls}; echo --- >> {calls}\n')
  env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", SETUP="source venv/bin/activate")
  run = subprocess.run([str(REPO / "launch/tpu_pod.sh"), "my-v5e-32", "--zone", "us-west4-a", "--",
                        "python", "-m", "experiments.train", "--workdir=runs/a b"],
                       capture_output=True, text=True, env=env, timeout=30)
  assert run.returncode == 0, run.stderr
  assert calls.read_text().split("\n")[:-2] == [
      "compute", "tpus", "tpu-vm", "ssh", "my-v5e-32", "--worker=all", "--zone=us-west4-a",
      "--command=cd marl_jax && source venv/bin/activate && MARL_JAX_DISTRIBUTED=tpu "
      "python -m experiments.train --workdir=runs/a\\ b "]


def test_slurm_script_starts_srun_with_slurm_start_up(tmp_path):
  # A fake srun runs the command once in place; the Slurm variables are those of task 3 of 8 on
  # 2 nodes with all 4 GPUs of a node visible.
  _fake_tool(tmp_path, "srun", 'while [[ "$1" == --* ]]; do shift; done; exec "$@"\n')
  env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", PYTHONPATH=str(REPO),
             SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu[3-4]",
             SLURM_STEP_NODELIST="gpu[3-4]", SLURM_NTASKS="8", SLURM_STEP_NUM_NODES="2",
             SLURM_PROCID="3", SLURM_LOCALID="3", CUDA_VISIBLE_DEVICES="0,1,2,3")
  env.pop(distributed.METHOD_ENV, None)
  code = "from marl_jax.parallel.distributed import detect_launch; print(repr(detect_launch()))"
  run = subprocess.run(["bash", str(REPO / "launch/slurm_gpu.sbatch"), sys.executable, "-c", code],
                       capture_output=True, text=True, env=env, timeout=60)
  assert run.returncode == 0, run.stderr
  expected = LaunchSpec("slurm", f"gpu3:{61440 + 4242 % 4096}", 8, 3, (3,))
  assert run.stdout.splitlines()[-1] == repr(expected)


def _local_data(process_id: int) -> tuple[np.ndarray, np.ndarray]:
  """This process's samples: x [LOCAL_SAMPLES, DIM], y [LOCAL_SAMPLES]."""
  rng = np.random.default_rng(100 + process_id)
  x = rng.normal(size=(LOCAL_SAMPLES, DIM)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1).astype(np.float32)
  return x, y


def _worker(process_id: int, port: int, out_dir: str) -> None:
  """One process of the two-process run; writes what it computed to out_dir/process_<id>.json."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from marl_jax.training.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel

  info = distributed.initialize_distributed(f"127.0.0.1:{port}", NUM_PROCESSES, process_id,
                                            initialization_timeout_s=60)
  mesh = make_mesh(data=NUM_PROCESSES, fsdp=LOCAL_DEVICES)  # data spans the two processes
  x, y = _local_data(process_id)
  batch = distributed.process_local_batch_to_global({"x": x, "y": y}, mesh)

  def local_grad(w, x, y):  # per-device sums, reduced over the data axis like the train step
    err = x @ w - y
    return jax.lax.psum(x.T @ err, BATCH_AXES), jax.lax.psum(jnp.sum(err ** 2), BATCH_AXES)

  grad_fn = jax.shard_map(local_grad, mesh=mesh, in_specs=(P(), P(BATCH_AXES), P(BATCH_AXES)),
                          out_specs=(P(), P()))
  num_samples = NUM_PROCESSES * LOCAL_SAMPLES

  @jax.jit
  def train(w, x, y):
    losses = []
    for _ in range(STEPS):
      grad_sum, sq_err = grad_fn(w, x, y)
      losses.append(sq_err / num_samples)
      w = w - LR * 2.0 * grad_sum / num_samples
    return w, jnp.stack(losses)

  w, losses = train(jnp.zeros(DIM, jnp.float32), batch["x"], batch["y"])
  w_local = np.asarray(w.addressable_data(0))
  ckpt = Checkpointer(Path(out_dir) / "ckpt")
  ckpt.save(STEPS, {"w": w, "rng": jax.random.key(7)}, {"cursor": 10 * process_id + STEPS})
  restored = ckpt.restore(target={"w": w, "rng": jax.random.key(0)})
  try:  # per-process values do not belong in the device state
    ckpt.save(STEPS + 1, {"rng": jax.random.key(process_id)}, {})
    mismatch = ""
  except ValueError as e:
    mismatch = str(e)
  result = {
      "info": [info.method, info.process_index, info.process_count, info.local_device_count,
               info.device_count],
      "batch_shape": list(batch["x"].shape),
      "w": w_local.tolist(),
      "w_hex": w_local.tobytes().hex(),
      "losses": np.asarray(losses.addressable_data(0)).tolist(),
      "restored_w_hex": np.asarray(restored.state["w"].addressable_data(0)).tobytes().hex(),
      "restored_key": np.asarray(jax.random.key_data(restored.state["rng"])).tolist(),
      "restored_host": restored.host_state,
      "mismatch": mismatch,
  }
  (Path(out_dir) / f"process_{process_id}.json").write_text(json.dumps(result))


def _numpy_reference() -> tuple[np.ndarray, list[float]]:
  data = [_local_data(p) for p in range(NUM_PROCESSES)]
  x = np.concatenate([d[0] for d in data]).astype(np.float64)
  y = np.concatenate([d[1] for d in data]).astype(np.float64)
  w, losses = np.zeros(DIM), []
  for _ in range(STEPS):
    err = x @ w - y
    losses.append(np.mean(err ** 2))
    w = w - LR * 2.0 * x.T @ err / len(y)
  return w, losses


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_train_and_checkpoint_together(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}")
  env.pop(distributed.METHOD_ENV, None)
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, __file__, "worker", str(p), str(port), str(tmp_path)],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for p in range(NUM_PROCESSES)]
  try:
    logs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]

  results = [json.loads((tmp_path / f"process_{p}.json").read_text())
             for p in range(NUM_PROCESSES)]
  w_ref, losses_ref = _numpy_reference()
  for p, result in enumerate(results):
    assert result["info"] == ["explicit", p, NUM_PROCESSES, LOCAL_DEVICES,
                              NUM_PROCESSES * LOCAL_DEVICES]
    assert result["batch_shape"] == [NUM_PROCESSES * LOCAL_SAMPLES, DIM]
    np.testing.assert_allclose(result["w"], w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result["losses"], losses_ref, rtol=1e-5)
    assert result["restored_w_hex"] == result["w_hex"]
    assert result["restored_key"] == [0, 7]
    assert result["restored_host"] == {"cursor": 10 * p + STEPS}  # each process gets its own
    assert "leaf ['rng'] is process-local and differs between processes" in result["mismatch"]
  assert results[0]["w_hex"] == results[1]["w_hex"]  # both processes agree bit for bit


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
  _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
