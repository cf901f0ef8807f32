"""Which equivalence a math env's rewards use: the project's checker or math-verify, bounded.

  'builtin'      `answers.is_equiv`: normalisation plus the bounded sympy parser of `latex.py`
                 (exact rationals; free variables compared at random points).
  'math_verify'  Hugging Face's math-verify (PyPI `math-verify`), as AT-GRPO's code grades:
                 PettingLLMs' math agents call `verify(parse(...), parse(...))` on the reasoner's
                 reply, the tool program's output and each other's answers. It runs in a worker
                 process (`verify_worker.py`) under hard bounds, below, behind a hedge filter
                 (`hedges.one_answer`): math-verify grants `200\\%` both 200 and 2, and reads
                 `1 \\quad 2` as 3; each answer reaches it in one reading, or is refused.

Which paper grades how (read from the public code, docs/experiments/ecosystem.md): AT-GRPO
(PettingLLMs) with math-verify, so `configs/atgrpo_math.py` sets `env.kwargs.grader='math_verify'`
for every row of its table. Dr. MAS's math env does *not* use math-verify: it grades with
DeepScaleR's checker (`grade_answer_mathd or grade_answer_sympy`: Hendrycks' string normalisation,
then sympy on `parse_expr`, which evaluates Python), the same kind of checker as 'builtin', so the
Dr. MAS, MARFT and orchestration configs keep 'builtin' (the env default). Either grader can be
chosen for any math workflow with `--config.env.kwargs.grader=NAME`.

Both graders compare *extracted* answers (`answers.last_boxed`, `answers.program_answer`): the
extraction, and so the format penalty, is the same under either. math-verify is handed each answer
back inside the `\\boxed{}` it came from, so its LaTeX extraction sees what the reply showed.
(PettingLLMs hands math-verify the whole reply; for a reply with a `\\boxed{}` answer that extracts
the same text, since boxed content is its first choice; a reply without one gets no credit here
and can get some there, from its last number.) Argument order follows math-verify's
documentation, `verify(gold, pred)` (PettingLLMs passes the prediction first; the two orders
differ only on equations and intervals).

Bounds of 'math_verify' (math-verify's own timeout is a SIGALRM, valid only in a main thread and
blind to work inside C code): each request may use `CPU_BUDGET_S` of the worker's CPU time (its
own clock, so a loaded machine does not change a verdict) and at most `WALL_LIMIT_S` of wall
time; the worker's address space is capped at `MEMORY_MB`. A request past a bound, or a worker
that dies, grades False (counted in `timeouts` / `crashes`) and a fresh worker is started at once.
Verdicts are cached per (gold, answer), so a team that repeats an answer pays once; a CPU-budget
cut-off is cached as False (it is the answer's doing), a wall or crash cut-off is not.
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import time

from marl_jax.envs.math import answers, hedges

GRADERS = ("builtin", "math_verify")
CPU_BUDGET_S = 5.0  # math-verify's own default limit per parse / comparison
WALL_LIMIT_S = 30.0  # backstop on a machine so loaded that 5 CPU seconds take longer
MEMORY_MB = 2048  # the worker's address space (it needs ~0.4 GiB of it for sympy + antlr)
STARTUP_S = 120.0  # a worker that is not ready by then means a broken install, not a bad reply
_CACHE_SIZE = 4096
_POLL_S = 0.02
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_worker.py")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class GraderError(RuntimeError):
  """math-verify cannot be used here (not installed, or its worker does not start)."""


def check_grader(name: str) -> str:
  """`name` if it is a grader this machine can run; ValueError naming the choices otherwise."""
  if name not in GRADERS:
    raise ValueError(f"unknown math grader {name!r}; expected one of {GRADERS}")
  if name == "math_verify" and importlib.util.find_spec("math_verify") is None:
    raise ValueError("math grader 'math_verify' needs the math-verify package: "
                     "pip install math-verify==0.9.0")
  return name


def equivalent(grader: str, pred: str | None, gold: str) -> bool:
  """Whether answer `pred` equals the reference answer `gold` under `grader`; never raises for
  any answer text."""
  if grader == "builtin":
    return answers.is_equiv(pred, gold)
  if grader == "math_verify":
    return default_math_verify().equivalent(pred, gold)
  raise ValueError(f"unknown math grader {grader!r}; expected one of {GRADERS}")


_DEFAULT: MathVerifyGrader | None = None
_DEFAULT_LOCK = threading.Lock()


def default_math_verify() -> MathVerifyGrader:
  """The process's one math-verify grader (one worker, started on first use)."""
  global _DEFAULT
  with _DEFAULT_LOCK:
    if _DEFAULT is None:
      _DEFAULT = MathVerifyGrader()
    return _DEFAULT


def _cpu_seconds(pid: int) -> float | None:
  """User + system CPU time of process `pid` (Linux /proc), None where that is unreadable."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
  except (OSError, IndexError):
    return None
  return (int(fields[11]) + int(fields[12])) / _TICKS


class MathVerifyGrader:
  """math-verify in a bounded worker process (module doc). Thread-safe: one request at a time."""

  def __init__(self, cpu_budget_s: float = CPU_BUDGET_S, wall_limit_s: float = WALL_LIMIT_S,
               memory_mb: int = MEMORY_MB):
    check_grader("math_verify")
    self.cpu_budget_s, self.wall_limit_s, self.memory_mb = cpu_budget_s, wall_limit_s, memory_mb
    self.timeouts = 0  # requests cut off by a bound
    self.crashes = 0  # requests whose worker died
    self._lock = threading.Lock()
    self._cache: collections.OrderedDict[tuple[str, str], bool] = collections.OrderedDict()
    self._proc: subprocess.Popen | None = None
    self._owner = 0  # pid that started the worker: a forked child must not share its pipes
    self._ready = False
    self._buffer = b""
    atexit.register(self.close)

  def equivalent(self, pred: str | None, gold: str) -> bool:
    """Whether `pred` equals `gold` (math-verify's `verify(gold, pred)`, each in the one
    reading `hedges.one_answer` gives); False for no answer, an answer over
    `answers.MAX_ANSWER_CHARS`, one the hedge filter refuses, or a request cut off by a bound."""
    if not isinstance(pred, str) or not pred.strip() or not isinstance(gold, str):
      return False
    if len(pred) > answers.MAX_ANSWER_CHARS:
      return False
    pred, gold = hedges.one_answer(pred), hedges.one_answer(gold)
    if pred is None or gold is None:
      return False
    key = (gold, pred)
    with self._lock:
      if key in self._cache:
        self._cache.move_to_end(key)
        return self._cache[key]
      verdict = self._request(key)
      if verdict is None:  # the wall backstop or a dying worker: not this answer's verdict
        return False
      self._cache[key] = verdict
      if len(self._cache) > _CACHE_SIZE:
        self._cache.popitem(last=False)
      return verdict

  def close(self) -> None:
    """Stops the worker (a later request starts a new one)."""
    if self._proc is not None and self._owner == os.getpid():
      self._proc.kill()
      self._proc.wait()
    self._proc = None

  def _request(self, key: tuple[str, str]) -> bool | None:
    """The worker's verdict; False when the CPU budget ran out (a property of the answer, so
    it is cached); None when the wall backstop or the worker's death ended the request."""
    self._start_worker()
    line = json.dumps(["\\boxed{" + key[0] + "}", "\\boxed{" + key[1] + "}"]) + "\n"
    start_cpu = _cpu_seconds(self._proc.pid)
    try:
      self._proc.stdin.write(line.encode("utf-8", "surrogatepass"))
    except OSError:  # the worker died before reading
      reply = "eof"
    else:
      reply = self._read_line(time.monotonic() + self.wall_limit_s, start_cpu)
    if isinstance(reply, bytes):
      return reply == b"1"
    if reply == "eof":
      self.crashes += 1
    else:
      self.timeouts += 1
    self.close()
    self._start_worker(wait=False)  # the replacement starts while the caller goes on
    return False if reply == "cpu" else None

  def _start_worker(self, wait: bool = True) -> None:
    if self._proc is None or self._owner != os.getpid() or self._proc.poll() is not None:
      self._proc = subprocess.Popen(
          [sys.executable, "-I", _WORKER, str(self.memory_mb)], stdin=subprocess.PIPE,
          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
      self._owner, self._ready, self._buffer = os.getpid(), False, b""
    if wait and not self._ready:
      first = self._read_line(time.monotonic() + STARTUP_S, None)
      if first != b"ready":
        self.close()
        said = first.decode(errors="replace") if isinstance(first, bytes) else f"{first}, no line"
        raise GraderError(f"the math-verify worker did not start within {STARTUP_S:.0f} s "
                          f"({said}); expected a working math-verify install "
                          "(pip install math-verify==0.9.0)")
      self._ready = True

  def _read_line(self, deadline: float, start_cpu: float | None) -> bytes | str:
    """The worker's next line, or why none came: "eof", "wall" (the deadline passed) or "cpu"
    (the CPU budget since `start_cpu` ran out; not checked when it is None)."""
    fd = self._proc.stdout.fileno()
    while b"\n" not in self._buffer:
      if time.monotonic() > deadline:
        return "wall"
      if start_cpu is not None:
        used = _cpu_seconds(self._proc.pid)
        if used is not None and used - start_cpu > self.cpu_budget_s:
          return "cpu"
      readable, _, _ = select.select([fd], [], [], _POLL_S)
      if readable:
        chunk = os.read(fd, 4096)
        if not chunk:
          return "eof"
        self._buffer += chunk
    line, self._buffer = self._buffer.split(b"\n", 1)
    return line
