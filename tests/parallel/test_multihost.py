"""Multi-host training: two real CPU processes x 2 devices against one process on the same work.

(a) The real train step (`make_train_step`, tiny Llama, GRPO + PPO, 2 micro-batches) on a global
    (data=2, fsdp=2) mesh, each process feeding its half of the batch through
    `process_local_batch_to_global`, against the same step run by this (single) process over 4
    devices on the whole batch: loss, metrics and updated params after two steps. The workers
    also check the host-level exchanges of `parallel/multihost.py` and both ways of getting
    process-local params (aliasing when a process holds whole replicas, gathering when 'fsdp'
    spans the processes), and process 1 alone runs a program on its view.
(b) `trainer.train` for 2 steps on the toy task by two processes, against a one-process run of the
    same config that replays the union of the two processes' rollouts. The two runs cannot sample
    the same tokens: each process draws from its own key stream (`multihost.process_key`), and a
    sampler row's key depends on its position in its process's sampler call. Given the same
    samples, everything after the rollout must agree: the problem slices (the one process asks
    for exactly the union of theirs), the agreed shapes and the assembled batch (hence the train
    metrics, step 2's after step 1's update), and the rollout and eval metrics reduced over
    processes.

Workers are this file run as a script (`python tests/test_multihost_train.py MODE ...`) with a
coordinator on 127.0.0.1, like tests/test_distributed.py.
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# pylint: disable=wrong-import-position
from marl_jax.algos.advantage_config import AdvantageConfig  # noqa: E402
from marl_jax.algos.batch import GroupSpace, TrainBatch, make_batch  # noqa: E402
from marl_jax.algos.losses import LossConfig  # noqa: E402
from marl_jax.algos.optim import OptimConfig  # noqa: E402
from marl_jax.models import decoder  # noqa: E402
from marl_jax.models.config import get_preset  # noqa: E402
from marl_jax.parallel import distributed, multihost, sharding  # noqa: E402
from marl_jax.parallel import policies, update  # noqa: E402
from marl_jax.parallel.mesh import BATCH_AXES, make_mesh  # noqa: E402
from marl_jax.parallel.train_config import TrainConfig, TrainSettings  # noqa: E402
from marl_jax.parallel.train_step import make_train_step  # noqa: E402
from marl_jax.training.metrics import read_metrics  # noqa: E402
import host  # noqa: E402  (its probes start jax's backend: used inside functions only)
# marl_jax.training.trainer and toy_task start the jax backend when imported: the workers import
# them after `initialize_distributed`.

NUM_PROCESSES, LOCAL_DEVICES, STEPS = 2, 2, 2
N, TP, R, A, K = 16, 6, 4, 2, 4  # samples, prompt len, response len, agents, samples per group
# The trainer takes no compiler options: its subprocesses get the same settings as XLA_FLAGS
# (`host.FAST_XLA_FLAGS`).
TIMEOUT_S = 300


# ---------------------------------------------------------------- (a) the real train step


def _train_config():
  policy = policies.PolicyConfig(kind="shared", models=(get_preset("tiny-llama"),),
                                 num_policies=1,
                                 optim=(OptimConfig(lr=1e-3, eps=1e-2, max_grad_norm=1.0),))
  return TrainConfig(policy=policy, advantage=AdvantageConfig("grpo"), loss=LossConfig(),
                     space=GroupSpace(num_problems=N // K, num_agents=A),
                     train=TrainSettings(micro_batches=2))


def _make_inputs(path: Path) -> None:
  """Params and a 16-sample batch whose problem groups 0 and 2 straddle the two processes' halves
  (rows 0-7 | 8-15), so the advantages need statistics from both; written to `path`."""
  cfg = _train_config()
  model = cfg.policy.models[0]
  trainable, frozen = jax.jit(policies.init_params, static_argnums=0,
                              compiler_options=host.FAST_COMPILE)(cfg.policy, jax.random.key(0))
  rng = np.random.default_rng(0)
  pad = rng.integers(0, 3, N)
  prompt_mask = np.arange(TP)[None] >= pad[:, None]
  prompt = np.where(prompt_mask, rng.integers(1, model.vocab_size, (N, TP)), 0).astype(np.int32)
  response = rng.integers(1, model.vocab_size, (N, R)).astype(np.int32)
  token_mask = np.arange(R)[None] < rng.integers(1, R + 1, N)[:, None]
  samples = make_batch(rng.normal(size=N).astype(np.float32),
                       problem_id=((np.arange(N) + 2) // K) % (N // K),
                       agent_id=np.arange(N) % A, policy_id=np.zeros(N, np.int32),
                       token_mask=token_mask)

  @jax.jit
  def logp(params):  # behaviour log-probs near the current policy's: ratios e^(+-0.3)
    tokens = jnp.concatenate([prompt, response], axis=1)
    mask = jnp.concatenate([prompt_mask, np.ones(response.shape, bool)], axis=1)
    logits, _ = decoder.forward(params, tokens, decoder.positions_from_mask(mask), model,
                                attn_mask=mask)
    out = jax.nn.log_softmax(logits[:, TP - 1:-1], axis=-1)
    return jnp.take_along_axis(out, response[..., None], axis=-1)[..., 0]

  old_logp = np.asarray(logp(trainable["policy"])) + 0.3 * rng.normal(size=(N, R))
  batch = TrainBatch(prompt=prompt, prompt_mask=prompt_mask, response=response,
                     old_logp=old_logp.astype(np.float32),
                     samples=jax.tree.map(np.asarray, samples))
  path.write_bytes(pickle.dumps(jax.tree.map(np.asarray, (trainable, frozen, batch))))


def _run_steps(mesh, inputs, rows: slice):
  """STEPS real train steps on `mesh`, this process feeding `rows` of the batch.

  Returns (per-step metrics as host arrays, final TrainState).
  """
  trainable, frozen, batch = inputs
  cfg = _train_config()
  fns = make_train_step(cfg, mesh, compiler_options=host.FAST_COMPILE)
  trainable, frozen = fns.shard_params(trainable, frozen)
  state = fns.init(trainable)
  local = jax.tree.map(lambda x: x[rows], batch)
  global_batch = distributed.process_local_batch_to_global(local, mesh, P(BATCH_AXES))
  history = []
  for _ in range(STEPS):
    state, metrics = update.run(fns, cfg, state, frozen, global_batch, np.random.default_rng(0))
    history.append({k: np.asarray(v) for k, v in jax.device_get(metrics).items()})
  return history, state


def _pointers(x) -> set[int]:
  return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def _check_exchanges(mesh, state, trainable_np, out: dict) -> None:
  """multihost.* in two processes; results go into `out` for the test to assert on."""
  p = jax.process_index()
  out["slice"] = list(multihost.process_slice(5))
  out["agree_max"] = list(multihost.agree_max([p + 1, 10 - p, 7]))
  out["means"] = multihost.global_means({"x": (1.5 + p, 1 + p), "only_p1": (0.1 * p, p),
                                         "never": (0.0, 0)})
  out["keys_differ"] = bool(np.any(jax.random.key_data(multihost.process_key(
      jax.random.key(3))) != jax.random.key_data(jax.random.key(3))))

  # Alias: (data=2, fsdp=2) keeps fsdp inside a process, which holds a whole replica.
  full = multihost_utils.process_allgather(state.params, tiled=True)
  view = multihost.process_local(state.params, mesh)
  leaves, view_leaves = jax.tree.leaves(state.params), jax.tree.leaves(view)
  out["alias_addressable"] = all(v.is_fully_addressable for v in view_leaves)
  out["alias_no_copy"] = all(_pointers(v) == _pointers(x) for v, x in zip(view_leaves, leaves))
  out["alias_equal"] = all(np.array_equal(np.asarray(v), f)
                           for v, f in zip(view_leaves, jax.tree.leaves(full)))
  out["sharded_leaves"] = sum("fsdp" in tuple(x.sharding.spec) for x in leaves)

  # Gather: (data=1, fsdp=4) splits every sharded leaf across the two processes.
  wide = make_mesh(1, 4, 1)
  cfg = _train_config()
  placed = sharding.put(trainable_np, wide, policies.trainable_specs(cfg.policy, trainable_np, 4))
  gathered = multihost.process_local(placed, wide)
  out["gather_addressable"] = all(v.is_fully_addressable for v in jax.tree.leaves(gathered))
  out["gather_equal"] = all(np.array_equal(np.asarray(v), w) for v, w in zip(
      jax.tree.leaves(gathered), jax.tree.leaves(trainable_np)))
  out["split_leaves"] = sum(not x.is_fully_addressable for x in jax.tree.leaves(placed))

  # A program on the view runs on this process alone: process 1 runs one, process 0 does not.
  if p == 1:
    total = jax.jit(lambda t: sum(x.sum() for x in jax.tree.leaves(t)))(view)
    out["local_sum"] = float(total)
    out["local_sum_want"] = float(sum(np.asarray(x, np.float64).sum()
                                      for x in jax.tree.leaves(full)))


def _worker_step(process_id: int, port: int, out_dir: str) -> None:
  distributed.initialize_distributed(f"127.0.0.1:{port}", NUM_PROCESSES, process_id,
                                     initialization_timeout_s=60)
  inputs = pickle.loads((Path(out_dir) / "inputs.pkl").read_bytes())
  mesh = make_mesh(data=NUM_PROCESSES, fsdp=LOCAL_DEVICES)
  half = N // NUM_PROCESSES
  history, state = _run_steps(mesh, inputs, slice(process_id * half, (process_id + 1) * half))
  result = {"history": history,
            "params": multihost_utils.process_allgather(state.params, tiled=True)}
  _check_exchanges(mesh, state, inputs[0], result)
  (Path(out_dir) / f"step_{process_id}.pkl").write_bytes(pickle.dumps(result))


# ---------------------------------------------------------------- (b) the trainer


def _toy_config(model_dir: str):
  import toy_task  # pylint: disable=import-outside-toplevel
  c = toy_task.toy_config(model_dir, steps=STEPS)
  c.train.mesh = (NUM_PROCESSES, LOCAL_DEVICES, 1)
  c.eval.every, c.eval.num_problems, c.eval.k = STEPS, 2, 1
  c.eval.temperature = c.sampling.temperature  # the train rollouts' sampler program serves it
  c.checkpoint.every_steps = STEPS
  c.logging.samples_every = STEPS  # the samples table's hook gathers the targets (a collective)
  return c


def _worker_train(process_id: int, port: int, out_dir: str, model_dir: str) -> None:
  """trainer.train, recording every rollout and every step's scalars of this process."""
  distributed.initialize_distributed(f"127.0.0.1:{port}", NUM_PROCESSES, process_id,
                                     initialization_timeout_s=60)
  import toy_task  # pylint: disable=import-outside-toplevel
  from marl_jax.training import eval_metrics, trainer  # pylint: disable=import-outside-toplevel

  toy_task.register()
  rollouts, scalars = [], []

  def recording(inner):
    def run(problems, *args, **kwargs):
      result = inner(problems, *args, **kwargs)
      rollouts.append(([p.problem_id for p in problems], result))
      return result
    return run

  trainer.rollout = recording(trainer.rollout)
  eval_metrics.rollout = recording(eval_metrics.rollout)
  train_step = trainer.Run.train_step

  def recording_step(run, step):
    out = train_step(run, step)
    scalars.append(out)
    return out

  trainer.Run.train_step = recording_step
  summary = trainer.train(_toy_config(model_dir), str(Path(out_dir) / "run"))
  (Path(out_dir) / f"train_{process_id}.pkl").write_bytes(pickle.dumps(
      {"rollouts": rollouts, "scalars": scalars, "summary": summary}))


def _reference_train(out_dir: str, model_dir: str) -> None:
  """One process over 4 devices, the same config, replaying the union of the workers' rollouts."""
  import toy_task  # pylint: disable=import-outside-toplevel
  from marl_jax.training import eval_metrics, trainer  # pylint: disable=import-outside-toplevel
  from marl_jax.workflows.rollout import RolloutResult  # pylint: disable=import-outside-toplevel

  toy_task.register()
  recorded = [pickle.loads((Path(out_dir) / f"train_{p}.pkl").read_bytes())["rollouts"]
              for p in range(NUM_PROCESSES)]
  calls = iter(zip(*recorded))

  def replay(problems, *args, **kwargs):
    parts = next(calls)
    ids = [i for p_ids, _ in parts for i in p_ids]
    if [p.problem_id for p in problems] != ids:
      raise ValueError(f"one process asked for problems {[p.problem_id for p in problems]}; "
                       f"the workers rolled out {ids}")
    return RolloutResult([s for _, r in parts for s in r.samples],
                         sorted([e for _, r in parts for e in r.episodes],
                                key=lambda e: e.traj_id))

  trainer.rollout = eval_metrics.rollout = replay
  trainer.train(_toy_config(model_dir), str(Path(out_dir) / "reference"))


# ---------------------------------------------------------------- the tests


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="disabled",
             PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} " + host.FAST_XLA_FLAGS)
  env.pop(distributed.METHOD_ENV, None)
  return env


def _start(*args: str, devices: int) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, __file__, *args], env=_env(devices), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen]) -> None:
  try:
    logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]


def _workers(mode: str, out_dir: Path, *extra: str) -> None:
  port = str(_free_port())
  _wait([_start(mode, str(p), port, str(out_dir), *extra, devices=LOCAL_DEVICES)
         for p in range(NUM_PROCESSES)])


def assert_close(got, want, rtol=1e-5):
  """rtol relative to each array's scale (elements near zero need an absolute floor)."""
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(np.max(np.abs(want)), 1e-30))


def test_process_slice_is_contiguous_and_covers_every_id():
  for count, procs in ((8, 2), (5, 2), (7, 3), (2, 4)):
    slices = [multihost.process_slice(count, p, procs) for p in range(procs)]
    assert [i for s in slices for i in s] == list(range(count))
    assert max(map(len, slices)) - min(map(len, slices)) <= 1
  assert multihost.process_slice(5, 1, 2) == range(3, 5)
  with pytest.raises(ValueError, match=r"process_index 2; expected 0 <= process_index < 2"):
    multihost.process_slice(4, 2, 2)


def test_real_train_step_in_two_processes_matches_one_process(tmp_path):
  _make_inputs(tmp_path / "inputs.pkl")
  port = str(_free_port())
  procs = [_start("step", str(p), port, str(tmp_path), devices=LOCAL_DEVICES)
           for p in range(NUM_PROCESSES)]
  try:  # the reference runs here, over 4 of this process's 8 devices, while the workers run
    inputs = pickle.loads((tmp_path / "inputs.pkl").read_bytes())
    mesh = make_mesh(data=2, fsdp=2, devices=host.cpu_devices(4))
    want_history, want_state = _run_steps(mesh, inputs, slice(None))
    want_params = jax.device_get(want_state.params)
  finally:
    _wait(procs)
  results = [pickle.loads((tmp_path / f"step_{p}.pkl").read_bytes())
             for p in range(NUM_PROCESSES)]
  for p, r in enumerate(results):
    for step, (got, want) in enumerate(zip(r["history"], want_history)):
      assert sorted(got) == sorted(want)
      assert got["finite"] and got["policy_updated"], f"process {p} step {step}"
      for name in want:
        assert_close(got[name], want[name])
    for got, want in zip(jax.tree.leaves(r["params"]), jax.tree.leaves(want_params)):
      assert_close(got, want)
  # The two processes hold the same numbers bit for bit; the steps really moved the params.
  same = lambda r: jax.tree.leaves((r["history"], r["params"]))
  for a, b in zip(same(results[0]), same(results[1]), strict=True):
    np.testing.assert_array_equal(a, b)
  moved = [np.max(np.abs(w - x)) for w, x in zip(jax.tree.leaves(want_params),
                                                  jax.tree.leaves(inputs[0]))]
  assert max(moved) > 1e-4
  assert want_history[1]["loss"] != want_history[0]["loss"]

  # Host-level exchanges.
  assert [r["slice"] for r in results] == [[0, 1, 2], [3, 4]]
  assert all(r["agree_max"] == [2, 10, 7] for r in results)
  assert all(r["means"] == {"x": (1.5 + 2.5) / 3, "only_p1": 0.1} for r in results)
  assert [r["keys_differ"] for r in results] == [True, True]
  for r in results:
    assert r["alias_addressable"] and r["alias_no_copy"] and r["alias_equal"]
    assert r["gather_addressable"] and r["gather_equal"]
    assert r["sharded_leaves"] > 0 and r["split_leaves"] > 0  # both paths were exercised
  np.testing.assert_allclose(results[1]["local_sum"], results[1]["local_sum_want"], rtol=1e-5)


def _metrics(workdir: Path) -> dict[int, dict[str, float]]:
  return {r["step"]: {k: v for k, v in r.items() if not k.startswith("time/")}
          for r in read_metrics(workdir)}


def test_trainer_in_two_processes_matches_one_process_on_the_same_rollouts(tmp_path):
  import toy_task  # pylint: disable=import-outside-toplevel
  model_dir = tmp_path / "model"
  toy_task.write_tiny_model(str(model_dir))
  _workers("train", tmp_path, str(model_dir))
  ref = _start("reference", str(tmp_path), str(model_dir), devices=NUM_PROCESSES * LOCAL_DEVICES)
  _wait([ref])

  runs = [pickle.loads((tmp_path / f"train_{p}.pkl").read_bytes()) for p in range(NUM_PROCESSES)]
  # Contiguous problem slices with global ids: 2 train steps of 2 problems, then 2 eval problems.
  assert [[ids for ids, _ in r["rollouts"]] for r in runs] == [[[0], [0], [0]], [[1], [1], [1]]]
  for r, p in zip(runs, range(NUM_PROCESSES)):
    train_samples = r["rollouts"][0][1].samples
    assert {s.problem_id for s in train_samples} == {p}
    assert {s.traj_id for s in train_samples} == set(range(4 * p, 4 * p + 4))
  # Both processes return the same, global numbers (only process 0 writes them).
  for a, b in zip(runs[0]["scalars"], runs[1]["scalars"]):
    assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
        k: v for k, v in b.items() if not k.startswith("time/")}
  assert runs[0]["summary"]["skipped_updates"] == runs[1]["summary"]["skipped_updates"] == 0

  got, want = _metrics(tmp_path / "run"), _metrics(tmp_path / "reference")
  assert sorted(got) == sorted(want) == [1, 2]
  for step in want:
    assert sorted(got[step]) == sorted(want[step])
    for name, value in want[step].items():
      # float32 metrics are sums of O(1) terms reduced in a different order on 1 and 2
      # processes: besides rtol, a metric that cancels to ~0 (the policy loss at ratio 1 with
      # zero-mean advantages) carries an absolute error of a few float32 ulps of 1 (1.2e-7 each).
      f32 = name.startswith(("train/", "adv/", "agent/"))
      np.testing.assert_allclose(got[step][name], value, rtol=1e-5 if f32 else 1e-12,
                                 atol=1e-6 if f32 else 1e-7, err_msg=f"step {step} {name}")
  assert got[1]["rollout/reward/writer"] > 0 and abs(got[2]["train/loss"]) > 0
  # Every process wrote the traces of its own eval episodes.
  for name in ("eval_step2.jsonl", "eval_step2.process1.jsonl"):
    lines = (tmp_path / "run" / "traces" / name).read_text().splitlines()
    assert len(lines) == 1, name
  assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == STEPS
  # The samples page shows process 0's first episodes (problem 0) with the advantages of the
  # whole rollout: the one-process run over the union of the rollouts shows the same rows.
  pages = [toy_task.read_samples_page(tmp_path / run / "samples" / f"step{STEPS}.md")
           for run in ("run", "reference")]
  step_samples = runs[0]["rollouts"][STEPS - 1][1].samples
  assert [r["reply"] for r in pages[0]] == [s.generation.text for s in step_samples]
  for got_row, want_row in zip(*pages, strict=True):
    assert {k: v for k, v in got_row.items() if k != "advantage"} == {
        k: v for k, v in want_row.items() if k != "advantage"}
    np.testing.assert_allclose(float(got_row["advantage"]), float(want_row["advantage"]),
                               rtol=1e-4, atol=1e-5)
  assert not (tmp_path / "run" / "samples" / "step1.md").exists()


if __name__ == "__main__" and sys.argv[1:2] in (["step"], ["train"]):
  worker = _worker_step if sys.argv[1] == "step" else _worker_train
  worker(int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
elif __name__ == "__main__" and sys.argv[1:2] == ["reference"]:
  _reference_train(*sys.argv[2:])
