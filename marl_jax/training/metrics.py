"""Metric writers: one interface, three backends (wandb, JSONL, console) and a fan-out.

The trainer logs through a single `MetricWriter` so that what reaches wandb, the JSONL file and the
console is always the same dict. Only process 0 of a multi-host run writes (the others get a
`NoOpWriter`), because every process computes the same globally reduced metrics.

The JSONL file (`<workdir>/metrics.jsonl`, one `{"step": s, ...}` object per line) is the ground
truth for plots and for resume tests: a resumed run first drops the records written after its
checkpoint, so the file reads as if the run had never been interrupted.

wandb never blocks a run: "offline" (the default) needs no account or network, "disabled" writes
nothing and imports nothing, and "online" falls back to offline when `wandb.init` fails or times
out. `WANDB_MODE` in the environment overrides the configured mode (the test suite sets it to
"disabled").
"""
from __future__ import annotations

import abc
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from absl import logging
import ml_collections
import numpy as np

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
HPARAMS_FILE = "hparams.json"
WANDB_RUN_ID_FILE = "wandb_run_id.txt"
WANDB_MODES = ("offline", "online", "disabled")


def default_config() -> ml_collections.ConfigDict:
  """The `logging` section of an experiment config."""
  return ml_collections.ConfigDict({
      "wandb_mode": "offline",  # one of WANDB_MODES; WANDB_MODE in the environment wins.
      "wandb_project": "marl_jax",
      "wandb_entity": "",  # "" = the account's default entity.
      "wandb_name": "",  # "" = the workdir's name.
      "wandb_tags": (),
      "wandb_init_timeout_s": 30.0,  # "online" only: after this, fall back to offline.
      "jsonl": True,
      "console": True,
      # Every `samples_every` steps (0 = never) a table of the first `samples_episodes`
      # episodes of the step's rollout: per agent and turn the prompt's tail, the reply, the
      # parsed action, reward and advantage (`training/samples.py`), as a wandb table and as
      # `<workdir>/samples/step{N}.md`. Multi-host: process 0's episodes.
      "samples_every": 10,
      "samples_episodes": 4,
      # `<workdir>/learning_curve.png` at the end of the run (`training/plots.py`); off for
      # sweeps that read metrics.jsonl instead: drawing it costs ~2 s of a CPU core.
      "learning_curve": True,
  })


def to_scalar(name: str, value: Any) -> float | int | bool:
  """Converts a 0-d jax/numpy value or Python number to a Python scalar for JSON and wandb."""
  array = np.asarray(value)
  if array.size != 1:
    raise ValueError(f"metric {name!r} has shape {array.shape}; expected a scalar")
  return array.reshape(()).item()


class MetricWriter(abc.ABC):
  """Where the trainer sends metrics. Backends must accept any str -> scalar mapping."""

  @abc.abstractmethod
  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Records the scalars of one training step (values: Python, numpy or 0-d jax scalars)."""

  @abc.abstractmethod
  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    """Records the run's configuration (a nested dict, e.g. `config.to_dict()`)."""

  @abc.abstractmethod
  def write_summary(self, summary: Mapping[str, Any]) -> None:
    """Records end-of-run values (final evaluation, best accuracy, ...); later calls update it."""

  def write_table(self, step: int, name: str, columns: Sequence[str],
                  rows: Sequence[Sequence[Any]]) -> None:
    """Records a table of one step (the samples tables); values: str, numbers, bools, None.
    Only wandb shows tables: the other backends keep scalars (the samples' own copy is a local
    page, `training/samples.py`)."""
    del step, name, columns, rows

  def flush(self) -> None:
    """Makes everything written so far durable (no-op for unbuffered backends)."""

  def close(self) -> None:
    """Flushes and releases the backend; the writer must not be used afterwards."""
    self.flush()


class NoOpWriter(MetricWriter):
  """The writer of processes other than 0: every process has the same metrics; one copy suffices."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    del step, scalars

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    del hparams

  def write_summary(self, summary: Mapping[str, Any]) -> None:
    del summary


class JsonlWriter(MetricWriter):
  """Appends one JSON object per step to `metrics.jsonl`; hparams and summary go to JSON files.

  Args:
    workdir: run directory (created if missing).
    resume_step: when resuming from the checkpoint of this step, records with a larger step (written
      after that checkpoint by the interrupted run) are dropped so the steps are not duplicated.
      A run that starts without a checkpoint passes 0, discarding the records of an attempt that
      died before its first checkpoint. `None` appends to the file as it is.
  """

  def __init__(self, workdir: str | os.PathLike[str], resume_step: int | None = None):
    self._workdir = Path(workdir)
    self._workdir.mkdir(parents=True, exist_ok=True)
    self.path = self._workdir / METRICS_FILE
    if resume_step is not None and self.path.exists():
      kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
      _atomic_write_text(self.path, "".join(_json_line(r) for r in kept))
    self._file = self.path.open("a", encoding="utf-8")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    record = {"step": int(step), **{k: to_scalar(k, v) for k, v in scalars.items()}}
    self._file.write(_json_line(record))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    _atomic_write_text(self._workdir / HPARAMS_FILE, json.dumps(hparams, indent=2, default=str))

  def write_summary(self, summary: Mapping[str, Any]) -> None:
    path = self._workdir / SUMMARY_FILE
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update({k: _jsonable(k, v) for k, v in summary.items()})
    _atomic_write_text(path, json.dumps(merged, indent=2))

  def flush(self) -> None:
    # A SIGKILL after flush loses nothing: the data is in the OS, not in Python's buffer.
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class ConsoleWriter(MetricWriter):
  """One compact absl log line per step: `step 12 | train/reward 0.512 | ...`."""

  def __init__(self, precision: int = 4):
    self._precision = precision

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    parts = [f"{k} {self._format(to_scalar(k, v))}" for k, v in scalars.items()]
    logging.info("step %d | %s", step, " | ".join(parts))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    logging.info("hparams: %s", json.dumps(hparams, default=str, sort_keys=True))

  def write_summary(self, summary: Mapping[str, Any]) -> None:
    logging.info("summary: %s", json.dumps({k: _jsonable(k, v) for k, v in summary.items()}))

  def _format(self, value: float | int | bool) -> str:
    if isinstance(value, float):
      return f"{value:.{self._precision}g}"
    return str(value)


class WandbWriter(MetricWriter):
  """Logs to a wandb run whose files live in `<workdir>/wandb`.

  The run id is kept in `<workdir>/wandb_run_id.txt`, so a run resumed on the same workdir logs into
  the same wandb run (online) or syncs into it later (offline).
  """

  def __init__(self, workdir: str | os.PathLike[str], *, mode: str, project: str, entity: str = "",
               name: str = "", tags: Sequence[str] = (), init_timeout_s: float = 30.0):
    import wandb  # Imported here: ~1 s, and not needed at all when wandb is disabled.

    if mode not in ("offline", "online"):
      raise ValueError(f"WandbWriter mode {mode!r}; expected 'offline' or 'online'")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    id_path = workdir / WANDB_RUN_ID_FILE
    run_id = id_path.read_text().strip() if id_path.exists() else secrets.token_hex(4)
    id_path.write_text(run_id)
    kwargs = dict(project=project, entity=entity or None, name=name or workdir.name,
                  tags=list(tags), dir=str(workdir), id=run_id, resume="allow",
                  reinit="create_new")

    def init(run_mode: str):
      settings = wandb.Settings(mode=run_mode, init_timeout=init_timeout_s, silent=True,
                                console="off", x_disable_stats=True)
      return wandb.init(settings=settings, **kwargs)

    try:
      self._run = init(mode)
    except Exception as e:  # pylint: disable=broad-except  # any failure: no network, no API key...
      if mode != "online":
        raise
      logging.warning("wandb online init failed (%s); logging offline to %s/wandb instead", e,
                      workdir)
      self._run = init("offline")

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    self._run.log({k: to_scalar(k, v) for k, v in scalars.items()}, step=int(step))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    self._run.config.update(dict(hparams), allow_val_change=True)

  def write_summary(self, summary: Mapping[str, Any]) -> None:
    self._run.summary.update({k: _jsonable(k, v) for k, v in summary.items()})

  def write_table(self, step: int, name: str, columns: Sequence[str],
                  rows: Sequence[Sequence[Any]]) -> None:
    import wandb  # already imported by __init__
    self._run.log({name: wandb.Table(columns=list(columns), data=[list(r) for r in rows])},
                  step=int(step))

  def close(self) -> None:
    self._run.finish()


class MultiWriter(MetricWriter):
  """Sends every call to each writer, in order."""

  def __init__(self, writers: Sequence[MetricWriter]):
    self.writers = tuple(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for w in self.writers:
      w.write_scalars(step, scalars)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    for w in self.writers:
      w.write_hparams(hparams)

  def write_summary(self, summary: Mapping[str, Any]) -> None:
    for w in self.writers:
      w.write_summary(summary)

  def write_table(self, step: int, name: str, columns: Sequence[str],
                  rows: Sequence[Sequence[Any]]) -> None:
    for w in self.writers:
      w.write_table(step, name, columns, rows)

  def flush(self) -> None:
    for w in self.writers:
      w.flush()

  def close(self) -> None:
    # Close every backend even if one fails, then report the first failure.
    errors = []
    for w in self.writers:
      try:
        w.close()
      except Exception as e:  # pylint: disable=broad-except
        errors.append(e)
    if errors:
      raise errors[0]


def resolve_wandb_mode(configured: str) -> str:
  """The wandb mode to use: `WANDB_MODE` from the environment if set, else the config's."""
  mode = os.environ.get("WANDB_MODE") or configured
  if mode not in WANDB_MODES:
    raise ValueError(f"unknown wandb mode {mode!r}; expected one of {list(WANDB_MODES)}")
  return mode


def make_writer(cfg: ml_collections.ConfigDict, workdir: str | os.PathLike[str],
                is_main_process: bool, resume_step: int | None = None) -> MetricWriter:
  """Builds the run's writer from the `logging` config section (see `default_config`).

  Args:
    cfg: logging config.
    workdir: run directory; JSONL and wandb files go there.
    is_main_process: `jax.process_index() == 0`; other processes get a `NoOpWriter`.
    resume_step: step of the checkpoint being resumed, 0 for a fresh run (see `JsonlWriter`).
  """
  if not is_main_process:
    return NoOpWriter()
  writers: list[MetricWriter] = []
  if cfg.jsonl:
    writers.append(JsonlWriter(workdir, resume_step=resume_step))
  if cfg.console:
    writers.append(ConsoleWriter())
  mode = resolve_wandb_mode(cfg.wandb_mode)
  if mode != "disabled":
    writers.append(WandbWriter(workdir, mode=mode, project=cfg.wandb_project,
                               entity=cfg.wandb_entity, name=cfg.wandb_name,
                               tags=tuple(cfg.wandb_tags),
                               init_timeout_s=cfg.wandb_init_timeout_s))
  return MultiWriter(writers)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """Reads a metrics JSONL file (a workdir or the file itself) into a list of records.

  A truncated last line (the writer was killed mid-write) is skipped; any other bad line raises.
  """
  path = Path(path)
  if path.is_dir():
    path = path / METRICS_FILE
  lines = path.read_text(encoding="utf-8").splitlines()
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if i == len(lines) - 1:
        logging.warning("ignoring truncated last line of %s: %r", path, line[:80])
        continue
      raise ValueError(f"{path}:{i + 1} is not a JSON object: {line[:80]!r}") from e
  return records


def metric_series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of one metric, skipping records that do not have it (e.g. eval steps)."""
  pairs = [(r["step"], r[key]) for r in records if key in r]
  steps = np.array([p[0] for p in pairs], dtype=np.int64)
  values = np.array([p[1] for p in pairs], dtype=np.float64)
  return steps, values


def _jsonable(name: str, value: Any) -> Any:
  """Scalars (incl. jax/numpy) become Python scalars; strings and nested containers pass through."""
  if isinstance(value, (str, bool, int, float)) or value is None:
    return value
  if isinstance(value, Mapping):
    return {k: _jsonable(f"{name}.{k}", v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(name, v) for v in value]
  return to_scalar(name, value)


def _json_line(record: Mapping[str, Any]) -> str:
  # NaN/inf are written as JSON's common extension tokens (NaN, Infinity) that Python reads back.
  return json.dumps(record, allow_nan=True) + "\n"


def _atomic_write_text(path: Path, text: str) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text, encoding="utf-8")
  os.replace(tmp, path)

