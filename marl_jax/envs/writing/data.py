"""Writing documents (str): file rows (TLDR posts, arXiv abstracts) and seeded filler posts."""

from __future__ import annotations

import functools
import random

from marl_jax.envs.data import read_records


@functools.lru_cache(maxsize=16)
def _load_writing_cached(path: str, field: str | None) -> tuple[str, ...]:
  docs = []
  for row in read_records(path):
    keys = (field,) if field else ("document", "content", "post", "prompt", "abstract", "text")
    text = next((row[k] for k in keys if isinstance(row.get(k), str)), None)
    if text is None:
      raise ValueError(f"{path}: writing row without a text field among {keys}: {sorted(row)}")
    docs.append(text)
  return tuple(docs)


def load_documents(path: str, field: str | None = None) -> list[str]:
  """Documents of a writing task: `field`, or the first of document/content/post/prompt/
  abstract/text (TLDR posts, arXiv abstracts)."""
  return list(_load_writing_cached(str(path), field))


_TOPIC_WORDS = ("garden", "budget", "neighbour", "bicycle", "library", "recipe", "internship",
                "roommate", "concert", "deadline", "puppy", "landlord", "marathon", "laptop",
                "vacation", "project", "museum", "coffee", "weekend", "train")


def generated_document(seed: int, sentences: int = 8) -> str:
  """A seeded filler 'post' (CPU presets only: it has words, not meaning)."""
  rng = random.Random(seed)
  lines = []
  for _ in range(sentences):
    a, b, c = rng.sample(_TOPIC_WORDS, 3)
    lines.append(f"My {a} and the {b} keep getting in the way of the {c}, so I am not sure "
                 f"what to do about the {a} this week.")
  return " ".join(lines)
