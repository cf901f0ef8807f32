"""The Dr. MAS search family: its env factory, its router workflow and problem source.

Generated problems: problem seed s is question s % N of the generated world s // N
(N = WORLD_QUESTIONS), so the training seeds and the held-out evaluation seeds (offset 1e6) come
from different worlds. With `questions_path` (and `corpus_path`) in the env kwargs, seed s is
question row s % rows of that file.
"""

from __future__ import annotations

import functools
from typing import Any

from marl_jax.envs.base import Task, Workflow, check_int
from marl_jax.envs.data import file_rows
from marl_jax.envs.search import data as search_data
from marl_jax.envs.search.env import AGENTS, FORMAT_PENALTY, Retriever, SearchEnv, route

WORLD_QUESTIONS = 24

WORKFLOWS = {
    "drmas": Workflow(AGENTS, kind="router", route=route, topology="centralized"),
}


@functools.lru_cache(maxsize=8)
def _retriever(source: tuple[str, Any]) -> Retriever:
  kind, key = source
  if kind == "generated":
    return Retriever(list(search_data.generate_world(*key)[0]))
  return Retriever(search_data.search_corpus(key))


def make_env(*, index: int | None = None, seed: int | None = None, num_people: int = 24,
             corpus_path: str | None = None, questions_path: str | None = None,
             question: dict[str, Any] | None = None, max_steps: int = 4,
             format_penalty: float = FORMAT_PENALTY) -> SearchEnv:
  """Registry factory. Generated world: make_env("search", seed=0, index=3). Local data:
  corpus_path= plus questions_path= and index=, or an inline question= dict."""
  if (seed is None) == (corpus_path is None):
    raise ValueError("give exactly one corpus: seed= (generated world) or corpus_path=")
  check_int("max_steps", max_steps, 1, 100)
  if seed is not None:
    check_int("num_people", num_people, 1, 1000)  # the generated world's size
    source: tuple[str, Any] = ("generated", (seed, num_people))
    pool = list(search_data.generate_world(seed, num_people)[1])
  else:
    source = ("path", str(corpus_path))
    pool = search_data.search_questions(questions_path) if questions_path else []
  if question is None:
    if index is None or not pool:
      raise ValueError("give question= or index= (with seed= or questions_path=)")
    question = pool[index]
  return SearchEnv(question, _retriever(source), max_steps=max_steps,
                   format_penalty=format_penalty)


def problem(variant: str, max_turns: int, seed: int) -> dict[str, Any]:
  del variant
  return dict(seed=seed // WORLD_QUESTIONS, index=seed % WORLD_QUESTIONS,
              num_people=WORLD_QUESTIONS, max_steps=max_turns)


dataset_rows = file_rows("search", search_data.search_questions, "questions_path")

TASK = Task(make_env, WORKFLOWS, problem, dataset_rows,
            source_keys=("seed", "index", "num_people"), envs=(SearchEnv,))
