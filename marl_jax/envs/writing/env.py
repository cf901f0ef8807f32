"""MAGRPO writing tasks (docs/papers.md section 3): TLDR summarisation and arXiv abstract expansion.

Two agents act in parallel on one document (agent 2 does not see agent 1) and both receive one
joint, level-gated reward (max 3.0) computed from the pair of texts (c1 = agent 1, c2 = agent 2):

  L1 +0.5   both word counts (whitespace tokens) within the range (TLDR 8-256, arXiv 128-256),
            else stop.
  L2 <=1.0  length ratio c2/c1 in characters: 1.0 on the optimum band, linear to 0 at the zero
            points (TLDR [1.6, 3.2], zero at 1.1 / 5.0; arXiv [1.3, 1.6], zero at 0.8 / 2.0);
            stop when the ratio is outside [zero_lo, zero_hi].
  L3 <=0.5  unique-word ratio u2/u1 (distinct lower-cased words, stopwords included): TLDR 0.5 at
            >= 2.0, linear from 0 at 1.3; arXiv 0.5 on [0.7, 1.3], linear to 0 at 0.5 / 1.7;
            stop outside the non-zero band's closure.
  L4 <=1.0  0.4 * T + 0.6 * J. T: transition-word coverage of c2 over 12 categories, k categories
            found -> 0 if k = 0 else min(1, 0.4 + 0.05 (k - 1)). J: Jaccard similarity of the two
            texts' word sets without stopwords, min(J, cap) / cap (cap 0.03 TLDR, 0.23 arXiv);
            an empty union gives 0.
Word lists are written here; phrases match on word boundaries (not as substrings: "so" does not
fire inside "also"). `solved` (task success) = the pair passed every gate and reached level 4.
"""

from __future__ import annotations

import copy
import dataclasses
import re

from marl_jax.envs.base import Observation, StepResult

_WORD = re.compile(r"\b\w+\b")


@dataclasses.dataclass(frozen=True)
class WritingSpec:
  """Thresholds of one task (module doc)."""

  words: tuple[int, int]
  ratio_opt: tuple[float, float]
  ratio_zero: tuple[float, float]
  unique_opt: tuple[float, float]  # upper end inf: "at least"
  unique_zero: tuple[float, float]
  jaccard_cap: float


SPECS = {
    "tldr": WritingSpec((8, 256), (1.6, 3.2), (1.1, 5.0), (2.0, float("inf")),
                        (1.3, float("inf")), 0.03),
    "arxiv": WritingSpec((128, 256), (1.3, 1.6), (0.8, 2.0), (0.7, 1.3), (0.5, 1.7), 0.23),
}

STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has
have having he her here hers herself him himself his how i if in into is it its itself just me
more most my myself no nor not now of off on once only or other our ours ourselves out over own
same she should so some such than that the their theirs them themselves then there these they
this those through to too under until up very was we were what when where which while who whom
why will with would you your yours yourself yourselves
""".split())

TRANSITIONS = {
    "addition": ("additionally", "furthermore", "moreover", "in addition", "also", "besides",
                 "as well as", "what is more"),
    "example": ("for example", "for instance", "such as", "to illustrate", "namely",
                "in particular", "specifically"),
    "clarification": ("in other words", "that is", "to put it differently", "to clarify",
                      "put simply", "more precisely"),
    "cause": ("because", "since", "due to", "owing to", "as a result of", "given that"),
    "effect": ("therefore", "thus", "consequently", "hence", "as a result", "accordingly",
               "so that"),
    "contrast": ("however", "in contrast", "on the other hand", "whereas", "conversely",
                 "instead", "but"),
    "concession": ("although", "even though", "nevertheless", "nonetheless", "despite",
                   "admittedly", "still"),
    "sequence": ("first", "second", "third", "next", "then", "afterwards", "subsequently",
                 "finally", "lastly"),
    "emphasis": ("indeed", "in fact", "notably", "importantly", "above all", "certainly",
                 "clearly"),
    "comparison": ("similarly", "likewise", "in the same way", "compared to", "just as",
                   "by comparison"),
    "condition": ("if", "unless", "provided that", "as long as", "otherwise", "in case"),
    "summary": ("in summary", "in conclusion", "overall", "to sum up", "in short", "in brief",
                "ultimately"),
}
_TRANSITION_RE = {cat: re.compile(r"\b(?:" + "|".join(re.escape(p) for p in phrases) + r")\b")
                  for cat, phrases in TRANSITIONS.items()}

SYSTEMS = {
    ("tldr", "agent1"): "Write a concise TL;DR summary of the post in one or two sentences.",
    ("tldr", "agent2"): "Write a detailed summary of the post: the situation, the key details and "
                        "what the author asks or concludes, in one well-connected paragraph.",
    ("arxiv", "agent1"): "From the abstract, write the background and motivation part of the "
                         "paper's introduction (about 150-250 words).",
    ("arxiv", "agent2"): "From the abstract, write the method and implications part of the "
                         "paper's introduction (about 150-250 words).",
}


def words(text: str) -> list[str]:
  return _WORD.findall(text.lower())


def transition_categories(text: str) -> set[str]:
  lowered = text.lower()
  return {cat for cat, pattern in _TRANSITION_RE.items() if pattern.search(lowered)}


def jaccard(c1: str, c2: str) -> float:
  a = set(words(c1)) - STOPWORDS
  b = set(words(c2)) - STOPWORDS
  union = a | b
  return len(a & b) / len(union) if union else 0.0


def _band(value: float, opt: tuple[float, float], zero: tuple[float, float]) -> float:
  """1 on [opt], linear to 0 at the zero points, 0 outside (an infinite opt end has no ramp)."""
  lo, hi = opt
  if lo <= value <= hi:
    return 1.0
  if zero[0] <= value < lo:
    return (value - zero[0]) / (lo - zero[0])
  if hi < value <= zero[1]:
    return (zero[1] - value) / (zero[1] - hi)
  return 0.0


@dataclasses.dataclass(frozen=True)
class WritingReward:
  level1: float
  level2: float
  level3: float
  level4: float
  reached: int  # the last level evaluated (1-4)

  @property
  def total(self) -> float:
    return self.level1 + self.level2 + self.level3 + self.level4


def writing_reward(c1: str, c2: str, task: str) -> WritingReward:
  """The level-gated joint reward of the module doc."""
  spec = SPECS[task]
  n1, n2 = len(c1.split()), len(c2.split())
  lo, hi = spec.words
  if not (lo <= n1 <= hi and lo <= n2 <= hi):
    return WritingReward(0.0, 0.0, 0.0, 0.0, 1)
  ratio = len(c2) / len(c1)
  if not spec.ratio_zero[0] <= ratio <= spec.ratio_zero[1]:
    return WritingReward(0.5, 0.0, 0.0, 0.0, 2)
  l2 = _band(ratio, spec.ratio_opt, spec.ratio_zero)
  unique = len(set(words(c2))) / max(1, len(set(words(c1))))
  if not spec.unique_zero[0] <= unique <= spec.unique_zero[1]:
    return WritingReward(0.5, l2, 0.0, 0.0, 3)
  l3 = 0.5 * _band(unique, spec.unique_opt, spec.unique_zero)
  k = len(transition_categories(c2))
  t = 0.0 if k == 0 else min(1.0, 0.4 + 0.05 * (k - 1))
  j = min(jaccard(c1, c2), spec.jaccard_cap) / spec.jaccard_cap
  return WritingReward(0.5, l2, l3, 0.4 * t + 0.6 * j, 4)


class WritingEnv:
  """Agents ("agent1", "agent2") write in parallel in one turn; both get the joint reward."""

  agents = ("agent1", "agent2")

  def __init__(self, document: str, task: str = "tldr"):
    if task not in SPECS:
      raise ValueError(f"unknown writing task {task!r}; expected one of {sorted(SPECS)}")
    self.document = document
    self.task = task
    self.turn = 0
    self.first: str | None = None
    self.reward: WritingReward | None = None

  @property
  def done(self) -> bool:
    return self.reward is not None

  @property
  def solved(self) -> bool:
    return self.reward is not None and self.reward.reached == 4

  def clone(self) -> WritingEnv:
    return copy.copy(self)

  def observe(self, agent: str) -> Observation:
    self._check(agent)
    label = "Post" if self.task == "tldr" else "Abstract"
    return Observation(agent, self.turn, SYSTEMS[(self.task, agent)],
                       f"{label}:\n{self.document}")

  def step(self, agent: str, response: str, *, tool_output: str | None = None) -> StepResult:
    del tool_output
    self._check(agent)
    if self.done:
      raise ValueError(f"step({agent!r}) on a finished episode")
    text = response if isinstance(response, str) else ""
    if agent == "agent1":
      self.first = text
      return StepResult(agent, None, {"agent1": 0.0}, False, {})
    if self.first is None:
      raise ValueError("agent2 steps after agent1 in the same turn")
    self.reward = writing_reward(self.first.strip(), text.strip(), self.task)
    self.turn = 1
    r = self.reward.total
    return StepResult(agent, None, {"agent2": r, "agent1": r}, True,
                      {**dataclasses.asdict(self.reward), "solved": self.solved})

  def _check(self, agent: str) -> None:
    if agent not in self.agents:
      raise ValueError(f"unknown agent {agent!r}; expected one of {self.agents}")
