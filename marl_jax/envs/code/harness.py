"""Runs a candidate program against unit tests inside the sandbox, one sandbox call per program.

The verdict must not be something the candidate can set. So inside the sandbox two processes run:

  judge   (the sandboxed main program, below) reads the job, holds the tests, the expected outputs
          and the result channel (its stdout), and never executes candidate code. It makes itself
          non-dumpable first, so the worker (same uid) cannot ptrace it or open its memory or fds.
  worker  a fresh interpreter started by the judge, holding only the candidate. It receives one
          request at a time on a pipe and answers one JSON line: the names the candidate defined,
          the value one of its functions returned, or the output it printed for one stdin.

Two styles:
  function  the judge executes `setup` (e.g. the prompt's own helpers, HumanEval's `check`
            source and `candidate = entry_point`) and then each test statement in order, in its
            own namespace. The candidate reaches that namespace only as the functions under test:
            the entry point, or (no entry point, MBPP-like) the names the tests call that are not
            builtins; each is a proxy that calls it in the worker. So a candidate's `def abs`, a
            default argument `(abs := ...)` or `import math as sorted` changes nothing the tests
            see (modules the candidate imported are offered only under their own names, as the
            judge's own stdlib modules, since MBPP's tests use the candidate's `import math`).
            Values cross the pipe as plain data (None, bool, int, float, complex, str, bytes,
            list, tuple, dict, set), so the judge compares its own objects: a returned value can
            be wrong, but cannot be an object whose `__eq__` lies, and the candidate never sees a
            test's expected value. An exception the candidate raises is re-raised in the judge as
            the builtin of that name, except StopIteration (it would end a `map` inside a test
            early, e.g. `all(map(candidate, xs))`), which becomes a RuntimeError. Statements with
            an `assert` that read the candidate (`is_counted`) are the counted tests; others
            just run (`assert True` among them). A candidate returning anything else (a
            generator, its own class) fails that test.
  stdio     per case the worker runs the candidate as `__main__` with the case's input as stdin
            and returns what it printed; the judge compares outputs token by token: equal text,
            an integer with the same value as an expected integer (exactly, at any size), or,
            where the expected token is a real (a decimal point or an exponent), a real within
            1e-6 of it (absolute, or relative above 1; `nan` and `inf` equal no number).

Whatever the candidate does in the worker (print "pass" lines, monkeypatch builtins, `sys.exit`,
`os._exit(0)`, kill itself) changes at most the values it returns or ends the worker: a dead or
silent worker fails the current case and is restarted for the next. Each case has its own time
limit (the judge's `setitimer`, the worker is killed); after `max_timeouts` timed-out cases the rest
are skipped (failed). Test statements run in the judge: they come from the dataset, or from the
tester agent whose own reward they decide (an `assert True` of its own is not counted, but an
assert that cannot fail while calling the candidate is).

(Over 400 lines because the judge and worker programs live here as source strings, next to the
job format and result parsing they must agree with.)
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from marl_jax.sandbox import runner as sandbox

STYLES = ("function", "stdio")
PASS = "pass"
_STATUSES = frozenset({"pass", "fail", "error", "timeout", "skipped"})

# Shared by judge and worker: plain data <-> JSON. Every non-list container is a one-key tagged
# dict, so a decoded value is exactly the plain type that was encoded.
_CODEC = r'''
def _enc(x, depth=0):
  if depth > 200:
    raise ValueError("too deep")
  t = type(x)
  if x is None or t in (bool, str):
    return x
  if t is int:
    return {"i": str(x)} if abs(x) > 2**53 else x
  if t is float:
    return {"f": x.hex()}
  if t is list:
    return [_enc(v, depth + 1) for v in x]
  if t is tuple:
    return {"t": [_enc(v, depth + 1) for v in x]}
  if t in (set, frozenset):
    return {"s" if t is set else "z": [_enc(v, depth + 1) for v in x]}
  if t is dict:
    return {"d": [[_enc(k, depth + 1), _enc(v, depth + 1)] for k, v in x.items()]}
  if t is complex:
    return {"c": [x.real.hex(), x.imag.hex()]}
  if t is bytes:
    return {"b": x.hex()}
  raise TypeError("not plain data: " + t.__name__)


def _dec(x):
  if x is None or type(x) in (bool, int, str):
    return x
  if type(x) is list:
    return [_dec(v) for v in x]
  (tag, v), = x.items()
  if tag == "i":
    return int(v)
  if tag == "f":
    return float.fromhex(v)
  if tag == "t":
    return tuple(_dec(e) for e in v)
  if tag in ("s", "z"):
    return (set if tag == "s" else frozenset)(_dec(e) for e in v)
  if tag == "d":
    return {_dec(k): _dec(e) for k, e in v}
  if tag == "c":
    return complex(float.fromhex(v[0]), float.fromhex(v[1]))
  if tag == "b":
    return bytes.fromhex(v)
  raise ValueError("bad tag")
'''

_WORKER = _CODEC + r'''
import io, json, os, sys
_inbox = os.fdopen(os.dup(0), "r", encoding="utf-8")
_outbox = os.fdopen(os.dup(1), "w", encoding="utf-8")
_null = os.open(os.devnull, os.O_RDWR)
for _fd in (0, 1, 2):
  os.dup2(_null, _fd)
_ns, _code = {}, None


def _serve(msg):
  global _ns, _code
  if msg["op"] == "load":
    _code = compile(msg["code"], "<candidate>", "exec")
    _ns = {"__name__": "__candidate__", "__builtins__": __builtins__}
    if msg["style"] == "function":
      try:
        exec(_code, _ns)
      except SystemExit as e:
        if e.code not in (None, 0):
          raise
    funcs = [k for k, v in _ns.items() if not k.startswith("__") and callable(v)
             and type(v).__name__ != "module"]
    mods = {k: v.__name__ for k, v in _ns.items() if type(v).__name__ == "module"}
    return {"funcs": funcs, "modules": mods}
  if msg["op"] == "call":
    return {"value": _enc(_ns[msg["name"]](*_dec(msg["args"]), **_dec(msg["kwargs"])))}
  with open("stdin.txt", "w", encoding="utf-8") as f:
    f.write(msg["input"])
  fd = os.open("stdin.txt", os.O_RDONLY)
  os.dup2(fd, 0)
  os.close(fd)
  sys.stdin = open(0, "r", encoding="utf-8", closefd=False)
  buffer = io.BytesIO()
  sys.stdout = io.TextIOWrapper(buffer, encoding="utf-8", write_through=True)
  try:
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
  except SystemExit as e:
    if e.code not in (None, 0):
      raise
  sys.stdout.flush()
  return {"output": buffer.getvalue().decode("utf-8", "replace")}


for _line in _inbox:
  try:
    _reply = _serve(json.loads(_line))
  except BaseException as e:
    _reply = {"raise": type(e).__name__}
  sys.stdout = sys.__stdout__
  _outbox.write(json.dumps(_reply) + "\n")
  _outbox.flush()
'''
# The judge's output comparison (stdio style), separate so that it is tested as written. A
# token is an integer (ASCII digits, optional sign), a real (a decimal point or an exponent) or
# text. Integers compare exactly, by their digits (no float rounding, no size limit: a wrong
# answer of 10^9 digits is wrong, and int() would refuse over 4300 digits); only an expected real
# admits the 1e-6 tolerance, as CodeContests-style checkers state it for real-valued answers.
_JUDGE_COMPARE = r'''
import math, re
_INT = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][+-]?[0-9]+)?")


def _integer(token):
  # (negative, digits without leading zeros): equal exactly when the integers are.
  digits = token.lstrip("+-").lstrip("0") or "0"
  return (token[0] == "-" and digits != "0", digits)


def _same_token(got, want):
  if got == want:
    return True
  if _INT.fullmatch(want):
    return _INT.fullmatch(got) is not None and _integer(got) == _integer(want)
  if not (_REAL.fullmatch(want) and _REAL.fullmatch(got)):
    return False
  g, w = float(got), float(want)
  return math.isfinite(g) and math.isfinite(w) and abs(g - w) <= 1e-6 * max(1.0, abs(w))


def _same(got, want):
  a, b = got.split(), want.split()
  return len(a) == len(b) and all(_same_token(x, y) for x, y in zip(a, b))
'''
_JUDGE = _CODEC + _JUDGE_COMPARE + r'''
import builtins, ctypes, importlib, json, os, select, signal, subprocess, sys, time
sys.path = [p for p in sys.path if p and os.path.abspath(p) != os.getcwd()]  # scratch: candidate's
try:
  ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace, /proc/<judge>/{mem,fd}
except Exception:
  pass
_job = json.loads(sys.stdin.read())
_res = os.fdopen(os.dup(1), "w")
_null = os.open(os.devnull, os.O_RDWR)
for _fd in (0, 1, 2):
  os.dup2(_null, _fd)
os.makedirs("work", exist_ok=True)
_MAX_REPLY = 8 << 20


class _Timeout(BaseException):
  pass


class _WorkerGone(BaseException):
  pass


def _on_alarm(signum, frame):
  raise _Timeout()


signal.signal(signal.SIGALRM, _on_alarm)


class _Worker:
  def __init__(self):
    self.proc = subprocess.Popen([sys.executable, "-I", "-c", _job["worker"]], cwd="work",
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, close_fds=True)
    self.buffer = b""

  def ask(self, msg):
    try:
      self.proc.stdin.write((json.dumps(msg) + "\n").encode())
      self.proc.stdin.flush()
    except (OSError, ValueError):
      raise _WorkerGone()
    fd = self.proc.stdout.fileno()
    while b"\n" not in self.buffer:
      chunk = os.read(fd, 1 << 16)
      if not chunk or len(self.buffer) > _MAX_REPLY:
        raise _WorkerGone()
      self.buffer += chunk
    line, self.buffer = self.buffer.split(b"\n", 1)
    try:
      reply = json.loads(line)
      if type(reply) is not dict:
        raise ValueError()
    except (ValueError, RecursionError):
      raise _WorkerGone()
    return reply

  def kill(self):
    try:
      self.proc.kill()
    except OSError:
      pass
    self.proc.wait()


def _raise_like(name):
  kind = getattr(builtins, str(name), None)
  if (isinstance(kind, type) and issubclass(kind, Exception)
      and not issubclass(kind, (StopIteration, StopAsyncIteration))):
    raise kind("raised by the candidate")
  raise RuntimeError(f"the candidate raised {name}")


class _Session:
  # The worker with the candidate loaded; restarted after a timeout or a crash.

  def __init__(self):
    self.worker, self.loaded = None, None

  def start(self):
    if self.worker is None:
      self.worker = _Worker()
      self.loaded = self.timed(self.worker.ask, {"op": "load", "code": _job["code"],
                                                 "style": _job["style"]}, _job["load_timeout"])

  def timed(self, fn, arg, timeout):
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
      return fn(arg)
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)

  def drop(self):
    if self.worker is not None:
      self.worker.kill()
    self.worker, self.loaded = None, None


_session = _Session()


def _proxy(name):
  def call(*args, **kwargs):
    if _session.worker is None:
      raise _WorkerGone()
    reply = _session.worker.ask({"op": "call", "name": name, "args": _enc(list(args)),
                                 "kwargs": _enc(kwargs)})
    if "value" in reply:
      return _dec(reply["value"])
    _raise_like(reply.get("raise"))
  call.__name__ = name
  return call


def _status(code, ns, timeout):
  # Runs a test statement in the judge's namespace with a time limit; returns its verdict.
  try:
    try:
      signal.setitimer(signal.ITIMER_REAL, timeout)
      exec(code, ns)
      return "pass"
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
  except _Timeout:
    return "timeout"
  except AssertionError:
    return "fail"
  except BaseException:
    return "error"


def _report(i, status):
  _res.write(f"{i} {status}\n")
  _res.flush()


def _namespace(loaded):
  ns = {"__name__": "__judge__", "__builtins__": builtins}
  for alias, module in loaded.get("modules", {}).items():
    if (type(module) is str and alias == module and module in sys.stdlib_module_names
        and not hasattr(builtins, alias)):
      try:
        ns[alias] = importlib.import_module(module)
      except Exception:
        pass
  for name in loaded.get("funcs", []):
    if type(name) is str and name in _job["exposed"]:
      ns[name] = _proxy(name)
  return ns


def _loaded():
  try:
    _session.start()
  except (_Timeout, _WorkerGone):
    _session.drop()
    return None
  if "raise" in _session.loaded:
    return None
  return _session.loaded


def _function_style(cases, timeout):
  loaded = _loaded()
  ns = None
  if loaded is not None:
    ns = _namespace(loaded)
    if _status(compile(_job["setup"], "<setup>", "exec"), ns, _job["load_timeout"]) != "pass":
      ns = None
  timeouts = 0
  for i, case in enumerate(cases):
    if ns is None or timeouts >= _job["max_timeouts"]:
      _report(i, "skipped" if ns is not None else "error")
      continue
    if _session.worker is None and _loaded() is None:
      _report(i, "error")
      continue
    try:
      test = compile(case, f"<test {i}>", "exec")
    except BaseException:
      _report(i, "error")
      continue
    status = _status(test, ns, timeout)
    if status in ("timeout", "error"):
      _session.drop()  # a worker stuck in a loop, dead, or out of step: a fresh one next
    timeouts += status == "timeout"
    _report(i, status)


def _stdio_style(cases, timeout):
  timeouts = 0
  for i, case in enumerate(cases):
    if timeouts >= _job["max_timeouts"]:
      _report(i, "skipped")
      continue
    if _loaded() is None:
      _report(i, "error")
      continue
    try:
      reply = _session.timed(_session.worker.ask, {"op": "stdio", "input": case["input"]},
                             timeout)
      output = reply.get("output")
      status = "error" if type(output) is not str else (
          "pass" if _same(output, case["output"]) else "fail")
    except _Timeout:
      status = "timeout"
    except _WorkerGone:
      status = "error"
    if status in ("timeout", "error"):
      _session.drop()
    timeouts += status == "timeout"
    _report(i, status)


if _job["style"] == "function":
  _function_style(_job["cases"], _job["case_timeout"])
else:
  _stdio_style(_job["cases"], _job["case_timeout"])
_session.drop()
_res.write("done\n")
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
  `setup` is trusted code (the dataset's) run in the judge before the tests. `entry_point` is the
  one candidate function the tests may call; None (MBPP-like tasks name it only in their tests)
  exposes the non-builtin names the tests and setup call instead (`exposed_names`).
  """

  style: str
  code: str
  tests: tuple[Any, ...]
  setup: str = ""
  entry_point: str | None = None

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


_PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError)  # deep nesting, floods


def _tree(source: str) -> ast.Module | None:
  try:
    return ast.parse(source)
  except _PARSE_ERRORS:
    return None  # it errors in the judge too


def has_assert(statement: str) -> bool:
  """Whether a statement holds an `assert` (or does not parse: then it errors, a failed test)."""
  tree = _tree(statement)
  return tree is None or any(isinstance(node, ast.Assert) for node in ast.walk(tree))


def exposed_names(job: TestJob) -> list[str]:
  """The candidate's names the judge's namespace may hold (module doc): the entry point, else the
  names the tests and setup load that are not builtins (a test calling `sorted` means the
  judge's `sorted`, whatever the candidate defined under that name)."""
  if job.style != "function":
    return []
  if job.entry_point:
    return [job.entry_point]
  trees = [t for t in map(_tree, (job.setup, *job.tests)) if t is not None]
  names = {node.id for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Name)}
  return sorted(n for n in names if not hasattr(builtins, n))


def _bound(tree: ast.Module) -> set[str]:
  """Names a piece of trusted or test code binds itself (assigned, defined, imported)."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
      names.add(node.id)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
  return names


def candidate_names(job: TestJob) -> frozenset[str]:
  """The names through which a test statement reaches the candidate: the exposed names that the
  setup and tests do not bind themselves (an MBPP test's own `x = [1, 2]` is not the candidate's;
  a test that rebinds the entry point tests its own function), plus the setup's top-level aliases
  of them (HumanEval's `candidate = entry_point`); none for stdio tests."""
  if job.style != "function":
    return frozenset()
  setup = _tree(job.setup)
  trees = [t for t in (setup, *map(_tree, job.tests)) if t is not None]
  names = set(exposed_names(job)) - set().union(*map(_bound, trees))
  for node in setup.body if setup is not None else ():
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in names:
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
  return frozenset(names)


def is_counted(statement: str, candidates: frozenset[str]) -> bool:
  """A function-style statement counts as a test when it holds an `assert` and reads one of the
  `candidate_names`, i.e. it exercises the candidate; a statement that does not parse counts
  (it errors: a failed test). HumanEval's `assert True, "..."` lines (48 of them, on 36
  problems) run but are not counted: they pass for any program that loads, which made every
  such problem's pass ratio non-zero and MAGRPO's "a test passed" gate always open. CoMLRL
  counts the `assert` lines of `check` that mention `candidate` (docs/fidelity.md)."""
  tree = _tree(statement)
  if tree is None:
    return True
  nodes = list(ast.walk(tree))
  return (any(isinstance(n, ast.Assert) for n in nodes)
          and any(isinstance(n, ast.Name) and n.id in candidates for n in nodes))


def run_tests(jobs: Sequence[TestJob], limits: ExecLimits = ExecLimits(),
              max_workers: int = 2) -> list[TestReport]:
  """Runs every job in its own sandboxed judge (a few at a time); reports in input order."""
  payloads, counted, timeouts = [], [], []
  for job in jobs:
    cases = list(job.tests)
    names = candidate_names(job)
    flags = [is_counted(c, names) if job.style == "function" else True for c in cases]
    counted.append(flags)
    payloads.append(json.dumps({
        "worker": _WORKER, "style": job.style, "code": job.code, "setup": job.setup,
        "exposed": exposed_names(job), "cases": cases, "case_timeout": limits.case_timeout_s,
        "load_timeout": limits.load_timeout_s, "max_timeouts": limits.max_timeouts}))
    timeouts.append(limits.program_timeout(len(cases)))
  reports: list[TestReport | None] = [None] * len(jobs)
  # One run_many call per distinct timeout keeps the API simple; most batches share one timeout.
  for timeout in sorted(set(timeouts)):
    idx = [i for i, t in enumerate(timeouts) if t == timeout]
    results = sandbox.run_many([_JUDGE] * len(idx), stdins=[payloads[i] for i in idx],
                               timeout_s=timeout, memory_mb=limits.memory_mb,
                               max_workers=max_workers, max_procs=16,
                               disk_mb=64)
    for i, result in zip(idx, results):
      reports[i] = _parse(result, counted[i])
  return [r for r in reports if r is not None]


def _parse(result: sandbox.SandboxResult, counted: list[bool]) -> TestReport:
  """The judge's `index status` lines; anything else (a status never reported) is 'missing'."""
  found: dict[int, str] = {}
  for line in result.stdout.splitlines():
    parts = line.split()
    if (len(parts) == 2 and parts[0].isascii() and parts[0].isdigit()
        and parts[1] in _STATUSES):
      found.setdefault(int(parts[0]), parts[1])
  statuses = tuple(found.get(i, "missing") for i, flag in enumerate(counted) if flag)
  return TestReport(statuses, result.error)
