"""Learned stopping (orchestration decision O5, docs/papers.md section 5) on the Dr. MAS math loop,
and the fixed exits a learned stopper is compared with on its own checkpoint.

The teams reuse `env.py`'s problem, answer checking and solver/verifier loop; rewards are
additive agent-keyed contributions (envs/base.py), the coordinator's orchestration reward
settled at the end by `final_rewards`. Workflows:

'learned_stop'  the Dr. MAS loop with its stop rule made a learned decision (orchestration O5,
          docs/papers.md section 5): each round a solver answers, a verifier reviews, then a
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
"""

from __future__ import annotations

import hashlib
import re

from marl_jax.envs.actions import extract_code
from marl_jax.envs.base import Observation, StepResult, truncate
from marl_jax.envs.math import answers as math_answers
from marl_jax.envs.math.env import (MAX_SHOWN, SOLVER_SYSTEM, DrMASMathEnv, MathProblem,
                                    verdict)

_DECISION = re.compile(r"####\s*(stop|continue)\b", re.IGNORECASE)

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

def decision(response: str) -> str | None:
  """The coordinator's decision: 'stop' or 'continue' from its last `#### stop|continue`, None
  when it names none."""
  found = _DECISION.findall((response or "")[-2000:])
  return found[-1].lower() if found else None


def stops(response: str) -> bool:
  """Loop exit of the 'learned_stop' workflow: anything but `#### continue` stops."""
  return decision(response) != "continue"


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
                         f"{truncate(self.solution, MAX_SHOWN)}\nA {self.reviewer} reviewed it:\n"
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
