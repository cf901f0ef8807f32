"""data.read_records: rows of JSONL/JSON(.gz) files, and one-line errors naming the file (and
line) for a missing file, a directory, an unknown kind, bad JSON and bad UTF-8."""

from __future__ import annotations

import gzip
import json

import pytest

from marl_jax.envs import data
from marl_jax.errors import UserInputError

ROWS = [{"question": "1+1", "answer": "2"}, {"question": "ünï", "answer": "3"}]


def test_reads_jsonl_json_and_gz(tmp_path):
  text = "\n".join(json.dumps(r, ensure_ascii=False) for r in ROWS)
  (tmp_path / "a.jsonl").write_text(text + "\n\n", encoding="utf-8")  # blank lines are skipped
  (tmp_path / "a.json").write_text(json.dumps(ROWS), encoding="utf-8")
  with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
    f.write(text)
  for name in ("a.jsonl", "a.json", "a.jsonl.gz"):
    assert data.read_records(tmp_path / name) == ROWS, name


@pytest.mark.parametrize("name, content, expected", [
    ("bad.jsonl", b'{"a": 1}\n\n{"a": oops}\n', r"bad.jsonl:3: not valid JSON \(Expecting value "
     r"at column 7\)"),
    ("bad.json", b'[{"a": 1},\n {"a": }]', r"bad.json:2: not valid JSON"),
    ("utf.jsonl", b'{"a": 1}\n{"a": "\xff"}\n', r"utf.jsonl:2: not valid UTF-8"),
    ("list.json", b'{"a": 1}', r"list.json: expected a JSON list of objects, got dict"),
    ("broken.jsonl.gz", b"\x1f\x8b\x08\x00garbage", r"broken.jsonl.gz: cannot be read"),
])
def test_bad_content_names_file_and_line(tmp_path, name, content, expected):
  (tmp_path / name).write_bytes(content)
  with pytest.raises(UserInputError, match=expected) as raised:
    data.read_records(tmp_path / name)
  assert "\n" not in str(raised.value) and str(tmp_path / name) in str(raised.value)


def test_bad_paths(tmp_path):
  (tmp_path / "dir.jsonl").mkdir()
  with pytest.raises(UserInputError, match=r"data file '.*dir.jsonl' is a directory; expected a "
                     r"\.jsonl file"):
    data.read_records(tmp_path / "dir.jsonl")
  with pytest.raises(UserInputError, match=r"data file '.*none.parquet' is missing"):
    data.read_records(tmp_path / "none.parquet")
  with pytest.raises(UserInputError, match=r"unsupported data file '.*rows.csv'; expected one of"):
    data.read_records(tmp_path / "rows.csv")


def test_file_rows_counts_once_per_path_and_option(tmp_path):
  calls = []

  def load(path, option):
    calls.append((path, option))
    return [0] * (3 if option == "wide" else 2)

  rows = data.file_rows("demo", load, "path", "fmt", "wide")
  assert rows({}) is None
  assert rows({"path": "a.jsonl"}) == 3 and rows({"path": "a.jsonl", "fmt": ""}) == 3
  assert rows({"path": "a.jsonl", "fmt": "narrow"}) == 2
  assert calls == [("a.jsonl", "wide"), ("a.jsonl", "narrow")]
  empty = data.file_rows("demo", lambda path: [], "questions_path")
  with pytest.raises(UserInputError, match=r"^demo dataset 'e.jsonl' has no rows$"):
    empty({"questions_path": "e.jsonl"})


@pytest.mark.parametrize("family, key", [("math", "path"), ("code", "path"),
                                         ("writing", "path"), ("search", "questions_path")])
def test_family_dataset_rows(tmp_path, family, key):
  from marl_jax.envs.code import task as code_task
  from marl_jax.envs.math import task as math_task
  from marl_jax.envs.search import task as search_task
  from marl_jax.envs.writing import task as writing_task
  task = {"math": math_task, "code": code_task, "writing": writing_task,
          "search": search_task}[family]
  row = {"math": {"question": "1+1", "answer": "2"},
         "code": {"question": "q", "style": "stdio", "tests": [{"input": "1", "output": "1"}]},
         "writing": {"document": "d"}, "search": {"question": "q", "answers": ["a"]}}[family]
  full, empty = tmp_path / f"{family}.jsonl", tmp_path / f"{family}_empty.jsonl"
  full.write_text((json.dumps(row) + "\n") * 3)
  empty.write_text("")
  assert task.dataset_rows({}) is None
  assert task.dataset_rows({key: str(full)}) == 3
  with pytest.raises(UserInputError, match=rf"^{family} dataset '{empty}' has no rows$"):
    task.dataset_rows({key: str(empty)})
