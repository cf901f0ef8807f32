"""data.read_records: rows of JSONL/JSON(.gz) files, and one-line errors naming the file (and
line) for a missing file, a directory, an unknown kind, bad JSON and bad UTF-8."""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
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


@pytest.fixture(scope="module")
def tfds_version_dir(tmp_path_factory):
  """A GSM8K-shaped TFDS dataset (train 3 rows, test 2) prepared offline in array_record under a
  data_dir, as `tfds build` leaves it; its version directory."""
  import tensorflow_datasets as tfds

  class TinyGsm(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          "question": tfds.features.Text(), "answer": tfds.features.Text(),
          "level": tfds.features.Scalar(dtype=np.int32)}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(0, 3), "test": self._generate_examples(10, 2)}

    def _generate_examples(self, start, n):
      for i in range(start, start + n):
        yield i, {"question": f"Tom has {i} äpples and buys 1. How many?",
                  "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}", "level": i % 3}

  data_dir = tmp_path_factory.mktemp("tfds")
  TinyGsm(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
  return data_dir / "tiny_gsm" / "1.0.0"


def test_reads_a_tfds_split_from_a_data_dir(tfds_version_dir):
  """A prepared TFDS dataset is read without TensorFlow, one split at a time (split slicing
  included), as plain JSON-like rows that the families' row mappers take as they take JSONL."""
  from marl_jax.envs.math import task as math_task
  version_dir = tfds_version_dir
  test = data.read_records(f"{version_dir}@test")
  assert test == [{"question": f"Tom has {i} äpples and buys 1. How many?",
                   "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}", "level": i % 3}
                  for i in (10, 11)]
  assert [r["level"] for r in data.read_records(f"{version_dir}@train[:2]")] == [0, 1]
  # Train on one split, evaluate on another: the math env reads each by its path.
  assert math_task.dataset_rows({"path": f"{version_dir}@train"}) == 3
  env = math_task.make_env(path=f"{version_dir}@test", index=1)
  assert (env.problem.question, env.problem.answer) == (test[1]["question"], "12")


def test_tfds_errors_are_one_line(tfds_version_dir, tmp_path):
  version_dir = tmp_path / "1.0.0"
  shutil.copytree(tfds_version_dir, version_dir)
  with pytest.raises(UserInputError, match=r"is a TFDS dataset; name a split: '.*1.0.0@train'"):
    data.read_records(version_dir)
  with pytest.raises(UserInputError, match=r"has no split 'valid' \(its splits: \['test', "
                     r"'train'\]\)") as raised:
    data.read_records(f"{version_dir}@valid")
  assert "\n" not in str(raised.value)
  # A tfrecord dataset (TFDS's default format) needs TensorFlow: refused with the conversion.
  info = json.loads((version_dir / data.TFDS_INFO).read_text())
  (version_dir / data.TFDS_INFO).write_text(json.dumps({**info, "fileFormat": "tfrecord"}))
  with pytest.raises(UserInputError, match=r"stored as tfrecord, which needs TensorFlow to read; "
                     r"convert it once: tfds convert_format --dataset_version_dir=.*1.0.0 "
                     r"--out_file_format=array_record$"):
    data.read_records(f"{version_dir}@test")
