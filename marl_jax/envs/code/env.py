"""Code environments: AT-GRPO coder + unit-test writer and a single coder (built by code/task.py).

Problems are canonical code dicts (code/data.py): stdin/stdout tasks (APPS, CodeContests,
LiveCodeBench) or function tasks (HumanEval, MBPP). Every program runs through `code_harness`
(the sandbox); the env runs them itself inside `step`, one sandbox call per step.

AT-GRPO ('atgrpo', docs/papers.md section 1), each turn the coder then the tester:
  coder   writes the program (last ```python block). Reward: pass ratio of the ground-truth tests.
  tester  writes unit tests for the problem, seeing this turn's code: stdio tasks as
          `**Test Input:**` / `**Test Output:**` fenced pairs, function tasks as `assert`s in a
          ```python block. Its tests run on the turn's code. Reward: their pass ratio on that code
          plus the code's ground-truth pass ratio (PettingLLMs' "sum" mode: the tests are worth as
          much as they agree with the code and the code is right).
  The episode ends when the generated tests all pass on the generated code (or after max_turns);
  it is solved when the latest code passes every ground-truth test.
'single': one coder, one turn, rewarded by the ground-truth pass ratio (the SA baseline).
'magrpo': the aux + main pair of code/magrpo.py.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
from typing import Any

from marl_jax.envs import actions as actions_lib
from marl_jax.envs.code import harness as code_harness
from marl_jax.envs.base import MAX_REPLY_CHARS, Observation, StepResult, truncate

MAX_GENERATED_TESTS = 10
_MAX_PROMPT_CODE = 4000
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_LABEL = re.compile(r"\b(input|output)\b", re.IGNORECASE)

CODER_SYSTEM = (
    "You are the coder of a two-agent team. Solve the programming problem in Python. Think "
    "briefly, then give the complete solution in one ```python block.")
TESTER_SYSTEM = (
    "You are the unit-test writer of a two-agent team. Write new, correct test cases for the "
    "problem that tell right programs from wrong ones; derive each expected output carefully.")
SINGLE_SYSTEM = "Solve the programming problem in Python. Give the solution in one ```python block."


def problem_imports(prompt: str) -> str:
  """The top-level imports of a function task's prompt (HumanEval prompts import `List`...)."""
  try:
    tree = ast.parse(prompt)
  except SyntaxError:
    return ""
  return "\n".join(ast.unparse(node) for node in tree.body
                   if isinstance(node, (ast.Import, ast.ImportFrom)))


def prompt_helpers(prompt: str, entry_point: str) -> str:
  """The definitions a function task's prompt gives besides the entry point (HumanEval/32's
  `poly`, /38's `encode_cyclic`...), run by the judge itself before the tests that call them:
  they are the dataset's, so a candidate's own `poly` cannot stand in for them."""
  try:
    tree = ast.parse(prompt)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return ""
  kept = [node for node in tree.body
          if isinstance(node, (ast.Import, ast.ImportFrom, ast.ClassDef))
          or (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
              and node.name != entry_point)
          or (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant))]
  return "\n".join(ast.unparse(node) for node in kept)


def reply_code(response: str) -> str | None:
  """The program in a reply: its last fenced block, else None."""
  return actions_lib.extract_code(response)


def parse_generated_tests(response: str, style: str) -> tuple[Any, ...]:
  """Tests a tester wrote: stdio `{"input", "output"}` pairs, or the statements of its last
  python block (function style) up to its MAX_GENERATED_TESTS-th with an `assert` (the judge
  counts those that also call the candidate: `code_harness.is_counted`); empty when none
  parse."""
  response = (response or "")[:MAX_REPLY_CHARS]
  if style == "stdio":
    return _stdio_pairs(response)
  code = reply_code(response)
  if code is None:
    return ()
  try:  # deep nesting raises RecursionError, huge replies MemoryError: both are just bad tests
    tree = ast.parse(code)
    statements = [ast.unparse(node) for node in tree.body]
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return ()
  asserts = [i for i, s in enumerate(statements) if code_harness.has_assert(s)]
  if not asserts:
    return ()
  keep = asserts[MAX_GENERATED_TESTS - 1] if len(asserts) > MAX_GENERATED_TESTS else asserts[-1]
  return tuple(statements[:keep + 1])


def _stdio_pairs(response: str) -> tuple[dict[str, str], ...]:
  """Fenced blocks labelled by the last "input"/"output" word before them, paired in order: one
  linear pass over the fences (a single pairing regex backtracks quadratically on floods)."""
  pairs, pending, end = [], None, 0
  for fence in _FENCE.finditer(response):
    labels = _LABEL.findall(response, end, fence.start())
    end = fence.end()
    label = labels[-1].lower() if labels else None
    if label == "input":
      pending = fence.group(1)
    elif label == "output" and pending is not None:
      pairs.append({"input": pending, "output": fence.group(1)})
      pending = None
  return tuple(pairs[:MAX_GENERATED_TESTS])


@dataclasses.dataclass(frozen=True)
class CodeProblem:
  """A canonical code problem (see code/data.py), immutable so env clones can share it."""

  question: str
  style: str
  tests: tuple[Any, ...]
  test_setup: str = ""
  entry_point: str | None = None
  prompt: str = ""
  solution: str | None = None
  id: str = ""

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> CodeProblem:
    if d.get("style") not in code_harness.STYLES:
      raise ValueError(f"code problem style {d.get('style')!r}; expected one of "
                       f"{code_harness.STYLES}")
    if not d.get("tests"):
      raise ValueError(f"code problem {d.get('id', '')!r} has no tests")
    return cls(d["question"], d["style"], tuple(d["tests"]), d.get("test_setup", ""),
               d.get("entry_point"), d.get("prompt") or d["question"], d.get("solution"),
               str(d.get("id", "")))

  def program(self, code: str) -> str:
    """Candidate code as run: function tasks get the prompt's imports prepended."""
    if self.style == "function":
      return f"{problem_imports(self.prompt)}\n{code}"
    return code

  def job(self, code: str, tests: tuple[Any, ...] | None = None) -> code_harness.TestJob:
    """The judge's job for candidate `code` (without the prompt's imports; `program` adds
    them): the problem's own tests after their setup, or a tester's `tests` without it. Either
    way the prompt's helpers (`prompt_helpers`) are defined and only the entry point is exposed."""
    setup = [self.test_setup if tests is None else ""]
    if self.style == "function" and self.entry_point:
      setup.insert(0, prompt_helpers(self.prompt, self.entry_point))
    return code_harness.TestJob(self.style, self.program(code),
                                self.tests if tests is None else tuple(tests),
                                "\n".join(filter(None, setup)), self.entry_point)

  def statement(self) -> str:
    if self.style == "stdio":
      return (f"{self.question}\nYour program reads standard input and writes standard output "
              "(use input() and print()).")
    if self.entry_point:
      return f"Implement the function `{self.entry_point}`:\n```python\n{self.prompt}\n```"
    # MBPP-style tasks name the function only in their tests: show the first one.
    return f"{self.prompt}\nYour code should pass tests like:\n{self.tests[0]}"


class CodeEnv:
  """AT-GRPO coder + tester ('atgrpo') or a single coder ('single'); module doc."""

  def __init__(self, problem: CodeProblem, *, workflow: str = "atgrpo", max_turns: int = 4,
               limits: code_harness.ExecLimits = code_harness.ExecLimits()):
    if workflow not in ("atgrpo", "single"):
      raise ValueError(f"CodeEnv workflow {workflow!r}; expected 'atgrpo' or 'single'")
    self.problem = problem
    self.workflow = workflow
    self.agents = ("coder", "tester") if workflow == "atgrpo" else ("coder",)
    self.max_turns = max_turns if workflow == "atgrpo" else 1
    self.limits = limits
    self.turn = 0
    self.code: str | None = None
    self.gt_report: code_harness.TestReport | None = None
    self.tests: tuple[Any, ...] = ()
    self.gen_report: code_harness.TestReport | None = None
    self.agreed = False

  @property
  def done(self) -> bool:
    return self.agreed or self.turn >= self.max_turns

  @property
  def solved(self) -> bool:
    return self.gt_report is not None and self.gt_report.all_passed

  def clone(self) -> CodeEnv:
    return copy.copy(self)

  def observe(self, agent: str) -> Observation:
    self._check(agent)
    task = f"{self.problem.statement()}\nTurn {self.turn + 1} of {self.max_turns}."
    if agent == "coder":
      system = CODER_SYSTEM if self.workflow == "atgrpo" else SINGLE_SYSTEM
      if self.turn > 0 and self.code is not None:
        task += (f"\nYour previous program:\n```python\n{truncate(self.code, _MAX_PROMPT_CODE)}"
                 f"\n```\n{self._feedback()}\nFix the program (or the disagreement) and give the "
                 "full corrected solution.")
      return Observation(agent, self.turn, system, task)
    code = "none (no ```python block)" if self.code is None else (
        f"```python\n{truncate(self.code, _MAX_PROMPT_CODE)}\n```")
    if self.problem.style == "stdio":
      fmt = ("Give each test as:\n**Test Input:**\n```\n<input>\n```\n**Test Output:**\n```\n"
             "<expected output>\n```")
    else:
      fmt = ("Give the tests as `assert` statements calling the function, in one ```python "
             "block.")
    return Observation(agent, self.turn, TESTER_SYSTEM,
                       f"{task}\nThe coder's program this turn:\n{code}\n{fmt}")

  def _feedback(self) -> str:
    if self.gen_report is None:
      return "The unit-test writer gave no parseable tests."
    shown = ", ".join(f"test {i + 1}: {s}" for i, s in enumerate(self.gen_report.statuses))
    return f"Results of the unit-test writer's tests on it: {shown}."

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    """One agent's step; malformed replies cost reward, never raise. `tool_output` is unused (the
    env runs programs itself) and accepted for the engine's uniform call."""
    del tool_output
    self._check(agent)
    if self.done:
      raise ValueError(f"step({agent!r}) on a finished episode (turn {self.turn})")
    if agent == "coder":
      self.code = reply_code(response)  # extract_code reads the first MAX_REPLY_CHARS
      self.gt_report = None
      if self.code is not None:
        self.gt_report = code_harness.run_tests([self.problem.job(self.code)], self.limits)[0]
      ratio = self.gt_report.ratio if self.gt_report else 0.0
      if self.workflow == "single":
        self.turn += 1
      return StepResult(agent, None, {"coder": ratio}, self.done,
                        {"gt_pass_ratio": ratio, "format_error": self.code is None,
                         "solved": self.solved})
    self.tests = parse_generated_tests(response, self.problem.style)
    self.gen_report = None
    if self.tests and self.code is not None:
      self.gen_report = code_harness.run_tests([self.problem.job(self.code, self.tests)],
                                               self.limits)[0]
    match = self.gen_report.ratio if self.gen_report else 0.0
    gt = self.gt_report.ratio if self.gt_report else 0.0
    self.agreed = self.gen_report is not None and self.gen_report.all_passed
    self.turn += 1
    return StepResult(agent, None, {"tester": match + gt}, self.done,
                      {"generated_pass_ratio": match, "gt_pass_ratio": gt,
                       "num_tests": len(self.tests), "format_error": not self.tests,
                       "solved": self.solved})

  def _check(self, agent: str) -> None:
    if agent not in self.agents:
      raise ValueError(f"unknown agent {agent!r}; expected one of {self.agents}")
