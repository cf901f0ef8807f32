"""What every environment family shares: the step API's records, seed and prompt helpers, and
the plain-data declaration of a family's workflows and problem source.

An environment (one problem, one episode) has `agents`, `turn`, `done`, `solved`, `clone()`,
`observe(agent) -> Observation` and `step(agent, response, *, tool_output=None) -> StepResult`;
rewards are additive agent-keyed contributions (the acting agent's entry goes to its own sample,
other entries to those agents' samples of the same turn, see workflows/rollout.py). An env whose
agents make orchestration decisions may also define `final_rewards() -> {agent: value}`, settled
when the episode ends and credited to each of that agent's samples (its decisions are judged by the
episode they led to; the trace's `orchestration` channel).

Each family package (envs/games, envs/math, envs/code, envs/writing, envs/search) declares, in
its `task.py`, one `Task`: its env factory, its workflow variants as `Workflow`s (who acts, in
which order, when the episode exits) and how a seed or a dataset row becomes a problem. The
workflows layer registers each Task under a name (workflows/registry.py) and turns a `Workflow`
into the engine's `WorkflowSpec`; this module stays plain data so the envs need nothing above them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

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
  """Result of one agent's step. `rewards` are additive contributions (see the module doc)."""

  agent: str
  actions: tuple[Any, ...] | None  # the coerced actions; None when the output did not parse.
  rewards: dict[str, float]
  done: bool
  info: dict[str, Any]


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
