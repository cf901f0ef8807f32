"""Reading local task data files (no download ever happens here).

Files are JSONL (one object a line), JSON (a list) or Parquet (via pyarrow). Each family's
`data.py` turns rows into its canonical problem dicts (and caches loaded files per path, so
building many envs from one file reads it once) and generates seeded problems for tests and CPU
presets.
"""

from __future__ import annotations

import gzip
import json
import pathlib
from typing import Any


def read_records(path: str | pathlib.Path) -> list[dict[str, Any]]:
  """Rows of a .jsonl/.jsonl.gz, .json (a list of objects) or .parquet file."""
  path = pathlib.Path(path)
  name = path.name.lower()
  if name.endswith(".parquet"):
    import pyarrow.parquet as pq  # imported lazily: only Parquet users pay for it
    return pq.read_table(path).to_pylist()
  opener = gzip.open if name.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    if name.endswith((".jsonl", ".jsonl.gz")):
      return [json.loads(line) for line in f if line.strip()]
    if name.endswith((".json", ".json.gz")):
      rows = json.load(f)
      if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
      return rows
  raise ValueError(f"unsupported data file {str(path)!r}; expected .jsonl, .json or .parquet")


def nonempty_rows(kind: str, path: str, rows: int) -> int:
  """`rows`, the row count of `kind` dataset `path`, refused when the file has none."""
  if rows == 0:
    raise ValueError(f"{kind} dataset {path!r} has no rows")
  return rows
