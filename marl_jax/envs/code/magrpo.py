"""MAGRPO HumanEval, docs/papers.md section 3: agent 1 writes helper `aux`, agent 2 the entry point.

The two agents act in parallel (agent 2 does not see agent 1's reply) and share one joint reward,
max 4.0, computed level by level:

  L1  +0.4  `aux` defined with a value-returning `return` (optional: no stop without it)
      +0.6  the entry point defined with a value-returning `return` (required, else stop)
  L2  +0.5  prompt imports + aux + main, concatenated, parse as Python (else stop)
  L3  +1.0 x pass ratio of the problem's tests (each assert with its own time limit, sandboxed)
      bonus block, only when at least one test passed (a counted test: an assert that calls the
      candidate, `harness.is_counted`; never HumanEval's `assert True`), aux is defined and main
      calls aux:
      +0.5  main calls aux
      +1.0  main is not a thin wrapper of aux
      -0.5  main ignores the value of some aux call

Precise definitions (on the AST):
- "defined": a top-level `def NAME(...)` in the agent's code (its last fenced block, else the
  whole reply; the last such def wins). When that code does not parse, the def is found textually
  (its header line at column 0 plus the indented lines after it) and the return test is textual.
- "value-returning return": a `return <expr>` inside the function's own body (nested functions,
  lambdas and classes excluded).
- "main calls aux": a call `aux(...)` anywhere inside main.
- "thin wrapper": main's body, without its docstring, is exactly `return aux(ARGS)`, or exactly
  `v = aux(ARGS)` then `return v`, where every argument in ARGS (positional, `*`, keyword, `**`) is
  a bare name or a constant: main then adds no computation of its own.
- "ignores the value": an expression statement whose whole value is a call `aux(...)` (the result
  is discarded), anywhere inside main.
The bonus gating (passed test, aux defined, main calls aux) follows the CoMLRL reward code.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re

from marl_jax.envs.code import harness as code_harness
from marl_jax.envs.base import MAX_REPLY_CHARS, Observation, StepResult
from marl_jax.envs.code.env import CodeProblem, problem_imports, reply_code

AUX = "aux"

AUX_SYSTEM = (
    "You are agent 1 of a two-agent coding team. Write ONLY a helper function named `aux` that "
    "will help implement the function below; another agent writes the main function and may call "
    "your `aux`. Give `aux` in one ```python block and make it return a value.")
MAIN_SYSTEM = (
    "You are agent 2 of a two-agent coding team. Implement the main function below. A helper "
    "function `aux` written by your teammate will be defined in the same module: call it where it "
    "helps and use its return value, but do not define `aux` yourself. Give the function in one "
    "```python block.")


@dataclasses.dataclass(frozen=True)
class AuxMainReward:
  """The reward and its parts (every term of the module doc), for logging and tests."""

  aux_defined: bool
  main_defined: bool
  parses: bool
  pass_ratio: float
  main_calls_aux: bool
  thin_wrapper: bool
  ignores_aux: bool
  total: float


def agent_code(response: str) -> str:
  """An agent's code: the last fenced block of its reply, else the whole reply; only the first
  MAX_REPLY_CHARS are read (a megabyte reply would cost seconds in `ast`, e.g. source segments)."""
  response = (response or "")[:MAX_REPLY_CHARS]
  code = reply_code(response)
  return code if code is not None else response


def _own_nodes(func: ast.FunctionDef):
  """Nodes of `func`'s own body, not descending into nested functions, lambdas or classes."""
  stack = list(func.body)
  while stack:
    node = stack.pop()
    yield node
    for child in ast.iter_child_nodes(node):
      if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
        stack.append(child)


def find_function(code: str, name: str) -> tuple[str | None, bool]:
  """(source of the last top-level `def name`, whether it has a value-returning return)."""
  try:
    tree = ast.parse(code)
  except (SyntaxError, ValueError, RecursionError, MemoryError):  # deep nesting, huge replies
    return _find_textually(code, name)
  found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
  if not found:
    return None, False
  func = found[-1]
  returns = any(isinstance(n, ast.Return) and n.value is not None for n in _own_nodes(func))
  return ast.get_source_segment(code, func, padded=True), returns


def _find_textually(code: str, name: str) -> tuple[str | None, bool]:
  lines = code.splitlines()
  starts = [i for i, line in enumerate(lines) if re.match(rf"def\s+{re.escape(name)}\s*\(", line)]
  if not starts:
    return None, False
  body = [lines[starts[-1]]]
  for line in lines[starts[-1] + 1:]:
    if line.strip() and not line[0].isspace():
      break
    body.append(line)
  source = "\n".join(body)
  return source, re.search(r"^\s+return\s+\S", source, re.MULTILINE) is not None


def _is_aux_call(node: ast.AST) -> bool:
  return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == AUX)


def _simple_args(call: ast.Call) -> bool:
  values = [a.value if isinstance(a, ast.Starred) else a for a in call.args]
  values += [k.value for k in call.keywords]
  return all(isinstance(v, (ast.Name, ast.Constant)) for v in values)


def _body_without_docstring(func: ast.FunctionDef) -> list[ast.stmt]:
  body = list(func.body)
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
      and isinstance(body[0].value.value, str):
    body = body[1:]
  return body


def is_thin_wrapper(func: ast.FunctionDef) -> bool:
  """Module doc: `return aux(ARGS)` or `v = aux(ARGS); return v` with bare-name/constant ARGS."""
  body = _body_without_docstring(func)
  if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
    return _is_aux_call(body[0].value) and _simple_args(body[0].value)
  if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Return):
    assign, ret = body
    return (len(assign.targets) == 1 and isinstance(assign.targets[0], ast.Name)
            and _is_aux_call(assign.value) and _simple_args(assign.value)
            and isinstance(ret.value, ast.Name) and ret.value.id == assign.targets[0].id)
  return False


def _main_structure(main_source: str, entry_point: str) -> tuple[bool, bool, bool]:
  """(calls aux, thin wrapper, ignores an aux value) of the main function's source."""
  tree = ast.parse(main_source)
  func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry_point)
  nodes = list(ast.walk(func))
  calls = any(_is_aux_call(n) for n in nodes)
  ignores = any(isinstance(n, ast.Expr) and _is_aux_call(n.value) for n in nodes)
  return calls, is_thin_wrapper(func), ignores


def aux_main_reward(aux_response: str, main_response: str, problem: CodeProblem,
                    limits: code_harness.ExecLimits = code_harness.ExecLimits()) -> AuxMainReward:
  """The level-gated joint reward of the module doc."""
  if not problem.entry_point or problem.style != "function":
    raise ValueError(f"the aux/main reward needs a function problem with an entry point; got "
                     f"style={problem.style!r}, entry_point={problem.entry_point!r}")
  aux_src, aux_returns = find_function(agent_code(aux_response), AUX)
  main_src, main_returns = find_function(agent_code(main_response), problem.entry_point)
  aux_defined = aux_src is not None and aux_returns
  main_defined = main_src is not None and main_returns
  total = 0.4 * aux_defined + 0.6 * main_defined
  parts = dict(aux_defined=aux_defined, main_defined=main_defined, parses=False, pass_ratio=0.0,
               main_calls_aux=False, thin_wrapper=False, ignores_aux=False)
  if not main_defined:
    return AuxMainReward(**parts, total=total)
  combined = "\n\n".join(filter(None, [problem_imports(problem.prompt), aux_src, main_src]))
  try:
    ast.parse(combined)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return AuxMainReward(**parts, total=total)
  parts["parses"] = True
  total += 0.5
  report = code_harness.run_tests(
      [problem.job("\n\n".join(filter(None, [aux_src, main_src])))], limits)[0]
  parts["pass_ratio"] = report.ratio
  total += report.ratio
  calls, thin, ignores = _main_structure(main_src, problem.entry_point)
  parts.update(main_calls_aux=calls, thin_wrapper=thin, ignores_aux=ignores)
  if report.passed > 0 and aux_defined and calls:
    total += 0.5 + (0.0 if thin else 1.0) - (0.5 if ignores else 0.0)
  return AuxMainReward(**parts, total=total)


class AuxMainEnv:
  """Two agents ("aux", "main") in one parallel turn; both get the joint reward on main's step."""

  agents = ("aux", "main")

  def __init__(self, problem: CodeProblem,
               limits: code_harness.ExecLimits = code_harness.ExecLimits()):
    if not problem.entry_point or problem.style != "function":
      raise ValueError(f"the aux/main task needs a function problem (HumanEval-like); got "
                       f"style={problem.style!r}, entry_point={problem.entry_point!r}")
    self.problem = problem
    self.limits = limits
    self.turn = 0
    self.aux_response: str | None = None
    self.reward: AuxMainReward | None = None

  @property
  def done(self) -> bool:
    return self.reward is not None

  @property
  def solved(self) -> bool:
    """Task success: the joint program passes every test."""
    return self.reward is not None and self.reward.pass_ratio == 1.0

  def clone(self) -> AuxMainEnv:
    return copy.copy(self)

  def observe(self, agent: str) -> Observation:
    self._check(agent)
    system = AUX_SYSTEM if agent == "aux" else MAIN_SYSTEM
    return Observation(agent, self.turn, system,
                       f"Main function `{self.problem.entry_point}`:\n```python\n"
                       f"{self.problem.prompt}\n```")

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    del tool_output
    self._check(agent)
    if self.done:
      raise ValueError(f"step({agent!r}) on a finished episode")
    if agent == "aux":
      self.aux_response = response
      return StepResult(agent, None, {"aux": 0.0}, False, {})
    if self.aux_response is None:
      raise ValueError("the main agent steps after the aux agent in the same turn")
    self.reward = aux_main_reward(self.aux_response, response, self.problem, self.limits)
    self.turn = 1
    r = self.reward.total
    return StepResult(agent, None, {"main": r, "aux": r}, True,
                      {**dataclasses.asdict(self.reward), "solved": self.solved})

  def _check(self, agent: str) -> None:
    if agent not in self.agents:
      raise ValueError(f"unknown agent {agent!r}; expected one of {self.agents}")
