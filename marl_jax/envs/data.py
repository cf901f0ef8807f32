"""Reading local task data files (no download ever happens here).

Files are JSONL (one object a line), JSON (a list) or Parquet (via pyarrow), or one split of a
prepared TFDS dataset in a `data_dir`, named `<data_dir>/<name>[/<config>]/<version>@<split>`
(TFDS split syntax, e.g. `@train[:90%]`). Each family's
`data.py` turns rows into its canonical problem dicts (and caches loaded files per path, so
building many envs from one file reads it once) and generates seeded problems for tests and CPU
presets.
"""

from __future__ import annotations

import functools
import gzip
import pathlib
from typing import Any, Callable, Sequence

from marl_jax.errors import UserInputError, json_line


def read_records(path: str | pathlib.Path) -> list[dict[str, Any]]:
  """Rows of a .jsonl/.jsonl.gz, .json (a list of objects) or .parquet file, or of a TFDS split
  (`<dataset version dir>@<split>`, see `read_tfds`).

  Raises UserInputError naming the file (and the line of a bad JSONL row) when it is missing, a
  directory, of an unknown kind or not valid JSON/UTF-8.
  """
  version_dir, at, split = str(path).rpartition("@")
  if at and (pathlib.Path(version_dir) / TFDS_INFO).is_file():
    return read_tfds(version_dir, split)
  path = pathlib.Path(path)
  if (path / TFDS_INFO).is_file():
    raise UserInputError(f"{str(path)!r} is a TFDS dataset; name a split: '{path}@train' "
                         f"(TFDS split syntax, e.g. @train[:90%])")
  name = path.name.lower()
  kinds = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
  if not name.endswith(kinds):
    raise UserInputError(f"unsupported data file {str(path)!r}; expected one of {list(kinds)}")
  if not path.is_file():
    what = "a directory" if path.is_dir() else "missing"
    raise UserInputError(f"data file {str(path)!r} is {what}; expected a {path.suffix} file")
  if name.endswith(".parquet"):
    import pyarrow.parquet as pq  # imported lazily: only Parquet users pay for it
    return pq.read_table(path).to_pylist()
  opener = gzip.open if name.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      lines = f.read().split(b"\n")
  except (OSError, EOFError) as e:  # e.g. a truncated or corrupt .gz
    raise UserInputError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
  texts = []
  for lineno, raw in enumerate(lines, start=1):
    try:
      texts.append(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise UserInputError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte "
                           f"{e.start})") from None
  if name.endswith((".json", ".json.gz")):
    rows = json_line("\n".join(texts), str(path))
    if not isinstance(rows, list):
      raise UserInputError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
    return rows
  rows = []
  for lineno, line in enumerate(texts, start=1):
    if line.strip():
      rows.append(json_line(line, f"{path}:{lineno}"))
  return rows


TFDS_INFO = "dataset_info.json"


def read_tfds(version_dir: str, split: str) -> list[dict[str, Any]]:
  """Rows of one split of a TFDS dataset prepared under a `data_dir` (the directory
  `<data_dir>/<name>[/<config>]/<version>`), read through `tfds.data_source` without TensorFlow.

  Why array_record only: TFDS reads its default tfrecord files through tf.data, i.e. TensorFlow,
  which this stack does not install; array_record is what TFDS itself reads without it. Text
  features decode to str and NumPy values to Python values, so rows look like JSONL rows.
  """
  import tensorflow_datasets as tfds  # imported lazily: only TFDS users pay for it

  builder = tfds.builder_from_directory(version_dir)
  file_format = builder.info.file_format
  if file_format != tfds.core.FileFormat.ARRAY_RECORD:
    raise UserInputError(
        f"TFDS dataset {version_dir!r} is stored as {getattr(file_format, 'value', file_format)}, "
        f"which needs TensorFlow to read; convert it once: tfds convert_format "
        f"--dataset_version_dir={version_dir} --out_file_format=array_record")
  try:
    source = builder.as_data_source(split=split)
  except (ValueError, KeyError) as e:
    raise UserInputError(f"TFDS dataset {version_dir!r} has no split {split!r} "
                         f"(its splits: {sorted(builder.info.splits)}): {e}") from None
  return [_plain(source[i]) for i in range(len(source))]


def _plain(value: Any) -> Any:
  """A decoded TFDS example as JSON-like Python: bytes -> str, arrays -> lists, scalars -> numbers."""
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if hasattr(value, "tolist"):  # NumPy arrays and scalars
    return _plain(value.tolist())
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def file_rows(kind: str, load: Callable[..., Sequence[Any]], path_key: str,
              option_key: str | None = None,
              default: Any = None) -> Callable[[dict[str, Any]], int | None]:
  """A family's `Task.dataset_rows`: the row count of the file named by env kwarg `path_key`
  (None without one), read by `load(path)` or `load(path, kwargs[option_key] or default)`.

  Counts are cached per (path, option); a file without rows is refused.
  """

  @functools.lru_cache(maxsize=32)
  def count(path: str, option: Any) -> int:
    rows = len(load(path) if option_key is None else load(path, option))
    if rows == 0:
      raise UserInputError(f"{kind} dataset {path!r} has no rows")
    return rows

  def dataset_rows(env_kwargs: dict[str, Any]) -> int | None:
    path = env_kwargs.get(path_key)
    if path is None:
      return None
    return count(str(path), None if option_key is None else env_kwargs.get(option_key) or default)

  return dataset_rows
