"""The MAGRPO writing family: its env factory, its one-turn parallel workflow and problem source.
The task (TLDR or arXiv) is the env kwarg `task`; generated problems are seeded filler documents;
with `path` (and `field`) in the env kwargs, seed s is row s % rows of that file.
"""

from __future__ import annotations

from typing import Any

from marl_jax.envs.base import Task, Workflow, check_int
from marl_jax.envs.data import file_rows
from marl_jax.envs.writing import data as writing_data
from marl_jax.envs.writing.env import WritingEnv

WORKFLOWS = {
    "magrpo": Workflow(WritingEnv.agents, max_turns=1, fixed_turns=True, topology="swarm"),
}


def make_env(*, task: str = "tldr", document: str | None = None, path: str | None = None,
             index: int | None = None, field: str | None = None,
             seed: int | None = None, sentences: int = 8) -> WritingEnv:
  """Registry factory: a document given inline, a file row (path, index) or a generated filler
  document (seed, `sentences` long), e.g. make_env("writing", task="arxiv",
  path="abstracts.jsonl", index=4)."""
  if sum(x is not None for x in (document, path, seed)) != 1:
    raise ValueError("give exactly one of document=, path= (+ index=), seed=")
  check_int("sentences", sentences, 1, 1000)
  if path is not None:
    if index is None:
      raise ValueError(f"path={path!r} needs index=")
    document = writing_data.load_documents(path, field)[index]
  elif seed is not None:
    document = writing_data.generated_document(seed, sentences)
  return WritingEnv(document, task)


def problem(variant: str, max_turns: int, seed: int) -> dict[str, Any]:
  del variant, max_turns
  return dict(seed=seed)


dataset_rows = file_rows("writing", writing_data.load_documents, "path", "field")

TASK = Task(make_env, WORKFLOWS, problem, dataset_rows, envs=(WritingEnv,))
