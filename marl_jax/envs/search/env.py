"""Dr. MAS search (docs/papers.md section 2): a verifier routes each step to searching or answering.

Each step the verifier ends with `<verify>yes</verify>` (the information gathered suffices: the
answer agent acts) or `<verify>no</verify>` (the search agent acts); a reply with neither tag
routes to the answer agent (as in DrMAS). The search agent writes `<search>query</search>` and the
top-3 BM25 passages (`bm25s`) of the local corpus are appended to the shared context; the answer
agent writes `<answer>...</answer>`, which ends the episode. At most `max_steps` (4) steps.

Rewards: each call's local reward is -0.01 when its format is invalid, else 0; the episode reward,
exact match of the final answer with any gold answer after normalisation (lower case, punctuation
and articles removed, whitespace collapsed), is the team reward (`solved`), mixed in with alpha=1.

A seeded multi-hop world (people, cities, countries, companies; names are invented, so only the
corpus knows them) gives a corpus and 1- to 3-hop questions for tests and CPU presets; real data
loads from local JSONL (search/data.py); search/task.py builds the env.
"""

from __future__ import annotations

import copy
import re
import string
from typing import Any

from marl_jax.envs.base import MAX_REPLY_CHARS, Observation, StepResult, truncate

AGENTS = ("verifier", "search", "answer")
TOP_K = 3
FORMAT_PENALTY = 0.01
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)

_CONTEXT = "Answer the question using the search engine; facts come only from retrieved passages."
SYSTEMS = {
    "verifier": (f"{_CONTEXT} You are the verifier and route the team. Judge whether the "
                 "information gathered so far suffices to answer. End with <verify>yes</verify> "
                 "(it suffices: the answer agent answers) or <verify>no</verify> (search more). "
                 "At the last step, answer yes."),
    "search": (f"{_CONTEXT} You are the search agent. Write the next search query as "
               "<search>query</search>; the top passages will be added to the context."),
    "answer": (f"{_CONTEXT} You are the answer agent. Give the final short answer as "
               "<answer>answer</answer>."),
}


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def tag(text: str, name: str) -> str | None:
  """Stripped content of the last `<name>...</name>` in `text`, None when absent or empty.
  Two reverse searches (linear time; a lazy regex is quadratic on floods of opening tags). Only
  ASCII letters are case-folded: `str.lower` changes lengths ('İ' -> 'i̇'), which would shift the
  positions found in the folded text away from the original's."""
  text = (text or "")[-MAX_REPLY_CHARS:]
  lowered = text.translate(_ASCII_LOWER)
  close = lowered.rfind(f"</{name}>")
  start = lowered.rfind(f"<{name}>", 0, max(close, 0))
  if close < 0 or start < 0:
    return None
  return text[start + len(name) + 2:close].strip() or None


def route(response: str) -> str:
  """The router of the search workflow: 'search' on <verify>no</verify>, else 'answer'."""
  return "search" if (tag(response, "verify") or "").lower() == "no" else "answer"


def normalize_answer(text: str) -> str:
  text = text.lower().translate(_PUNCT)
  return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str | None, answers: list[str]) -> bool:
  if prediction is None:
    return False
  pred = normalize_answer(prediction)
  return any(pred == normalize_answer(a) for a in answers)


def _bm25s():
  """The `bm25s` module, imported on first use: its import runs a jax op when jax is installed,
  which starts jax's backend, and the config imports every task to list the agents
  (`registry.agent_names`) before an entry point may still configure jax (distributed
  initialisation, fake devices)."""
  import bm25s  # pylint: disable=import-outside-toplevel
  return bm25s


class Retriever:
  """BM25 (bm25s, English stopwords) over "title. text" of each passage."""

  def __init__(self, passages: list[dict[str, str]]):
    if not passages:
      raise ValueError("the search corpus is empty")
    bm25s = _bm25s()
    self.passages = passages
    texts = [f"{p['title']}. {p['text']}" for p in passages]
    self.index = bm25s.BM25()
    self.index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False),
                     show_progress=False)

  def retrieve(self, query: str, k: int = TOP_K) -> list[dict[str, str]]:
    tokens = _bm25s().tokenize([query], stopwords="en", return_ids=False, show_progress=False)
    if not tokens[0]:
      return []
    ids, scores = self.index.retrieve(tokens, k=min(k, len(self.passages)), show_progress=False)
    return [self.passages[int(i)] for i, s in zip(ids[0], scores[0]) if s > 0]


class SearchEnv:
  """Router workflow state (module doc). `information` holds every retrieval so far."""

  agents = AGENTS

  def __init__(self, question: dict[str, Any], retriever: Retriever, *, max_steps: int = 4,
               format_penalty: float = FORMAT_PENALTY):
    if not question.get("answers"):
      raise ValueError(f"a search question needs gold 'answers'; got {sorted(question)}")
    self.question = question
    self.retriever = retriever
    self.max_steps = max_steps
    self.format_penalty = format_penalty
    self.turn = 0
    self.information: tuple[tuple[str, str], ...] = ()  # (query, passages text)
    self.answer: str | None = None
    self.finished = False

  @property
  def done(self) -> bool:
    return self.finished or self.turn >= self.max_steps

  @property
  def solved(self) -> bool:
    return exact_match(self.answer, self.question["answers"])

  def clone(self) -> SearchEnv:
    return copy.copy(self)

  def context(self) -> str:
    lines = [f"Question: {self.question['question']}"]
    for query, passages in self.information:
      lines.append(f"<search>{query}</search>\n<information>{passages}</information>")
    return "\n".join(lines)

  def observe(self, agent: str) -> Observation:
    self._check(agent)
    return Observation(agent, self.turn, SYSTEMS[agent],
                       f"{truncate(self.context(), 6000)}\nStep {self.turn + 1} of "
                       f"{self.max_steps}.")

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    del tool_output
    self._check(agent)
    if self.done:
      raise ValueError(f"step({agent!r}) on a finished episode (step {self.turn})")
    info: dict[str, Any] = {}
    if agent == "verifier":
      decision = (tag(response, "verify") or "").lower()
      invalid = decision not in ("yes", "no")
      info["route"] = route(response)
    elif agent == "search":
      query = tag(response, "search")
      invalid = query is None
      passages = "(no valid query)" if invalid else self._retrieve(query[:500])
      self.information += ((query or "", passages),)
      self.turn += 1
    else:
      self.answer = tag(response, "answer")
      invalid = self.answer is None
      self.finished = True
      self.turn += 1
    info.update(format_error=invalid, solved=self.solved)
    return StepResult(agent, None, {agent: -self.format_penalty if invalid else 0.0}, self.done,
                      info)

  def _retrieve(self, query: str) -> str:
    hits = self.retriever.retrieve(query, TOP_K)
    if not hits:
      return "(no results)"
    return " ".join(f"Doc {i + 1} (Title: {p['title']}) {p['text']}" for i, p in enumerate(hits))

  def _check(self, agent: str) -> None:
    if agent not in self.agents:
      raise ValueError(f"unknown agent {agent!r}; expected one of {self.agents}")
