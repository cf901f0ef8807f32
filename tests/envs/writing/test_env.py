"""MAGRPO writing rewards against hand-computed values for crafted text pairs at every level, and
the two-agent parallel env through the rollout engine.

Texts are built from invented words ("qa", "zab", "xabcd": no stopwords, no transition words) so
that word counts, character lengths, unique-word counts and overlaps are known by construction;
each case asserts the lengths its hand computation relies on."""

from __future__ import annotations

import itertools
import json

import pytest

from marl_jax.envs.writing import env as writing
from marl_jax.workflows import registry, replay
from marl_jax.workflows import rollout as R


def words(prefix: str, n: int, length: int) -> list[str]:
  """n distinct invented words of `length` letters starting with `prefix`."""
  tails = itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=length - len(prefix))
  return [prefix + "".join(t) for t in itertools.islice(tails, n)]


def text(ws: list[str]) -> str:
  return " ".join(ws)


def test_tldr_level1_gate():
  assert writing.writing_reward("too short", text(words("q", 10, 2)), "tldr").total == 0.0
  assert writing.writing_reward(text(words("q", 10, 2)), text(words("k", 300, 3)),
                                "tldr").total == 0.0


def test_tldr_level2_gate():
  c = text(words("q", 8, 2))  # ratio 1.0 < 1.1: L1 only
  reward = writing.writing_reward(c, c, "tldr")
  assert (reward.total, reward.reached) == (0.5, 2)


def test_tldr_every_level():
  c1 = text(words("q", 8, 2))  # 8 words, 8 unique, 8*2 + 7 = 23 chars
  c2 = text(["however", "qa", "moreover", "qb", "therefore"] + words("j", 10, 2) + ["finally"])
  assert (len(c1), len(c2), len(c2.split())) == (23, 70, 16)
  # L2: 70/23 = 3.04 in [1.6, 3.2] -> 1.0. L3: 16/8 = 2.0 -> 0.5.
  # L4: categories contrast, addition, effect, sequence: T = 0.4 + 3 * 0.05 = 0.55;
  #     Jaccard {qa, qb} / 22 words = 0.0909 >= cap 0.03 -> 1.0; L4 = 0.4 * 0.55 + 0.6 = 0.82.
  reward = writing.writing_reward(c1, c2, "tldr")
  assert reward.reached == 4
  assert (reward.level1, reward.level2, reward.level3) == (0.5, 1.0, 0.5)
  assert reward.level4 == pytest.approx(0.82)
  assert reward.total == pytest.approx(2.82)


def test_tldr_ramps():
  c1 = text(["qaa"] + words("q", 20, 2)[1:20])  # 20 words: 3 + 19*2 + 19 = 60 chars
  c2 = text(["jaa"] + words("k", 26, 2))  # 27 words: 3 + 26*2 + 26 = 81 chars
  assert (len(c1), len(c2)) == (60, 81)
  # L2: 81/60 = 1.35 -> (1.35 - 1.1)/0.5 = 0.5. L3: 27/20 = 1.35 -> 0.5 * 0.05/0.7.
  # L4: no transition words, no shared words -> 0.
  reward = writing.writing_reward(c1, c2, "tldr")
  assert reward.level2 == pytest.approx(0.5)
  assert reward.level3 == pytest.approx(0.5 * 0.05 / 0.7)
  assert (reward.level4, reward.reached) == (0.0, 4)
  assert reward.total == pytest.approx(1.0 + 0.5 * 0.05 / 0.7)
  c1 = text(["qaa"] + words("q", 10, 2)[1:10])  # 30 chars
  c2 = " ".join([c1] * 4)  # 123 chars, still 10 unique words
  assert (len(c1), len(c2)) == (30, 123)
  # L2: 123/30 = 4.1 -> (5.0 - 4.1)/1.8 = 0.5; L3: 10/10 = 1.0 < 1.3 -> stop.
  reward = writing.writing_reward(c1, c2, "tldr")
  assert (reward.reached, reward.level3) == (3, 0.0)
  assert reward.total == pytest.approx(1.0)


def test_arxiv_every_level():
  c1_words = words("z", 130, 3)
  c1 = text(c1_words)  # 130*3 + 129 = 519 chars
  c2 = text(c1_words[:20] + words("x", 110, 5) + ["however", "moreover"])
  assert (len(c1), len(c2), len(c2.split())) == (519, 756, 132)
  # L2: 756/519 = 1.457 in [1.3, 1.6] -> 1.0. L3: 132/130 = 1.015 in [0.7, 1.3] -> 0.5.
  # L4: T (2 categories) = 0.45; Jaccard 20/242 = 0.08264 -> /0.23 = 0.35932.
  reward = writing.writing_reward(c1, c2, "arxiv")
  assert (reward.level1, reward.level2, reward.level3, reward.reached) == (0.5, 1.0, 0.5, 4)
  assert reward.level4 == pytest.approx(0.4 * 0.45 + 0.6 * (20 / 242) / 0.23)
  assert reward.total == pytest.approx(2.0 + 0.18 + 0.6 * (20 / 242) / 0.23)
  assert writing.writing_reward(text(words("z", 100, 3)), c2, "arxiv").total == 0.0


def test_arxiv_ramps_and_level3_gate():
  c1 = text(words("z", 129, 3) + ["zzzz"])  # 130 words, 129*3 + 4 + 129 = 520 chars
  c2 = text(words("x", 157, 4) + words("y", 38, 3))  # 195 words: 628 + 114 + 194 = 936
  assert (len(c1), len(c2)) == (520, 936)
  # L2: 936/520 = 1.8 -> (2.0 - 1.8)/0.4 = 0.5. L3: 195/130 = 1.5 -> 0.5 * (1.7 - 1.5)/0.4.
  reward = writing.writing_reward(c1, c2, "arxiv")
  assert reward.level2 == pytest.approx(0.5) and reward.level3 == pytest.approx(0.25)
  assert (reward.level4, reward.reached) == (0.0, 4)
  assert reward.total == pytest.approx(1.25)
  c1 = text(words("z", 130, 3))  # 519 chars
  c2 = text(words("y", 52, 3) * 3)  # 156 words, 52 unique: 468 + 155 = 623 chars
  assert len(c2) == 623
  # L2: 623/519 -> (623/519 - 0.8)/0.5; L3: 52/130 = 0.4 < 0.5 -> stop.
  reward = writing.writing_reward(c1, c2, "arxiv")
  assert reward.reached == 3
  assert reward.total == pytest.approx(0.5 + (623 / 519 - 0.8) / 0.5)


def test_transition_words_match_whole_words():
  assert writing.transition_categories("Also, this is fine.") == {"addition"}
  assert writing.transition_categories("the salsa was hot") == set()  # no "so"/"as" inside
  assert writing.transition_categories("For example, however, in summary.") == {
      "example", "contrast", "summary"}
  assert len(writing.TRANSITIONS) == 12


def test_writing_env_parallel_agents_share_the_reward(tmp_path):
  c1 = text(words("q", 8, 2))
  c2 = text(["however", "qa", "moreover", "qb", "therefore"] + words("j", 10, 2) + ["finally"])
  docs = tmp_path / "tldr.jsonl"
  docs.write_text(json.dumps({"prompt": "My landlord keeps the heating off."}) + "\n")

  def generate(requests, policy_id, params):
    for r in requests:  # agent2 never sees agent1's text
      assert r.agent == "agent1" or c1 not in r.messages[1]["content"]
    return [R.Generation(c1 if r.agent == "agent1" else c2) for r in requests]

  problem = R.Problem("writing", {"task": "tldr", "path": str(docs), "index": 0}, 0)
  res = R.rollout([problem], registry.workflow_spec("writing", "magrpo", per_role=True), generate, None,
                  R.RolloutConfig(k=2, trace_clock="logical"))
  assert [(s.agent, s.policy_id) for s in res.samples] == [
      ("agent1", 0), ("agent1", 0), ("agent2", 1), ("agent2", 1)]
  assert all(s.reward == pytest.approx(2.82) for s in res.samples)
  assert "landlord" in res.samples[0].messages[1]["content"]
  episode = res.episodes[0]
  assert episode.solved
  assert replay.recompute_rewards(episode.trace, episode.content) == episode.rewards
  env = registry.make_env("writing", task="arxiv", seed=3)
  env.step("agent1", "short")
  result = env.step("agent2", "also short")
  assert result.rewards == {"agent1": 0.0, "agent2": 0.0} and result.done and not env.solved
  with pytest.raises(ValueError, match="unknown writing task"):
    registry.make_env("writing", task="poetry", seed=1)


# The README's "Fidelity" section: the TLDR reward (as the papers' code) reads only the two texts,
# never the post, so one fixed pair takes its maximum on every post, an empty one included.
FIXED_PAIR = ("Alpha beta gamma delta epsilon zeta eta theta.",
              "Additionally, for example, in other words, because therefore however although "
              "first indeed similarly if in summary alpha.")


@pytest.mark.parametrize("post", ["", "My cat ate my homework; what do I tell the teacher?",
                                  "x " * 300])
def test_tldr_fixed_pair_takes_the_maximum_on_any_post(post):
  env = writing.WritingEnv(post, "tldr")
  env.step("agent1", FIXED_PAIR[0])
  result = env.step("agent2", FIXED_PAIR[1])
  # 0.5 + 1.0 + 0.5 + (0.4 * min(1, 0.4 + 0.05 * 11) + 0.6): 12 categories give T = 0.95.
  assert result.rewards == {"agent1": pytest.approx(2.98), "agent2": pytest.approx(2.98)}
  assert env.solved
