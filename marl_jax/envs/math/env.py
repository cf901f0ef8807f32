"""Math envs of AT-GRPO, Dr. MAS and MARFT (docs/papers.md sections 1, 2, 4), one problem each.

All share a problem {"question", "answer"} and its grader (`grading.py`: the project's checker
or math-verify, chosen per config as the paper's code grades); rewards are additive
agent-keyed contributions (envs/base.py); the team reward the engine attaches when an episode ends
is `solved` (1/0), which the estimators mix in as `alpha * team + local`.
The orchestration teams built on these (learned stopping on the Dr. MAS loop; spawning, delegation
and aggregation of solvers) live in `orchestration_stop.py` and `orchestration_spawn.py`.

'atgrpo'  each turn a tool agent writes a Python program (the workflow runs it in the sandbox and
          passes its stdout; its answer is the last printed line), then a reasoner answers in
          `\\boxed{}`. Local rewards: 1/0 correctness of each agent's own answer. The episode ends
          when the two answers agree (or after max_turns); solved = the reasoner's last answer is
          right.
'drmas'   a solver answers in `\\boxed{}`, a verifier ends with `<verify>approve|reject</verify>`;
          at most `max_loops` solver/verifier loops, approval exits (a reply without a verdict
          tag approves, as in Dr. MAS's code), the verifier is skipped on the last loop. Each
          call's local reward is -format_penalty (0.1) when its format is invalid, else 0; the
          episode reward, 1/0 on the last solver answer, is the team reward
          (Dr. MAS: every call gets the episode reward minus its own penalty: use alpha = 1).
'marft'   a sequential chain of profiled agents (default reasoner -> actor): each sees its profile,
          the transcript so far and the earlier agents' outputs of this step; only the last
          agent's `\\boxed{}` answer is scored (1/0 to it); "The answer is incorrect." is appended
          after a wrong answer; at most max_steps steps, ending early when right.
'single'  one solver, one turn, 1/0 on its `\\boxed{}` answer (the single-agent baseline).
"""

from __future__ import annotations

import copy
import dataclasses
import fractions
import re
import zlib
from typing import Any

from marl_jax.envs.math import answers as math_answers
from marl_jax.envs.math import grading
from marl_jax.envs.math.data import format_number
from marl_jax.envs.actions import extract_code
from marl_jax.envs.base import Observation, StepResult, truncate

INCORRECT = "The answer is incorrect."
MAX_SHOWN = 3000
_APPROVE = re.compile(r"<verify>\s*approve\s*</verify>", re.IGNORECASE)
_REJECT = re.compile(r"<verify>\s*reject\s*</verify>", re.IGNORECASE)

TOOL_SYSTEM = (
    "You are the tool agent of a two-agent math team. Write one self-contained Python program in "
    "a ```python block that computes the answer exactly (use fractions or sympy where needed) and "
    "prints only the final answer on its last line.")
REASONER_SYSTEM = (
    "You are the reasoner of a two-agent math team. Solve the problem step by step; check the "
    "tool agent's program and output when given. Put your final answer in \\boxed{}.")
SOLVER_SYSTEM = "Solve the math problem step by step and put the final answer in \\boxed{}."
VERIFIER_SYSTEM = (
    "You verify a math solution. Check every step. End your reply with <verify>approve</verify> "
    "if the final answer is correct, or <verify>reject</verify> if it is not.")
PROFILES = {
    "reasoner": "You are the reasoner: analyse the problem and lay out a step-by-step solution "
                "plan with the key computations.",
    "actor": "You are the actor: using the reasoner's analysis, carry out the computation and put "
             "the final answer in \\boxed{}.",
    "teacher": "You are the teacher: explain how to solve the problem and point out pitfalls, "
               "without just stating the answer.",
    "student": "You are the student: using the teacher's guidance, solve the problem and put the "
               "final answer in \\boxed{}.",
    "solver": SOLVER_SYSTEM,
}


_MISTAKE_OFFSETS = (1, -1, 2, -2, 10, -10)


@dataclasses.dataclass(frozen=True)
class MathProblem:
  question: str
  answer: str
  solution: str = ""  # worked steps, when the source has them (generated problems do)
  check: str = ""  # an equation in x the answer satisfies (level "equation"), "" when none
  grader: str = "builtin"  # `grading.GRADERS`: how every answer of this problem is compared

  def correct(self, predicted: str | None) -> bool:
    return self.equivalent(predicted, self.answer)

  def equivalent(self, predicted: str | None, reference: str) -> bool:
    """Whether two answers agree under the problem's grader (`reference` in the gold role)."""
    return grading.equivalent(self.grader, predicted, reference)

  def verifies(self, candidate: str | None) -> bool:
    """Whether `candidate` passes the problem's check by substitution (`answers.satisfies`):
    what a team can verify without the answer."""
    if not self.check:
      raise ValueError(f"problem {self.question[:60]!r} has no check to verify answers with")
    return math_answers.satisfies(self.check, candidate)

  def pick(self, n: int) -> int:
    """A fixed choice of 0..n-1 for this problem (its question's CRC-32 mod n): how the
    warm-start's scripted replies vary over problems without depending on the answer."""
    return zlib.crc32(self.question.encode()) % n

  def demonstration(self) -> str:
    """A correct solver reply: the worked steps, then the answer in `\\boxed{}`."""
    return f"{self.solution}\nThe answer is \\boxed{{{self.answer}}}.".lstrip()

  def program(self) -> str | None:
    """A program that computes the answer from the problem's numbers: the worked solution's
    first expression (the text before its first ` = `), printed; with a division, every whole
    number becomes a `Fraction` so the result prints exactly (`75/2`, not `37.5`). None when
    the problem has no worked solution (file problems without one)."""
    expression = self.solution.split(" = ")[0].strip()
    if not expression:
      return None
    if "/" in expression:
      expression = re.sub(r"\d+", lambda m: f"Fraction({m.group()})", expression)
      return f"```python\nfrom fractions import Fraction\nprint({expression})\n```"
    return f"```python\nprint({expression})\n```"

  def mistake(self) -> str | None:
    """A wrong solver reply shaped like `demonstration`: the worked steps with a wrong final
    result, so only checking the arithmetic tells it apart (the warm-start's negative example,
    `training/sft.py`). The wrong value is the answer plus an offset picked by the question's
    CRC-32 from +-1, +-2, +-10; the steps are shown when they end in the answer. None when the
    answer is not a number."""
    try:
      value = fractions.Fraction(self.answer)
    except (ValueError, ZeroDivisionError):
      return None
    wrong = format_number(value + _MISTAKE_OFFSETS[self.pick(len(_MISTAKE_OFFSETS))])
    steps = self.solution[:-len(self.answer)] + wrong if self.solution.endswith(self.answer) else ""
    return f"{steps}\nThe answer is \\boxed{{{wrong}}}.".lstrip()


def verdict(response: str) -> str | None:
  """The verifier's verdict read as Dr. MAS's code reads it: 'approve' when an approve tag occurs
  anywhere, else 'reject' when a reject tag does, else None (no verdict: a format error).

  Tags match with any case and inner whitespace (Dr. MAS's code only strips the first tag's)."""
  response = response or ""
  if _APPROVE.search(response):
    return "approve"
  return "reject" if _REJECT.search(response) else None


def approves(response: str) -> bool:
  """Loop exit of the Dr. MAS math workflow: anything but a reject, so a reply without a verdict
  tag ends the loop (Dr. MAS's code approves it; the env still charges the format penalty)."""
  return verdict(response) != "reject"


class MathEnv:
  """Shared plumbing: problem, turn counter, agent checks, cheap clones (immutable fields)."""

  agents: tuple[str, ...] = ()

  def __init__(self, problem: MathProblem, max_turns: int):
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    self.problem = problem
    self.max_turns = max_turns
    self.turn = 0
    self.finished = False
    self.final_correct = False

  @property
  def done(self) -> bool:
    return self.finished or self.turn >= self.max_turns

  @property
  def solved(self) -> bool:
    return self.final_correct

  @property
  def grader(self) -> str:
    """The answer grader this env's rewards use (evaluation reports it)."""
    return self.problem.grader

  def clone(self) -> Any:
    return copy.copy(self)

  def _check_agent(self, agent: str) -> None:
    if agent not in self.agents:
      raise ValueError(f"unknown agent {agent!r}; expected one of {self.agents}")

  def _begin(self, agent: str) -> None:
    self._check_agent(agent)
    if self.done:
      raise ValueError(f"step({agent!r}) on a finished episode (turn {self.turn})")

  def _task(self) -> str:
    return f"Problem: {self.problem.question}\nTurn {self.turn + 1} of {self.max_turns}."


class ATGRPOMathEnv(MathEnv):
  agents = ("tool", "reasoner")

  def __init__(self, problem: MathProblem, max_turns: int = 4):
    super().__init__(problem, max_turns)
    self.tool_code = ""
    self.tool_output = ""
    self.tool_answer: str | None = None
    self.last_reasoning = ""
    self.reasoner_answer: str | None = None

  def observe(self, agent: str) -> Observation:
    self._check_agent(agent)
    task = self._task()
    if self.turn > 0:
      task += (f"\nLast turn the program answered {self.tool_answer!r} and the reasoner answered "
               f"{self.reasoner_answer!r}; the two disagree. Decide which is wrong and solve "
               "again.")
    if agent == "tool":
      return Observation(agent, self.turn, TOOL_SYSTEM, task)
    return Observation(agent, self.turn, REASONER_SYSTEM,
                       f"{task}\nTool agent's program:\n```python\n"
                       f"{truncate(self.tool_code, MAX_SHOWN)}\n```\nIts output:\n"
                       f"{truncate(self.tool_output, 1000)}\nParsed answer: {self.tool_answer}")

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    self._begin(agent)
    if agent == "tool":
      if not isinstance(tool_output, str):
        raise ValueError("the tool agent's step needs its program's stdout as tool_output (str); "
                         f"got {type(tool_output).__name__}")
      self.tool_code = extract_code(response) or ""
      self.tool_output = tool_output
      self.tool_answer = math_answers.program_answer(tool_output) if self.tool_code else None
      correct = self.problem.correct(self.tool_answer)
      return StepResult(agent, None, {"tool": float(correct)}, False,
                        {"answer": self.tool_answer, "correct": correct})
    self.last_reasoning = response
    self.reasoner_answer = math_answers.last_boxed(response)
    self.final_correct = self.problem.correct(self.reasoner_answer)
    agree = (self.tool_answer is not None
             and self.problem.equivalent(self.reasoner_answer, self.tool_answer))
    self.finished = agree
    self.turn += 1
    return StepResult(agent, None, {"reasoner": float(self.final_correct)}, self.done,
                      {"answer": self.reasoner_answer, "correct": self.final_correct,
                       "agree": agree, "solved": self.solved,
                       "format_error": self.reasoner_answer is None})


class DrMASMathEnv(MathEnv):
  agents = ("solver", "verifier")

  def __init__(self, problem: MathProblem, max_loops: int = 2, format_penalty: float = 0.1):
    super().__init__(problem, max_loops)
    self.format_penalty = format_penalty
    self.solution = ""
    self.answer: str | None = None
    self.rejected: tuple[str, ...] = ()  # verifier replies of earlier loops

  def observe(self, agent: str) -> Observation:
    self._check_agent(agent)
    task = self._task()
    if agent == "solver":
      if self.rejected:
        task += (f"\nYour previous solution:\n{truncate(self.solution, MAX_SHOWN)}\nA verifier "
                 f"rejected it:\n{truncate(self.rejected[-1], 1500)}\nSolve the problem again.")
      return Observation(agent, self.turn, SOLVER_SYSTEM, task)
    return Observation(agent, self.turn, VERIFIER_SYSTEM,
                       f"{task}\nProposed solution:\n{truncate(self.solution, MAX_SHOWN)}")

  def demonstration(self, agent: str) -> str | None:
    """A correct reply of `agent` now (the supervised warm-start's target, `training/sft.py`):
    the solver the problem's worked solution; the verifier checks by recomputing: it restates
    the proposed answer, works the problem itself (the worked steps, or the answer where the
    source has none) and gives the true verdict. A bare verdict would teach a 135M verifier the
    approval rate, not a check: recomputing and comparing two numbers in its own context is a
    check it can learn, and a rejection that shows the recomputed value is feedback the solver's
    next round can use."""
    self._check_agent(agent)
    if agent == "solver":
      return self.problem.demonstration()
    return (f"Proposed answer: {self.answer}. Checking: "
            f"{self.problem.solution or 'the answer is ' + self.problem.answer}.\n"
            f"<verify>{'approve' if self.final_correct else 'reject'}</verify>")

  def mistake(self, agent: str) -> str | None:
    """A wrong reply of `agent` now, for demonstrations that start with a mistake and recover
    (`training/sft.py`): the solver's `MathProblem.mistake`; the other agents have none."""
    self._check_agent(agent)
    return self.problem.mistake() if agent == "solver" else None

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    del tool_output
    self._begin(agent)
    if agent == "solver":
      self.solution = response
      self.answer = math_answers.last_boxed(response)
      self.final_correct = self.problem.correct(self.answer)
      invalid = self.answer is None
      if self.turn == self.max_turns - 1:  # the verifier is skipped on the last loop
        self.finished = True
      return StepResult(agent, None, {"solver": -self.format_penalty if invalid else 0.0},
                        self.done, {"answer": self.answer, "format_error": invalid,
                                    "correct": self.final_correct, "solved": self.solved})
    decision = verdict(response)
    invalid = decision is None
    if decision != "reject":  # as `approves`: no verdict ends the loop too
      self.finished = True
    else:
      self.rejected += (response,)
    self.turn += 1
    return StepResult(agent, None, {"verifier": -self.format_penalty if invalid else 0.0},
                      self.done, {"verdict": decision, "format_error": invalid,
                                  "solved": self.solved})


class MARFTMathEnv(MathEnv):
  """Sequential profiled chain; `agents` is the role order (each role needs a PROFILES entry)."""

  def __init__(self, problem: MathProblem, roles: tuple[str, ...] = ("reasoner", "actor"),
               max_steps: int = 3):
    super().__init__(problem, max_steps)
    unknown = [r for r in roles if r not in PROFILES]
    if not roles or unknown or len(set(roles)) != len(roles):
      raise ValueError(f"roles must be distinct names from {sorted(PROFILES)}; got {roles}")
    self.agents = tuple(roles)
    self.transcript: tuple[str, ...] = ()  # earlier steps, with feedback lines
    self.current: tuple[tuple[str, str], ...] = ()  # (role, output) of this step so far

  def observe(self, agent: str) -> Observation:
    self._check_agent(agent)
    lines = [self._task()]
    if self.transcript:
      lines.append("Previous attempts:\n" + truncate("\n".join(self.transcript), MAX_SHOWN))
    for role, text in self.current:
      lines.append(f"Output of the {role}:\n{truncate(text, MAX_SHOWN)}")
    return Observation(agent, self.turn, PROFILES[agent], "\n".join(lines))

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    del tool_output
    self._begin(agent)
    self.current += ((agent, response),)
    if agent != self.agents[-1]:
      return StepResult(agent, None, {agent: 0.0}, False, {})
    answer = math_answers.last_boxed(response)
    self.final_correct = self.problem.correct(answer)
    step_text = "\n".join(f"[{role}] {text}" for role, text in self.current)
    self.transcript += (step_text if self.final_correct else f"{step_text}\n{INCORRECT}",)
    self.current = ()
    self.finished = self.final_correct
    self.turn += 1
    return StepResult(agent, None, {agent: float(self.final_correct)}, self.done,
                      {"answer": answer, "correct": self.final_correct, "solved": self.solved,
                       "format_error": answer is None})


class SingleMathEnv(MathEnv):
  agents = ("solver",)

  def __init__(self, problem: MathProblem):
    super().__init__(problem, 1)

  def observe(self, agent: str) -> Observation:
    self._check_agent(agent)
    return Observation(agent, self.turn, SOLVER_SYSTEM, f"Problem: {self.problem.question}")

  def demonstration(self, agent: str) -> str | None:
    """The problem's worked solution (the supervised warm-start's target)."""
    self._check_agent(agent)
    return self.problem.demonstration()

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    del tool_output
    self._begin(agent)
    answer = math_answers.last_boxed(response)
    self.final_correct = self.problem.correct(answer)
    self.turn = 1
    return StepResult(agent, None, {agent: float(self.final_correct)}, True,
                      {"answer": answer, "solved": self.solved, "format_error": answer is None})
