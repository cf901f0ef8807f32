"""Checkpoints: the device training state plus the host-side data position, saved with orbax.

A checkpoint of step `s` is one orbax step directory with three items:
  state: the caller's pytree of jax arrays (params or only the LoRA adapters, optimizer state, RNG
    key, step counter...), saved with `StandardSave` so it restores with its exact dtypes and
    shardings. Typed PRNG keys (`jax.random.key`) are stored as their key data and re-wrapped.
  host:  JSON with each process's host state (sampler/dataloader cursors, numpy RNG state: anything
    JSON-serialisable, e.g. `np.random.Generator.bit_generator.state`) and the typed-key layout.
  checksums: JSON with a SHA-256 of every state array's bytes and of the host item
    (`checkpoint_integrity.py`).

Damage: orbax restores flipped bytes in a data file silently, so `restore` recomputes the
checksums of what it read and compares. A step that cannot be read (a truncated or missing item)
or does not match its checksums is damaged: restoring the latest step falls back to the newest
intact one, logs one line naming the skipped step and why, and renames the damaged step directory
to `STEP.damaged` (never deleted, so it can be inspected). A step that reads fine without a target
but not into the given one is not damage (the run's state changed shape): that error propagates.

Why this shape: resuming must continue the *same* run, so everything that feeds the next step, on
device and on the host, is in one atomic checkpoint. Orbax writes a step into a temporary directory
and renames it when complete, so a crash or a failed write never leaves a half-written step that
`latest_step()` would pick. Saves are synchronous by default so that a SIGKILL right after `save`
returns cannot lose that checkpoint; `async_save=True` overlaps writing with training on large
models (call `wait_until_finished` before relying on it). Only orbax's write is overlapped: the
checksum pass (a host copy and SHA-256 of every array, `checkpoint_integrity.state_checksums`)
runs synchronously inside `save` either way.

Multi-host: every process calls `save`/`restore` with its own shards; orbax coordinates the array
writes, and the host states of all processes are gathered into process 0's JSON file. Orbax only
writes global arrays, so process-local leaves (e.g. an RNG key made with `jax.random.key` on each
process) are saved as replicated arrays after checking that all processes hold the same value, and
restored to the target's local sharding. Checksums cover only the arrays one process holds whole
(all of them on one host); a step is set aside by process 0 while the others wait.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import ml_collections
import orbax.checkpoint as ocp

from marl_jax.errors import ReportedError, UserInputError
from marl_jax.training import checkpoint_hosts, workdir_lock
from marl_jax.training.checkpoint_integrity import (CheckpointDamagedError, json_checksum, one_line,
                                                    state_checksums, verify)

PyTree = Any
CHECKPOINT_DIR = "checkpoints"


def default_config() -> ml_collections.ConfigDict:
  """The `checkpoint` section of an experiment config."""
  return ml_collections.ConfigDict({
      "every_steps": 10,  # save when step % every_steps == 0 (the trainer also forces the last).
      "max_to_keep": 3,
      "async_save": False,
  })


ITEMS = ("state", "host", "checksums")
# How often a reader lists the steps when the writer's rotation deletes one mid-listing.
_LISTING_TRIES = 5
_T = TypeVar("_T")


class CheckpointWriteError(ReportedError, RuntimeError):
  """A checkpoint could not be written; earlier checkpoints are untouched."""


class CheckpointMismatchError(UserInputError):
  """An intact checkpoint whose arrays do not fit the target (another model or team)."""


@dataclasses.dataclass(frozen=True)
class Restored:
  """What `restore` / `restore_or_init` return.

  Attributes:
    step: step of the restored checkpoint, or None when `restore_or_init` found none.
    state: the device state pytree (same structure, dtypes and shardings as the target).
    host_state: this process's host state dict.
  """
  step: int | None
  state: PyTree
  host_state: dict[str, Any]


@contextlib.contextmanager
def holding(workdir: str | os.PathLike[str], step: int | None = None) -> Iterator[int]:
  """A reader's hold on checkpoint `step` of a run (None: its newest) for the block
  (`workdir_lock.reading`): yields the step, which the run's writer keeps until the block ends.
  Raises UserInputError when the run has no such step (any more)."""
  while True:
    steps = saved_steps(workdir)
    chosen = steps[-1] if step is None and steps else step
    if chosen is None:
      raise UserInputError(f"{workdir} has no checkpoint; expected the workdir of a run that "
                           "saved one")
    if chosen not in steps:
      raise UserInputError(f"--checkpoint={step}: {workdir} has "
                           f"{f'checkpoints {steps}' if steps else 'no checkpoint'}; expected a "
                           "saved step")
    with workdir_lock.reading(workdir, chosen):
      if chosen in saved_steps(workdir):  # not rotated away before the hold began
        yield chosen
        return


@dataclasses.dataclass(frozen=True)
class _HeldByReaders:
  """orbax preservation policy: keeps the steps readers hold (`workdir_lock.held_steps`); the
  first save after a reader lets go rotates its step away as usual."""

  workdir: str

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    del context
    held = workdir_lock.held_steps(self.workdir)
    return [info.step in held for info in checkpoints]


def saved_steps(workdir: str | os.PathLike[str]) -> list[int]:
  """The complete checkpoint steps of a run, from the directory listing alone: opening a
  CheckpointManager starts orbax's clean-up of temporary directories in a background thread,
  which a process that only asks and exits would race at interpreter shutdown."""
  directory = epath.Path(workdir) / CHECKPOINT_DIR
  return sorted(ocp.utils.checkpoint_steps(directory)) if directory.exists() else []


class Checkpointer:
  """Orbax `CheckpointManager` for (device state, host state) pairs; keeps the last `max_to_keep`
  and step 0.

  Args:
    directory: where step directories go (created if missing), e.g. `<workdir>/checkpoints`; a
      local path or a cloud URL orbax can write (`gs://bucket/run/checkpoints` on TPU pods, where
      every host must reach the same directory).
    max_to_keep: older steps are deleted after a newer one is complete, except step 0 (the
      warm-start's checkpoint, which `config.init_from` forks).
    every_steps: `save` skips steps that are not multiples of this (unless forced).
    async_save: write in a background thread (see the module docstring); the checksums are still
      computed synchronously inside `save`.
    identity: JSON the run is known by (its config), stored in every step's host item under
      its checksum, so a resume checks itself against the checkpoint (`run_identity`).
    read_only: for a reader of another process's run (`evaluate`, `export`, `init_from`; the
      roles of `workdir_lock`): never saves, deletes, renames or creates anything, and leaves
      orbax's temporary directories alone (the cleanup of "interrupted" saves deleted a live
      trainer's in-progress step). A reader holds the step it reads with `holding`.
  """

  def __init__(self, directory: str | os.PathLike[str] | epath.Path, *, max_to_keep: int = 3,
               every_steps: int = 1, async_save: bool = False, read_only: bool = False,
               identity: Mapping[str, Any] | None = None):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep}; expected >= 1")
    if every_steps < 1:
      raise ValueError(f"every_steps={every_steps}; expected >= 1")
    self.directory = epath.Path(directory)
    if "://" not in str(directory):
      self.directory = self.directory.absolute()
    self._async_save = async_save
    self._every_steps = every_steps
    self._read_only = read_only
    self._identity = None if identity is None else _check_json(dict(identity))
    # Rotation keeps the last `max_to_keep` and checkpoint 0, the warm-started policy RL starts
    # from (saved only after a warm-start): it is the fork point of `config.init_from` and costs
    # the whole warm-start to make again; and any step a reader of the workdir holds
    # (`holding`), until it lets go.
    keep = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(read_only=True) if read_only else (
        ocp.CheckpointManagerOptions(
            preservation_policy=keep.AnyPreservationPolicy(
                [keep.LatestN(max_to_keep), keep.CustomSteps([0]),
                 _HeldByReaders(str(self.directory.parent))]),
            enable_async_checkpointing=async_save,
            # Temporary directories of a save that was interrupted (crash, SIGKILL) are removed:
            # safe only because this process is the workdir's one writer (`workdir_lock`).
            cleanup_tmp_directories=True,
        ))
    open_manager = functools.partial(ocp.CheckpointManager, self.directory, options=options,
                                     item_names=ITEMS)
    self._manager = _list_beside_writer(open_manager) if read_only else open_manager()

  @classmethod
  def from_config(cls, cfg: ml_collections.ConfigDict, workdir: str | os.PathLike[str], *,
                  read_only: bool = False,
                  identity: Mapping[str, Any] | None = None) -> Checkpointer:
    """Builds the checkpointer of a run from the `checkpoint` config section."""
    return cls(epath.Path(workdir) / CHECKPOINT_DIR, max_to_keep=cfg.max_to_keep,
               every_steps=cfg.every_steps, async_save=cfg.async_save, read_only=read_only,
               identity=identity)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The complete steps; a reader lists them afresh (a live writer adds and rotates steps)."""
    if self._read_only:
      _list_beside_writer(self._manager.reload)
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: PyTree, host_state: Mapping[str, Any] | None = None, *,
           force: bool = False) -> bool:
    """Saves `state` (jax arrays) and `host_state` (JSON) as step `step`.

    Every process must call this with its own host state. Returns whether a checkpoint was written:
    False for steps that are not multiples of `every_steps` (unless `force`) and for a step that
    is already saved (e.g. the forced final save right after a periodic one).

    Raises:
      CheckpointWriteError: the write failed (disk full, permissions...). The step is not
        committed and the previous checkpoints are intact, so the run can be restarted from them.
    """
    if self._read_only:
      raise RuntimeError(f"save(step={step}) on a read-only Checkpointer of {self.directory}")
    host_json = _check_json(dict(host_state or {}))
    if (not force and step % self._every_steps != 0) or step in self._manager.all_steps():
      return False
    data_state, typed_keys = _keys_to_data(state)
    data_state = checkpoint_hosts.replicate_host_local(data_state)
    host_item = {
        "typed_keys": typed_keys,
        "process_states": checkpoint_hosts.gather_host_states(host_json),
    }
    if self._identity is not None:
      host_item["identity"] = self._identity
    checksums = {"state": state_checksums(data_state), "host": json_checksum(host_item)}
    args = ocp.args.Composite(state=ocp.args.StandardSave(data_state),
                              host=ocp.args.JsonSave(host_item),
                              checksums=ocp.args.JsonSave(checksums))
    last_good = self.latest_step()
    try:
      self._manager.save(step, args=args, force=True)
      if not self._async_save:
        self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except  # orbax, tensorstore and OS errors.
      raise CheckpointWriteError(
          f"writing checkpoint step {step} to {self.directory} failed: {type(e).__name__}: {e}. "
          f"The last complete checkpoint (step {last_good}) is intact; fix the cause and rerun to "
          f"resume from it."
      ) from e
    logging.info("saved checkpoint step %d to %s", step, self.directory)
    return True

  def wait_until_finished(self) -> None:
    """Blocks until an async save is committed; raises `CheckpointWriteError` if it failed."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointWriteError(
          f"background checkpoint write to {self.directory} failed: {type(e).__name__}: {e}; "
          f"the last complete checkpoint is step {self.latest_step()}") from e

  def restore(self, step: int | None = None, *, target: PyTree | None = None) -> Restored:
    """Restores step `step` (default: the newest intact one), checking its checksums.

    Args:
      step: which checkpoint; None for the latest intact one (damaged newer steps are set aside,
        see the module docstring).
      target: the state pytree to restore into, concrete or abstract (`jax.ShapeDtypeStruct` with
        `sharding`): gives the structure, dtypes, shardings and typed keys of the result. Without
        it, arrays come back as saved (typed keys as raw key data).

    Raises:
      FileNotFoundError: no such checkpoint.
      CheckpointDamagedError: the requested step (or, for None, every step) is damaged.
    """
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
      return self._restore_newest_intact(steps, target)
    if step not in steps:
      raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; have {steps}")
    return self._restore_verified(step, target)

  def restore_on_one_device(self, step: int) -> Restored:
    """Restores step `step` onto this process's first device, whatever devices saved it (a run
    trained on a mesh, exported or inspected on one host): the target is the checkpoint's own
    tree of shapes and dtypes (dicts and lists; typed keys come back as key data). Checksums are
    verified as in `restore`."""
    steps = self.all_steps()
    if step not in steps:
      raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; have {steps}")
    saved = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state").tree
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                          saved, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    return self._restore_verified(step, target)

  def restore_or_init(self, state: PyTree, host_state: Mapping[str, Any]) -> Restored:
    """Resumes from the newest intact checkpoint if there is one, else returns the given initial
    values.

    `state` doubles as the restore target, so the initial state fixes dtypes and shardings.
    """
    steps = self.all_steps()
    if not steps:
      logging.info("no checkpoint in %s: starting from scratch", self.directory)
      return Restored(step=None, state=state, host_state=dict(host_state))
    restored = self._restore_newest_intact(steps, state)
    logging.info("resuming from checkpoint step %d in %s", restored.step, self.directory)
    return restored

  def _restore_newest_intact(self, steps: list[int], target: PyTree | None) -> Restored:
    """Newest step first; each damaged one is renamed aside with a one-line warning."""
    for step in reversed(steps):
      try:
        return self._restore_verified(step, target)
      except CheckpointDamagedError as e:
        aside = self._set_aside(step)
        logging.warning("%s", f"skipping checkpoint step {step}: {e}; kept it aside as {aside}")
    raise CheckpointDamagedError(f"every checkpoint in {self.directory} is damaged (steps {steps}, "
                                 "kept aside as STEP.damaged); rerun to start from scratch")

  def read_host(self, step: int) -> dict[str, Any]:
    """Step `step`'s host item alone (no arrays read), checked against its checksum; raises
    CheckpointDamagedError when it cannot be read or does not match."""
    try:
      items = self._manager.restore(step, args=ocp.args.Composite(
          host=ocp.args.JsonRestore(), checksums=ocp.args.JsonRestore()))
      matches = json_checksum(items.host) == items.checksums["host"]
    except Exception as e:  # pylint: disable=broad-except  # orbax and OS errors, bad JSON.
      raise CheckpointDamagedError(f"its host item cannot be read ({one_line(e)})") from e
    if not matches or not isinstance(items.host, dict):
      raise CheckpointDamagedError("its host item does not match its saved checksum")
    return items.host

  def _restore_items(self, step: int, abstract: PyTree | None) -> Any:
    return self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore(),
        checksums=ocp.args.JsonRestore()))

  def _restore_verified(self, step: int, target: PyTree | None) -> Restored:
    abstract = None if target is None else _abstract_data(target)
    try:
      restored = self._restore_items(step, abstract)
    except Exception as e:  # pylint: disable=broad-except  # orbax, tensorstore and OS errors.
      if abstract is not None and self._readable(step):  # not damage: another run's shapes
        raise CheckpointMismatchError(
            f"checkpoint step {step} in {self.directory} does not fit this config's model and "
            f"team ({one_line(e)}); expected a checkpoint of a run with the same models, policy "
            "layout and optimizer") from None
      raise CheckpointDamagedError(f"its items cannot be read ({one_line(e)})") from e
    verify(restored)
    state, host = restored.state, restored.host
    if target is not None:
      state = _data_to_keys(checkpoint_hosts.to_host_local(state, target), target,
                            host["typed_keys"])
    return Restored(step=step, state=state,
                    host_state=checkpoint_hosts.own_host_state(host["process_states"]))

  def _readable(self, step: int) -> bool:
    """Whether step `step` restores as saved (no target); only asked after a failed restore."""
    try:
      verify(self._restore_items(step, None))
    except Exception:  # pylint: disable=broad-except  # any failure here means unreadable.
      return False
    return True

  def _set_aside(self, step: int) -> epath.Path:
    """Renames the step directory to `STEP.damaged` (`STEP.damaged2`... if taken); a reader
    renames nothing and only says which it skipped."""
    source = self.directory / str(step)  # orbax's default step directory name
    if self._read_only:
      return source
    aside = self.directory / f"{step}.damaged"
    n = 1
    while aside.exists():
      n += 1
      aside = self.directory / f"{step}.damaged{n}"
    if jax.process_index() == 0:
      source.rename(aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint_set_aside_{step}")
    self._manager.reload()
    return aside

  def close(self) -> None:
    """Waits for pending saves and releases orbax's resources."""
    self.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _list_beside_writer(list_steps: Callable[[], _T]) -> _T:
  """Runs a reader's orbax call that lists the step directories and then reads each one's
  metadata. It races the live writer's rotation: a step listed and then deleted before its
  metadata is read raises FileNotFoundError, and listing again no longer sees it."""
  for _ in range(_LISTING_TRIES - 1):
    try:
      return list_steps()
    except FileNotFoundError:
      pass
  return list_steps()


def _check_json(host_state: dict[str, Any]) -> dict[str, Any]:
  try:
    json.dumps(host_state)
  except (TypeError, ValueError) as e:
    raise TypeError(f"host_state must be JSON-serialisable (dicts, lists, str, numbers): {e}"
                    ) from e
  return host_state


def _is_typed_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(state: PyTree) -> tuple[PyTree, dict[str, str]]:
  """Replaces typed PRNG keys by their uint32 key data; returns {leaf path: key impl name}."""
  typed_keys = {}

  def convert(path, leaf):
    if _is_typed_key(leaf):
      typed_keys[jax.tree_util.keystr(path)] = str(jax.random.key_impl(leaf))
      return jax.random.key_data(leaf)
    return leaf

  return jax.tree_util.tree_map_with_path(convert, state), typed_keys


def _abstract_data(target: PyTree) -> PyTree:
  """Target leaves as `ShapeDtypeStruct`s (typed keys as their key data), keeping shardings.

  Process-local leaves of a multi-host run are restored replicated
  (`checkpoint_hosts.to_host_local` then moves them to the target's sharding).
  """

  def abstract(leaf):
    sharding = (checkpoint_hosts.replicated() if checkpoint_hosts.is_host_local(leaf)
                else getattr(leaf, "sharding", None))
    if _is_typed_key(leaf):
      data = jax.eval_shape(jax.random.key_data, leaf)
      return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

  return jax.tree.map(abstract, target)


def _data_to_keys(state: PyTree, target: PyTree, typed_keys: Mapping[str, str]) -> PyTree:
  """Re-wraps key data where the target holds typed keys, with the impl recorded at save time."""

  def convert(path, leaf, target_leaf):
    if not _is_typed_key(target_leaf):
      return leaf
    name = jax.tree_util.keystr(path)
    if name not in typed_keys:
      raise ValueError(f"target leaf {name} is a typed PRNG key but the checkpoint saved it as "
                       f"plain data; saved typed keys: {sorted(typed_keys)}")
    return jax.random.wrap_key_data(leaf, impl=typed_keys[name])

  return jax.tree_util.tree_map_with_path(convert, state, target)
