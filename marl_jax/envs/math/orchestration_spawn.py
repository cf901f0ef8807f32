"""Learned spawning, delegation and aggregation (orchestration decisions O1, O2, O4, docs/papers.md
section 5) of math solvers, and the fixed aggregation rules a learned aggregator is compared
with on its own checkpoint.

The teams reuse `env.py`'s problem and answer checking; rewards are additive agent-keyed
contributions (envs/base.py), the dispatcher's orchestration reward settled at the end by
`final_rewards`. Workflows:

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
"""

from __future__ import annotations

import re
from collections.abc import Callable

from marl_jax.envs.base import Observation, StepResult, truncate
from marl_jax.envs.math import answers as math_answers
from marl_jax.envs.math.env import SOLVER_SYSTEM, MathEnv, MathProblem

_SPAWN = re.compile(r"####\s*(\d+)\b")
_DELEGATE = re.compile(r"####([^#\n]*)")
MAX_WORKERS = 4

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
  """The most common answer (answers equal under `same`, the problem's grader, count together),
  the one given first on a tie; None when no answer was given."""
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


class SpawnMathEnv(MathEnv):
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
