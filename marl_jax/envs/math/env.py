"""Math environments of AT-GRPO, Dr. MAS and MARFT (PAPERS.md sections 1, 2, 4), one problem each.

All share a problem {"question", "answer"} and its grader (`grading.py`: the project's checker
or math-verify, chosen per config as the paper's code grades); rewards are additive
agent-keyed contributions (envs/base.py); the team reward the engine attaches when an episode ends
is `solved` (1/0), which the estimators mix in as `alpha * team + local`.

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
'learned_stop'  the Dr. MAS loop with its stop rule made a learned decision (orchestration O5,
          PAPERS.md section 5): each round a solver answers, a verifier reviews, then a
          coordinator replies `#### stop` (end with this answer) or `#### continue` (another
          round); `max_loops` stays as a safety cap (the last round is the solver's alone, as in
          'drmas'). A reply without a decision stops, with the format penalty. The coordinator's
          decisions are judged by the episode they led to: `final_rewards` gives it
          -round_cost x rounds (minus `premature_penalty` when it stopped on a wrong answer
          with rounds left), credited to each of its decisions, beside the team reward.
          With round_cost 0 and a coordinator that stops exactly when the verifier approves,
          every reward equals the 'drmas' episode's.
'stop_by_verifier', 'stop_at_cap'  the same team and rewards with the exit fixed, the baselines a
          learned stopper is compared with on its own checkpoint (any layout: the team is the
          same three agents): the loop ends when the verifier approves (the Dr. MAS rule), or
          runs to the cap (fixed rounds). The coordinator still replies after each review it is
          shown, but its reply is not read: the decision is always `continue`.
'learned_stop_checked'  'learned_stop' with a program check in place of the verifier: a
          checker writes a Python program for the problem (it runs in the sandbox), the
          coordinator reads whether the proposed answer matches what the program printed and
          decides `#### stop` or `#### continue`. Rewards as 'learned_stop' (the checker's local
          reward: the format penalty when its program prints no answer). Its warm-start
          demonstrates no stop rule: the coordinator's demonstrated decision is picked by a
          hash of the question and the round, so RL, not the warm-start, learns when to stop.
'stop_by_check', 'stop_at_cap_checked'  that team with the exit fixed: stop when the answer
          matches the program's output, or run to the cap; the coordinator's reply is not read.
'spawn'   learned spawning and aggregation (orchestration O1/O4): a dispatcher replies `#### N`
          to spawn N of `MAX_WORKERS` (4) solvers, each answers on its own in `\\boxed{}`, then an
          aggregator sees their answers and gives the team's final `\\boxed{}` answer (solved).
          A dispatcher reply without a number spawns 1, with the format penalty. Rewards, each
          configurable (0 = off): the format penalty of each call; `final_rewards` gives the
          dispatcher -spawn_cost x N (compute) - latency_cost x the longest worker reply in
          thousands of characters (wall-clock: the workers run side by side, so the stage lasts
          as long as its slowest); the aggregator gets +aggregation_bonus when some worker was
          right and its aggregate kept the right answer. The trace's aggregate event records
          that (aggregation quality) and the parallelism speedup, the workers' total reply
          length over the longest.
'delegate'  'spawn' with whom to delegate to (O2): the workers are four specialists with their
          own prompts (SPECIALISTS: stepwise, concise, checker, casework) and the dispatcher
          names the ones it wants, `#### stepwise, checker`; a reply naming none (or an unknown
          name) delegates to 'stepwise', with the format penalty. Rewards as 'spawn'.
'spawn_vote', 'delegate_vote'  those teams with the aggregation fixed, the baseline a learned
          aggregator is compared with on its own checkpoint: the team's answer is the workers'
          plurality answer (`plurality`: answers compared with the problem's grader; a tie goes
          to the answer given first). The aggregator still replies to what it is shown, but its reply is
          not read (no format penalty; `aggregation_bonus` is refused).
'spawn_checked'  'spawn' with the aggregation fixed to a verified pick, for problems that carry a
          check (level 'equation': an equation in x the answer satisfies): the team's answer is
          the first worker answer that passes it by substitution (`MathProblem.verifies`), else
          the plurality; so more solvers buy accuracy as best-of-N with a verifier does, and the
          dispatcher's count trades it against `spawn_cost`. The aggregator is unread, as above.
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
import hashlib
import re
import zlib
from collections.abc import Callable
from typing import Any

from marl_jax.envs.math import answers as math_answers
from marl_jax.envs.math import grading
from marl_jax.envs.math.data import format_number
from marl_jax.envs.actions import extract_code
from marl_jax.envs.base import Observation, StepResult, truncate

INCORRECT = "The answer is incorrect."
_MAX_SHOWN = 3000
_APPROVE = re.compile(r"<verify>\s*approve\s*</verify>", re.IGNORECASE)
_REJECT = re.compile(r"<verify>\s*reject\s*</verify>", re.IGNORECASE)
_DECISION = re.compile(r"####\s*(stop|continue)\b", re.IGNORECASE)
_SPAWN = re.compile(r"####\s*(\d+)\b")
_DELEGATE = re.compile(r"####([^#\n]*)")
MAX_WORKERS = 4

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
COORDINATOR_SYSTEM = (
    "You coordinate a math team: a solver proposed an answer and a verifier reviewed it. Decide "
    "whether to stop with this answer or let them try another round; every round costs time. "
    "End your reply with `#### stop` or `#### continue`.")
CHECKER_SYSTEM = (
    "You check math answers with a program. Write one self-contained Python program in a "
    "```python block that computes the answer to the problem from its numbers and prints only "
    "the result.")
CHECKED_COORDINATOR_SYSTEM = (
    "You coordinate a math team: a solver proposed an answer and a checker computed the answer "
    "with a program. Decide whether to stop with this answer or let the solver try another "
    "round; every round costs time. First copy the check result line, then end your reply with "
    "`#### stop` or `#### continue`.")
DISPATCHER_SYSTEM = (
    "You dispatch a math problem to parallel solvers. More solvers give the aggregator more "
    "answers to compare but cost more. End your reply with `#### N`, the number of solvers "
    f"(1 to {MAX_WORKERS}).")
# name -> (what the dispatcher reads about it, its own system prompt); the first is the fallback.
SPECIALISTS = {
    "stepwise": ("writes out every step",
                 "You are a careful solver: write out every step of the computation and put the "
                 "final answer in \\boxed{}."),
    "concise": ("shows only the key computation; short and fast",
                "You are a concise solver: take the shortest route to the answer, show only the "
                "key computation and put the final answer in \\boxed{}."),
    "checker": ("solves, then checks the result a second way",
                "You are a checking solver: solve the problem, then check the result by "
                "substituting it back or computing it a second way, and put the final answer in "
                "\\boxed{}."),
    "casework": ("splits the problem into cases or parts",
                 "You are a systematic solver: split the problem into cases or small parts, solve "
                 "each, combine them and put the final answer in \\boxed{}."),
}
DELEGATOR_SYSTEM = (
    "You delegate a math problem to specialist solvers who work in parallel; each one you pick "
    "costs. The specialists: " + "; ".join(f"{name} ({about})" for name, (about, _) in
                                           SPECIALISTS.items()) +
    ". Pick the ones this problem needs. End your reply with `#### ` and their names, "
    "comma-separated, for example `#### stepwise, checker`.")
AGGREGATOR_SYSTEM = (
    "Several solvers answered a math problem independently. Compare their answers, decide which "
    "is right and put the team's final answer in \\boxed{}.")
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


def decision(response: str) -> str | None:
  """The coordinator's decision: 'stop' or 'continue' from its last `#### stop|continue`, None
  when it names none."""
  found = _DECISION.findall((response or "")[-2000:])
  return found[-1].lower() if found else None


def stops(response: str) -> bool:
  """Loop exit of the 'learned_stop' workflow: anything but `#### continue` stops."""
  return decision(response) != "continue"


def spawn_count(response: str, max_workers: int = MAX_WORKERS) -> int | None:
  """The dispatcher's `#### N` (the last one), None when absent or outside 1..max_workers."""
  found = _SPAWN.findall((response or "")[-2000:])
  n = int(found[-1]) if found else None
  return n if n is not None and 1 <= n <= max_workers else None


def spawns(response: str) -> tuple[str, ...]:
  """Workers the 'spawn' workflow runs: the first N, N the dispatcher's (1 without a valid one)."""
  return SpawnMathEnv.agents[1:1 + (spawn_count(response) or 1)]


def delegated(response: str) -> tuple[str, ...] | None:
  """The specialists the dispatcher's last `#### name, name` names (in SPECIALISTS order), None
  when it names none or a name that is not a specialist."""
  found = _DELEGATE.findall((response or "")[-2000:])
  names = re.split(r"[\s,]+|\band\b", found[-1].strip().lower()) if found else []
  names = [n for n in names if n]
  if not names or any(n not in SPECIALISTS for n in names):
    return None
  return tuple(n for n in SPECIALISTS if n in names)


def delegates(response: str) -> tuple[str, ...]:
  """Workers the 'delegate' workflow runs: the named specialists, or the first without a valid
  reply."""
  return delegated(response) or tuple(SPECIALISTS)[:1]


def plurality(answers: list[str | None],
              same: Callable[[str, str], bool] = math_answers.is_equiv) -> str | None:
  """The most common answer (answers equal under `same`, the problem's grader, count
  together), the one given first on a tie; None when no answer was given."""
  votes: list[list] = []  # [first answer of an equivalence class, count], in order of appearance
  for answer in answers:
    if answer is None:
      continue
    seen = next((v for v in votes if same(answer, v[0])), None)
    if seen is None:
      votes.append([answer, 1])
    else:
      seen[1] += 1
  return max(votes, key=lambda v: v[1])[0] if votes else None  # max keeps the first on a tie


def approves(response: str) -> bool:
  """Loop exit of the Dr. MAS math workflow: anything but a reject, so a reply without a verdict
  tag ends the loop (Dr. MAS's code approves it; the env still charges the format penalty)."""
  return verdict(response) != "reject"


class _MathEnv:
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


class ATGRPOMathEnv(_MathEnv):
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
                       f"{truncate(self.tool_code, _MAX_SHOWN)}\n```\nIts output:\n"
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


class DrMASMathEnv(_MathEnv):
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
        task += (f"\nYour previous solution:\n{truncate(self.solution, _MAX_SHOWN)}\nA verifier "
                 f"rejected it:\n{truncate(self.rejected[-1], 1500)}\nSolve the problem again.")
      return Observation(agent, self.turn, SOLVER_SYSTEM, task)
    return Observation(agent, self.turn, VERIFIER_SYSTEM,
                       f"{task}\nProposed solution:\n{truncate(self.solution, _MAX_SHOWN)}")

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


class LearnedStopMathEnv(DrMASMathEnv):
  """The 'learned_stop' workflow (module doc): the Dr. MAS loop plus a coordinator that decides,
  after the verifier, whether another round is worth its cost."""

  agents = ("solver", "verifier", "coordinator")
  reviewer = "verifier"  # who reviewed the solution, as the solver's next prompt names it

  def __init__(self, problem: MathProblem, max_loops: int = 3, format_penalty: float = 0.1,
               round_cost: float = 0.0, premature_penalty: float = 0.0,
               learned: bool = True):
    super().__init__(problem, max_loops, format_penalty)
    self.learned = learned  # False: the coordinator's reply is not read (a fixed-exit workflow)
    if round_cost < 0 or premature_penalty < 0:
      raise ValueError(f"round_cost and premature_penalty must be >= 0; got {round_cost}, "
                       f"{premature_penalty}")
    self.round_cost = round_cost
    self.premature_penalty = premature_penalty
    self.review = ""  # the verifier's reply of this round
    self.rounds = 0  # solver replies so far
    self.premature = False

  def observe(self, agent: str) -> Observation:
    if agent == "solver" and self.rejected:
      return Observation(agent, self.turn, SOLVER_SYSTEM,
                         f"{self._task()}\nYour previous solution:\n"
                         f"{truncate(self.solution, _MAX_SHOWN)}\nA {self.reviewer} reviewed it:\n"
                         f"{truncate(self.rejected[-1], 1500)}\nThe coordinator asked for "
                         "another round. Solve the problem again.")
    if agent != "coordinator":
      return super().observe(agent)
    left = self.max_turns - self.turn - 1
    return Observation(agent, self.turn, COORDINATOR_SYSTEM,
                       f"{self._task()}\nProposed solution:\n{truncate(self.solution, 1500)}\n"
                       f"Its answer: {self.answer}\nVerifier's review:\n"
                       f"{truncate(self.review, 1500)}\nRounds left after this one: {left}.")

  def demonstration(self, agent: str) -> str | None:
    """As 'drmas' (solver, verifier); the coordinator stops exactly when the answer is right."""
    if agent == "coordinator":
      return f"#### {'stop' if self.final_correct else 'continue'}"
    return super().demonstration(agent)

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    if agent == "solver":
      self.rounds += 1
      return super().step(agent, response, tool_output=tool_output)
    if agent == "verifier":
      self._begin(agent)
      review = verdict(response)
      self.review = response
      invalid = review is None
      return StepResult(agent, None, {"verifier": -self.format_penalty if invalid else 0.0},
                        False, {"verdict": review, "format_error": invalid})
    self._begin(agent)
    chosen = decision(response) if self.learned else self._fixed_decision()
    invalid = chosen is None
    if chosen == "continue":
      self.rejected += (self.review,)
    else:
      self.finished = True
      self.premature = not self.final_correct  # a round was left: the cap ends at the solver
    self.turn += 1
    return StepResult(agent, None, {"coordinator": -self.format_penalty if invalid else 0.0},
                      self.done, {"decision": chosen or "stop", "format_error": invalid,
                                  "correct": self.final_correct, "round": self.rounds,
                                  "solved": self.solved})

  def final_rewards(self) -> dict[str, float]:
    """The coordinator's orchestration reward, settled at the end (envs/base.py)."""
    return {"coordinator": 0.0 - self.round_cost * self.rounds
            - self.premature_penalty * float(self.premature)}

  def _fixed_decision(self) -> str:
    """The decision of a fixed-exit workflow: 'continue' (the verifier rule exits through the
    workflow, on the verifier's approval; the cap never stops early)."""
    return "continue"


class CheckedStopMathEnv(LearnedStopMathEnv):
  """The 'learned_stop_checked' workflow and its fixed exits (module doc): the learned-stop
  loop with a checker whose program, run in the sandbox, gives the coordinator a review it can
  trust more than a 135M verifier's (RESULTS.md: that verifier barely tells right from wrong).
  `exit`: 'learned' (the coordinator decides), 'check' (stop when the answer matches the
  program's output) or 'cap' (always continue)."""

  agents = ("solver", "checker", "coordinator")
  reviewer = "checker"
  EXITS = ("learned", "check", "cap")

  def __init__(self, problem: MathProblem, max_loops: int = 3, format_penalty: float = 0.1,
               round_cost: float = 0.0, premature_penalty: float = 0.0, exit: str = "learned"):
    if exit not in self.EXITS:
      raise ValueError(f"unknown exit {exit!r}; expected one of {self.EXITS}")
    super().__init__(problem, max_loops, format_penalty, round_cost, premature_penalty,
                     learned=exit == "learned")
    self.exit = exit
    self.check: str | None = None  # what the checker's program printed this round
    self.match = False  # the proposed answer equals it

  def observe(self, agent: str) -> Observation:
    self._check_agent(agent)
    task = self._task()
    if agent == "checker":
      return Observation(agent, self.turn, CHECKER_SYSTEM, task)
    if agent == "solver":  # as 'learned_stop', naming the checker
      return super().observe(agent)
    left = self.max_turns - self.turn - 1
    return Observation(agent, self.turn, CHECKED_COORDINATOR_SYSTEM,
                       f"{task}\nProposed solution:\n{truncate(self.solution, 1500)}\n"
                       f"Checker's review:\n{self.review}\nRounds left after this one: {left}.\n"
                       f"{self._check_result()}", state=int(self.match))

  def _check_result(self) -> str:
    """The coordinator prompt's last line, which its reply copies before deciding."""
    return f"Check result: {'match' if self.match else 'mismatch'}."

  def demonstration(self, agent: str) -> str | None:
    """The solver's worked solution; the checker's program (`MathProblem.program`); the
    coordinator's reply: the check result line copied, then a decision picked by a hash of the
    question and the round, independent of the answer, so the warm-start teaches the reply's
    format and leaves the rule to RL. (The warm-start keeps only solved episodes, so after a
    wrong answer it keeps only `continue`.)

    Why the copy: the decision token is then read right after the check's outcome, in the
    coordinator's own words. A 135M coordinator that had the outcome only in its prompt barely
    told the two states apart after the warm-start (it stopped after about half the matches and
    half the mismatches), and RL moved its decision the same way in both (RESULTS.md)."""
    self._check_agent(agent)
    if agent == "checker":
      return self.problem.program()
    if agent == "coordinator":  # SHA-256, not CRC-32: CRC is affine, so its bits for round 1
      # and round 2 of one question would differ by a constant and one would fix the other
      pick = hashlib.sha256(f"{self.problem.question}|{self.rounds}".encode()).digest()[0] % 2
      return f"{self._check_result()}\n#### {('stop', 'continue')[pick]}"
    return super().demonstration(agent)

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    if agent != "checker":
      return super().step(agent, response, tool_output=tool_output)
    self._begin(agent)
    if not isinstance(tool_output, str):
      raise ValueError("the checker's step needs its program's stdout as tool_output (str); "
                       f"got {type(tool_output).__name__}")
    code = extract_code(response) or ""
    self.check = math_answers.program_answer(tool_output) if code else None
    self.match = self.check is not None and self.problem.equivalent(self.answer, self.check)
    self.review = (f"```python\n{truncate(code.strip(), 1000)}\n```\nThe program printed: "
                   f"{truncate(str(self.check), 200)}. The proposed answer {self.answer} "
                   f"{'matches' if self.match else 'does not match'} it.")
    invalid = self.check is None
    return StepResult(agent, None, {"checker": -self.format_penalty if invalid else 0.0}, False,
                      {"check": self.check, "match": self.match, "format_error": invalid})

  def _fixed_decision(self) -> str:
    return "stop" if self.exit == "check" and self.match else "continue"


class SpawnMathEnv(_MathEnv):
  """The 'spawn' workflow (module doc): dispatcher -> N parallel solvers -> aggregator, one turn."""

  agents = ("dispatcher", *(f"worker_{i}" for i in range(1, MAX_WORKERS + 1)), "aggregator")
  dispatcher_system = DISPATCHER_SYSTEM

  PICKS = ("learned", "vote", "check")

  def __init__(self, problem: MathProblem, format_penalty: float = 0.1, spawn_cost: float = 0.0,
               latency_cost: float = 0.0, aggregation_bonus: float = 0.0, pick: str = "learned"):
    super().__init__(problem, 1)
    costs = dict(spawn_cost=spawn_cost, latency_cost=latency_cost,
                 aggregation_bonus=aggregation_bonus)
    if any(v < 0 for v in costs.values()):
      raise ValueError(f"spawn_cost, latency_cost and aggregation_bonus must be >= 0; got {costs}")
    if pick not in self.PICKS:
      raise ValueError(f"unknown pick {pick!r}; expected one of {self.PICKS}")
    if pick != "learned" and aggregation_bonus:
      raise ValueError(f"aggregation_bonus={aggregation_bonus} rewards the aggregator's choice; "
                       f"with the fixed pick {pick!r} it chooses nothing")
    if pick == "check":
      problem.verifies(None)  # refuses a problem without a check, or a malformed one
    # How the team's answer is picked: 'learned' the aggregator's reply; 'vote' the workers'
    # plurality and 'check' the first worker answer that passes the problem's check (else the
    # plurality), the aggregator's reply unread.
    self.pick = pick
    self.format_penalty = format_penalty
    self.spawn_cost, self.latency_cost = spawn_cost, latency_cost
    self.aggregation_bonus = aggregation_bonus
    self.spawned: tuple[str, ...] = ()
    self.solutions: dict[str, str] = {}
    self.answers: dict[str, str | None] = {}

  def choose(self, response: str) -> tuple[str, ...] | None:
    """The workers the dispatcher's reply picks, None when it picks none validly."""
    n = spawn_count(response)
    return None if n is None else self.agents[1:1 + n]

  def worker_system(self, agent: str) -> str:
    del agent
    return SOLVER_SYSTEM

  def demonstration(self, agent: str) -> str | None:
    """A valid reply of `agent` now (the supervised warm-start's target, `training/sft.py`): the
    workers and the aggregator the worked solution; the dispatcher a decision picked by the
    question's CRC-32, uniform over the choices, so the warm-start teaches the protocol and
    leaves the choice to RL (no decision is the right one before its cost is known)."""
    self._check_agent(agent)
    if agent != "dispatcher":
      return self.problem.demonstration()
    return f"#### {self.demonstrated_choice()}"

  def demonstrated_choice(self) -> str:
    """The dispatcher's demonstrated decision: N of 1..MAX_WORKERS."""
    return str(1 + self.problem.pick(MAX_WORKERS))

  def observe(self, agent: str) -> Observation:
    self._check_agent(agent)
    task = f"Problem: {self.problem.question}"
    if agent == "dispatcher":
      return Observation(agent, self.turn, self.dispatcher_system, task)
    if agent != "aggregator":
      return Observation(agent, self.turn, self.worker_system(agent), task)
    shown = "\n".join(f"Solver {i} (answer {self.answers.get(w)}):\n"
                      f"{truncate(self.solutions.get(w, ''), 1000)}"
                      for i, w in enumerate(self.spawned, start=1))
    return Observation(agent, self.turn, AGGREGATOR_SYSTEM, f"{task}\n{shown}")

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    del tool_output
    self._begin(agent)
    if agent == "dispatcher":
      chosen = self.choose(response)
      invalid = chosen is None
      self.spawned = chosen or self.agents[1:2]
      return StepResult(agent, None, {agent: -self.format_penalty if invalid else 0.0}, False,
                        {"decision": self.decision(), "spawn": list(self.spawned),
                         "format_error": invalid})
    if agent != "aggregator":
      if agent not in self.spawned:
        raise ValueError(f"{agent!r} was not spawned (spawned: {list(self.spawned)})")
      self.solutions[agent] = response
      self.answers[agent] = math_answers.last_boxed(response)
      invalid = self.answers[agent] is None
      return StepResult(agent, None, {agent: -self.format_penalty if invalid else 0.0}, False,
                        {"answer": self.answers[agent], "format_error": invalid,
                         "correct": self.problem.correct(self.answers[agent])})
    if self.pick != "learned":
      answers = [self.answers.get(w) for w in self.spawned]
      passing = [a for a in answers if self.problem.verifies(a)] if self.pick == "check" else []
      answer = passing[0] if passing else plurality(answers, self.problem.equivalent)
      invalid = False
    else:
      answer = math_answers.last_boxed(response)
      invalid = answer is None
    self.final_correct = self.problem.correct(answer)
    any_correct = any(self.problem.correct(a) for a in self.answers.values())
    kept = any_correct and self.final_correct
    self.finished = True
    self.turn = 1
    lengths = [len(self.solutions.get(w, "")) for w in self.spawned]
    speedup = sum(lengths) / max(lengths) if max(lengths) else 1.0
    reward = (-self.format_penalty if invalid else 0.0) + self.aggregation_bonus * kept
    return StepResult(agent, None, {agent: reward}, True,
                      {"answer": answer, "format_error": invalid,
                       "aggregate": list(self.spawned), "correct": self.final_correct,
                       "any_worker_correct": any_correct, "speedup": speedup,
                       "solved": self.solved})

  def decision(self) -> str:
    return f"spawn {len(self.spawned)}"

  def final_rewards(self) -> dict[str, float]:
    """The dispatcher's orchestration reward, settled at the end (envs/base.py): compute (per
    worker) and wall-clock (the longest worker reply, in thousands of characters) costs."""
    longest = max(len(self.solutions.get(w, "")) for w in self.spawned)
    return {"dispatcher": 0.0 - self.spawn_cost * len(self.spawned)
            - self.latency_cost * longest / 1000}


class DelegateMathEnv(SpawnMathEnv):
  """The 'delegate' workflow (module doc): the dispatcher names which specialists solve."""

  agents = ("dispatcher", *SPECIALISTS, "aggregator")
  dispatcher_system = DELEGATOR_SYSTEM

  def choose(self, response: str) -> tuple[str, ...] | None:
    return delegated(response)

  def worker_system(self, agent: str) -> str:
    return SPECIALISTS[agent][1]

  def demonstrated_choice(self) -> str:
    """One of the 2^4 - 1 non-empty sets of specialists, by the question's CRC-32."""
    mask = 1 + self.problem.pick(2 ** len(SPECIALISTS) - 1)
    return ", ".join(name for i, name in enumerate(SPECIALISTS) if mask >> i & 1)

  def decision(self) -> str:
    return "delegate " + ",".join(self.spawned)


class MARFTMathEnv(_MathEnv):
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
      lines.append("Previous attempts:\n" + truncate("\n".join(self.transcript), _MAX_SHOWN))
    for role, text in self.current:
      lines.append(f"Output of the {role}:\n{truncate(text, _MAX_SHOWN)}")
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


class SingleMathEnv(_MathEnv):
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
