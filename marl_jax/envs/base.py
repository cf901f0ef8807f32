"""The environment contract and what every environment family shares: the step API's records,
seed and prompt helpers, and the plain-data declaration of a family's workflows and problem source.

An environment (one problem, one episode) is an `Environment` (the Protocol below, the methods
every caller may use); an optional capability is a Protocol of its own (`Demonstrates`,
`MakesMistakes`, `RewardsDecisions`, `GradesAnswers`) that a caller tests with `isinstance` and
nothing else. A family declares the classes its factory builds in its `Task`, which refuses a
class that lacks a required method when it is declared (docs/design.md, "Adding an environment").

Each family package (envs/games, envs/math, envs/code, envs/writing, envs/search) declares, in
its `task.py`, one `Task`: its env factory and env classes, its workflow variants as `Workflow`s
(who acts, in which order, when the episode exits) and how a seed or a dataset row becomes a
problem. The workflows layer registers each Task under a name (workflows/registry.py) and turns a
`Workflow` into the engine's `WorkflowSpec`; this module stays plain data so the envs need nothing
above them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

# Model replies are read up to this many characters: a real reply (at most a few thousand tokens)
# is far shorter, and the bound keeps regex and `ast` work on flooding text in milliseconds.
MAX_REPLY_CHARS = 50_000


@dataclasses.dataclass(frozen=True)
class Observation:
  """One agent's prompt: chat messages are [system, user].

  `state`: a discrete summary of what the agent sees, in [0, the workflow's `num_states`), for
  estimators that compare only replies given in the same state (`group_by`
  "problem_turn_agent_state"); 0 where a workflow declares no states."""

  agent: str
  turn: int
  system: str
  user: str
  state: int = 0

  def messages(self) -> list[dict[str, str]]:
    return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]


@dataclasses.dataclass(frozen=True)
class StepResult:
  """Result of one agent's step. `rewards` are additive contributions (`Environment.step`)."""

  agent: str
  actions: tuple[Any, ...] | None  # the coerced actions; None when the output did not parse.
  rewards: dict[str, float]
  done: bool
  info: dict[str, Any]


@runtime_checkable
class Environment(Protocol):
  """One problem, one episode: every member the rollout engine, the replayer and the trainer call.

  `agents` are the agents in acting order, `turn` the current turn (0 first), `done` whether the
  episode has ended and `solved` whether it solved its problem (the team reward, 1 or 0).
  `clone()` copies the state, so tree sampling can step K branches from one state."""

  agents: tuple[str, ...]
  turn: int

  @property
  def done(self) -> bool: ...

  @property
  def solved(self) -> bool: ...

  def clone(self) -> Environment: ...

  def observe(self, agent: str) -> Observation:
    """`agent`'s prompt in the current state."""

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    """Applies `agent`'s reply (and, for a tool agent, what its program printed). `rewards` are
    additive agent-keyed contributions: the acting agent's entry goes to its own sample, other
    entries to those agents' samples of the same turn (workflows/rollout.py)."""


# `Environment`'s members: the methods a class must define, and the data an instance has.
REQUIRED_METHODS = ("clone", "observe", "step")
REQUIRED_DATA = ("agents", "turn", "done", "solved")


@runtime_checkable
class Demonstrates(Protocol):
  """Can show a competent reply: the supervised warm-start (training/sft.py) trains on them."""

  def demonstration(self, agent: str) -> str | None:
    """`agent`'s reply in the current state; None where the env has none."""


@runtime_checkable
class MakesMistakes(Protocol):
  """Can show a plausible wrong reply, which the warm-start opens some episodes with so the
  team learns to recover from it (`config.sft.mistake_rate`)."""

  def mistake(self, agent: str) -> str | None:
    """A wrong reply of `agent` in the current state; None where the env has none."""


@runtime_checkable
class RewardsDecisions(Protocol):
  """Its agents make orchestration decisions (stop, spawn, delegate) that are judged by the
  episode they led to: settled when the episode ends, credited to each of that agent's samples
  and recorded as the trace's `orchestration` channel, by the rollout and by replay. Such an env
  needs each episode on its own (independent rollouts)."""

  def final_rewards(self) -> dict[str, float]:
    """agent -> its decision reward for the finished episode."""


@runtime_checkable
class GradesAnswers(Protocol):
  """Compares answers with a named grader (envs/math/grading.py), which an evaluation reports."""

  @property
  def grader(self) -> str: ...


def check_environment(env: Any, envs: tuple[type, ...] = ()) -> Environment:
  """`env`, checked to be one of the declared classes `envs` or, with none declared, an
  `Environment`; TypeError naming what it lacks otherwise."""
  if envs and not isinstance(env, envs):
    raise TypeError(f"the env factory built a {type(env).__qualname__}, which its Task does not "
                    f"declare; expected one of {[c.__qualname__ for c in envs]}")
  if not isinstance(env, Environment):
    missing = [m for m in REQUIRED_DATA + REQUIRED_METHODS if not hasattr(env, m)]
    raise TypeError(f"{type(env).__qualname__} lacks {missing}; expected every member of "
                    "envs.base.Environment")
  return env


# The `info` keys under which an env reports what it read from a reply when it has no coerced
# `actions` (math answers, verdicts, orchestration decisions, search routes), in priority order.
PARSED_INFO_KEYS = ("answer", "verdict", "decision", "route")
_ACTION_CHARS = 300  # the text of a parsed action is cut to this many characters


def parsed_action(result: StepResult) -> str | None:
  """What the env parsed from the reply, as text for people (the trainer's samples tables): the
  coerced actions, else the first `PARSED_INFO_KEYS` value in `info`; None when nothing parsed
  (`actions` None with a `format_error`, or no parsed value reported)."""
  if result.actions is not None:
    text = ", ".join(str(a) for a in result.actions) or "()"
  elif result.info.get("format_error"):
    return None
  else:
    found = [result.info[k] for k in PARSED_INFO_KEYS if result.info.get(k) is not None]
    if not found:
      return None
    text = str(found[0])
  return truncate(text, _ACTION_CHARS)


def check_seed(seed: int) -> int:
  """Seeds are non-negative ints: `random.Random` folds -s onto s, which would alias instances."""
  if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")
  return seed


def check_int(name: str, value: Any, low: int, high: int) -> int:
  """An integer env kwarg within [low, high]. The upper bounds keep what one problem costs to
  build and prompt small: a config, or a replayed trace (untrusted), asking for a 3000x3000 grid
  took 42 s and 1.8 GB to build one episode."""
  if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
    raise ValueError(f"{name}={value!r}; expected an integer in [{low}, {high}]")
  return value


def check_number(name: str, value: Any, low: float, high: float) -> float:
  """A finite numeric env kwarg within [low, high] (NaN and inf are refused)."""
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not math.isfinite(value) or not low <= value <= high):
    raise ValueError(f"{name}={value!r}; expected a finite number in [{low}, {high}]")
  return float(value)


def truncate(text: str, limit: int) -> str:
  """Head and tail of `text` within about `limit` characters."""
  if len(text) <= limit:
    return text
  half = limit // 2
  return f"{text[:half]}\n...[{len(text) - 2 * half} chars cut]...\n{text[-half:]}"


@dataclasses.dataclass(frozen=True)
class Workflow:
  """One workflow variant of a family: its agents in acting order and how turns end.

  The kinds (workflows/spec.py): 'sequential' (every turn, all agents in order), 'loop' (plus an
  exit after `exit_agent` when `exit_when(reply)`), 'router' (`agents[0]` picks, via
  `route(reply)`, which other agent acts next), 'spawn' (`agents[0]` runs the workers of
  `agents[1:-1]` that `spawn(reply)` names, then the aggregator `agents[-1]`).
  """

  agents: tuple[str, ...]
  kind: str = "sequential"
  max_turns: int = 4  # the turn cap when the run names none
  fixed_turns: bool = False  # the variant always runs `max_turns` turns, whatever the run asks
  tool_agents: frozenset[str] = frozenset()  # replies run as programs in the sandbox
  exit_agent: str | None = None  # loop only
  exit_when: Callable[[str], bool] | None = None  # loop only
  route: Callable[[str], str] | None = None  # router only: router reply -> next agent
  spawn: Callable[[str], tuple[str, ...]] | None = None  # spawn only: reply -> workers to run
  topology: str = "planner_executor_critic"  # trace topology label (docs/papers.md section 5)
  num_states: int = 1  # the observations' `state` ids lie in [0, num_states)


def no_dataset(env_kwargs: dict[str, Any]) -> None:
  """`Task.dataset_rows` of a family without local data files."""
  del env_kwargs
  return None


@dataclasses.dataclass(frozen=True)
class Task:
  """An environment family as the registry sees it (module doc)."""

  make_env: Callable[..., Any]  # keyword arguments -> one environment
  workflows: Mapping[str, Workflow]  # variant name -> declaration, first = the default
  # (variant, max_turns, seed) -> make_env keyword arguments of a generated (or packaged) problem
  problem: Callable[[str, int, int], dict[str, Any]]
  # config env kwargs (None values dropped) -> rows of the local dataset they name, or None when
  # they name none; problem `seed` is then row `seed % rows`.
  dataset_rows: Callable[[dict[str, Any]], int | None] = no_dataset
  # keys of `problem`'s result that select the generated problem; dropped for a dataset row.
  source_keys: tuple[str, ...] = ("seed",)
  # the env classes `make_env` builds; each must define `REQUIRED_METHODS` (checked here), and
  # `make_env` may build no other (`check_environment`). () leaves each built env to be checked
  # against `Environment` alone.
  envs: tuple[type, ...] = ()

  def __post_init__(self):
    for cls in self.envs:
      missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
      if not isinstance(cls, type) or missing:
        raise TypeError(f"Task env {cls!r} lacks the methods {missing or list(REQUIRED_METHODS)}"
                        f"; expected a class defining {list(REQUIRED_METHODS)} "
                        "(envs.base.Environment)")

  def make(self, **kwargs: Any) -> Environment:
    """One environment from `make_env`, checked (`check_environment`)."""
    return check_environment(self.make_env(**kwargs), self.envs)
