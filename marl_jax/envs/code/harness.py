"""Runs a candidate program against unit tests inside the sandbox, one sandbox call per program.

A test-by-test sandbox call would cost a process start (~0.15 s) per test; instead one harness
program (below) runs in the sandbox, executes the candidate, then every test case with its own
time limit (`setitimer`), and prints one result line per case as soon as it finishes. Two styles:

  function  the candidate's code is executed once (a module namespace), then `setup` (e.g.
            HumanEval's `check` source plus `candidate = entry_point`), then each test statement
            in order in that namespace. Statements with an `assert` are the counted tests;
            others (imports, assignments inside HumanEval's `check`) just run.
  stdio     for each case the candidate runs as `__main__` in a fresh namespace with that case's
            input as fd 0 / `sys.stdin` and its output captured; outputs compare token by token
            (numbers within 1e-6).

Failure modes never raise here: a syntax error fails every case; a crash, `os._exit` or a sandbox
kill fails every case not yet reported; after `max_timeouts` timed-out cases the rest are skipped
(failed) so that a looping candidate costs at most a few time limits.

Result lines carry a random per-run nonce and the candidate's stdout/stderr go to /dev/null, so
printing fake results does not count. This does not stop code that deliberately inspects the
harness's own frames: the sandbox protects the machine, not the reward, from a candidate that sets
out to forge it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import secrets
from collections.abc import Sequence
from typing import Any

from marl_jax.sandbox import runner as sandbox

STYLES = ("function", "stdio")
PASS = "pass"

_HARNESS = r'''
import io, json, os, signal, sys
_payload = json.loads(sys.stdin.read())
_nonce = _payload["nonce"]
_res = os.fdopen(os.dup(1), "w")
_null = os.open(os.devnull, os.O_RDWR)
for _fd in (0, 1, 2):
  os.dup2(_null, _fd)


class _Timeout(BaseException):
  pass


def _on_alarm(signum, frame):
  raise _Timeout()


signal.signal(signal.SIGALRM, _on_alarm)


def _report(i, status):
  _res.write(f"{_nonce} {i} {status}\n")
  _res.flush()


def _run(code, ns, timeout):
  try:
    try:
      signal.setitimer(signal.ITIMER_REAL, timeout)
      exec(code, ns)
      status = "pass"
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
  except _Timeout:
    status = "timeout"
  except AssertionError:
    status = "fail"
  except SystemExit as e:
    status = "pass" if e.code in (None, 0) else "error"
  except BaseException:
    status = "error"
  return status


def _same(got, want):
  a, b = got.split(), want.split()
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    try:
      fx, fy = float(x), float(y)
    except ValueError:
      return False
    if abs(fx - fy) > 1e-6 * max(1.0, abs(fy)):
      return False
  return True


def _main():
  style, cases, timeout = _payload["style"], _payload["cases"], _payload["case_timeout"]
  try:
    code = compile(_payload["code"], "<candidate>", "exec")
  except BaseException:
    for i, _ in enumerate(cases):
      _report(i, "error")
    return
  timeouts = 0
  if style == "function":
    ns = {"__name__": "__candidate__", "__builtins__": __builtins__}
    loaded = _run(code, ns, _payload["load_timeout"])
    if loaded == "pass":
      _run(compile(_payload["setup"], "<setup>", "exec"), ns, _payload["load_timeout"])
    for i, case in enumerate(cases):
      if loaded != "pass" or timeouts >= _payload["max_timeouts"]:
        _report(i, "skipped" if loaded == "pass" else "error")
        continue
      try:
        test = compile(case, f"<test {i}>", "exec")
      except BaseException:
        _report(i, "error")
        continue
      status = _run(test, ns, timeout)
      timeouts += status == "timeout"
      _report(i, status)
    return
  for i, case in enumerate(cases):
    if timeouts >= _payload["max_timeouts"]:
      _report(i, "skipped")
      continue
    with open("stdin.txt", "w", encoding="utf-8") as f:
      f.write(case["input"])
    fd = os.open("stdin.txt", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    sys.stdin = open(0, "r", encoding="utf-8", closefd=False)
    buffer = io.BytesIO()
    sys.stdout = io.TextIOWrapper(buffer, encoding="utf-8", write_through=True)
    status = _run(code, {"__name__": "__main__", "__builtins__": __builtins__}, timeout)
    try:
      sys.stdout.flush()
      output = buffer.getvalue().decode("utf-8", "replace")
    except BaseException:
      output, status = "", "error"
    sys.stdout = sys.__stdout__
    timeouts += status == "timeout"
    if status == "pass" and not _same(output, case["output"]):
      status = "fail"
    _report(i, status)


_main()
_res.write(f"{_nonce} done\n")
_res.flush()
'''


@dataclasses.dataclass(frozen=True)
class ExecLimits:
  """Time and memory limits of one test run (per case, for the whole program, per process)."""

  case_timeout_s: float = 2.0
  load_timeout_s: float = 5.0  # executing the candidate's definitions / `setup`
  total_timeout_s: float = 30.0  # cap of the whole sandbox call
  memory_mb: int = 512
  max_timeouts: int = 3

  def program_timeout(self, num_cases: int) -> float:
    return min(self.total_timeout_s,
               1.0 + 2 * self.load_timeout_s + self.case_timeout_s * max(1, num_cases))


@dataclasses.dataclass(frozen=True)
class TestJob:
  """A candidate program and the tests to run on it.

  `tests` are statement sources (function style) or {"input", "output"} dicts (stdio style).
  """

  style: str
  code: str
  tests: tuple[Any, ...]
  setup: str = ""

  def __post_init__(self):
    if self.style not in STYLES:
      raise ValueError(f"unknown test style {self.style!r}; expected one of {STYLES}")


@dataclasses.dataclass(frozen=True)
class TestReport:
  """Per-counted-test outcome: pass, fail, error, timeout, skipped or missing (never reported,
  e.g. the program was killed)."""

  statuses: tuple[str, ...]
  sandbox_error: str | None = None

  @property
  def total(self) -> int:
    return len(self.statuses)

  @property
  def passed(self) -> int:
    return sum(s == PASS for s in self.statuses)

  @property
  def ratio(self) -> float:
    return self.passed / self.total if self.total else 0.0

  @property
  def all_passed(self) -> bool:
    return self.total > 0 and self.passed == self.total


def is_counted(statement: str) -> bool:
  """A function-style test statement counts as a test when it contains an `assert` (or does not
  parse: then it errors and counts as failed)."""
  try:
    tree = ast.parse(statement)
  except SyntaxError:
    return True
  return any(isinstance(node, ast.Assert) for node in ast.walk(tree))


def run_tests(jobs: Sequence[TestJob], limits: ExecLimits = ExecLimits(),
              max_workers: int = 2) -> list[TestReport]:
  """Runs every job in its own sandboxed harness (a few at a time); reports in input order."""
  payloads, counted, timeouts = [], [], []
  for job in jobs:
    cases = list(job.tests)
    flags = ([is_counted(c) for c in cases] if job.style == "function" else [True] * len(cases))
    counted.append(flags)
    nonce = secrets.token_hex(16)
    payloads.append((nonce, json.dumps({
        "nonce": nonce, "style": job.style, "code": job.code, "setup": job.setup,
        "cases": cases, "case_timeout": limits.case_timeout_s,
        "load_timeout": limits.load_timeout_s, "max_timeouts": limits.max_timeouts})))
    timeouts.append(limits.program_timeout(len(cases)))
  reports: list[TestReport | None] = [None] * len(jobs)
  # One run_many call per distinct timeout keeps the API simple; most batches share one timeout.
  for timeout in sorted(set(timeouts)):
    idx = [i for i, t in enumerate(timeouts) if t == timeout]
    results = sandbox.run_many([_HARNESS] * len(idx), stdins=[payloads[i][1] for i in idx],
                               timeout_s=timeout, memory_mb=limits.memory_mb,
                               max_workers=max_workers, max_procs=16,
                               disk_mb=64)
    for i, result in zip(idx, results):
      reports[i] = _parse(result, payloads[i][0], counted[i])
  return [r for r in reports if r is not None]


def _parse(result: sandbox.SandboxResult, nonce: str, counted: list[bool]) -> TestReport:
  found: dict[int, str] = {}
  for line in result.stdout.splitlines():
    parts = line.split()
    if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit():
      found.setdefault(int(parts[1]), parts[2])
  statuses = tuple(found.get(i, "missing") for i, flag in enumerate(counted) if flag)
  return TestReport(statuses, result.error)

