"""Dr. MAS search: a scripted oracle solves every generated multi-hop question through the router
workflow (real BM25 retrieval: it answers only what the retrieved passages contain), exact-match
normalisation, tag parsing, penalties, the step cap and local JSONL data."""

from __future__ import annotations

import json
import time

import pytest

from marl_jax.envs.search import data as search_data
from marl_jax.envs.search import env as search
from marl_jax.traces import schema
from marl_jax.workflows import registry, replay
from marl_jax.workflows import rollout as R


def oracle(requests, policy_id, params):
  """Searches each hop's query in turn, then answers the last hop's entity if (and only if) the
  retrieved information contains it."""
  del policy_id, params
  out = []
  for r in requests:
    env = r.env
    hops, done = env.question["hops"], len(env.information)
    if r.agent == "verifier":
      text = "<think>ok</think><verify>no</verify>" if done < len(hops) else "<verify>yes</verify>"
    elif r.agent == "search":
      text = f"<search>{hops[done]['query']}</search>"
    else:
      entity = hops[-1]["entity"]
      found = any(entity in passages for _, passages in env.information)
      text = f"<answer>{entity if found else 'unknown'}</answer>"
    out.append(R.Generation(text))
  return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_solves_every_generated_question(seed):
  _, questions = search_data.generate_world(seed)
  assert {len(q["hops"]) for q in questions} == {1, 2, 3}
  problems = [R.Problem("search", {"seed": seed, "index": i}, i) for i in range(len(questions))]
  res = R.rollout(problems, registry.workflow_spec("search", "drmas"), oracle, None,
                  R.RolloutConfig(k=1, trace_clock="logical"))
  assert all(e.solved for e in res.episodes) and len(res.episodes) == len(questions)
  for episode, question in zip(res.episodes, questions):
    agents = [s.agent for s in res.samples if s.traj_id == episode.traj_id]
    n = len(question["hops"])
    assert agents == ["verifier", "search"] * n + ["verifier", "answer"]
    assert episode.turns == n + 1 and episode.rewards["team"] == 1.0
  episode = res.episodes[0]
  schema.validate(episode.trace)
  assert replay.recompute_rewards(episode.trace, episode.content) == episode.rewards


def test_generated_world_is_seeded():
  assert search_data.generate_world(4) == search_data.generate_world.__wrapped__(4)
  assert search_data.generate_world(4)[1] != search_data.generate_world(5)[1]


def test_exact_match_and_tags():
  assert search.exact_match("The  Eiffel-Tower!", ["eiffel tower"]) is False  # '-' removed
  assert search.exact_match("The Eiffel Tower.", ["eiffel tower", "paris"])
  assert search.exact_match("an apple", ["Apple"]) and not search.exact_match(None, ["x"])
  assert not search.exact_match("Paris, France", ["Paris"])
  assert search.tag("<answer> a </answer> then <answer>b</answer>", "answer") == "b"
  assert search.tag("<search></search>", "search") is None
  assert search.route("<verify>NO</verify>") == "search"
  assert search.route("<verify>yes</verify>") == "answer"
  assert search.route("no tag at all") == "answer"
  start = time.monotonic()  # floods of opening tags are scanned in linear time
  assert search.tag("<answer>" * 100_000, "answer") is None
  assert search.tag("<search>q" * 100_000 + "</search>", "search") == "q"
  assert time.monotonic() - start < 1.0


def test_penalties_and_step_cap():
  env = registry.make_env("search", seed=0, index=0)
  result = env.step("verifier", "I think we should search")
  assert result.rewards == {"verifier": -0.01} and result.info["route"] == "answer"
  assert env.step("search", "query without tags").rewards == {"search": -0.01}
  assert "(no valid query)" in env.observe("verifier").user
  for _ in range(3):
    env.step("verifier", "<verify>no</verify>")
    result = env.step("search", "<search>something</search>")
  assert result.done and env.turn == 4 and not env.solved
  with pytest.raises(ValueError, match="finished"):
    env.step("verifier", "<verify>yes</verify>")
  env = registry.make_env("search", seed=0, index=0)
  env.step("verifier", "<verify>yes</verify>")
  result = env.step("answer", "I do not know")
  assert result.done and result.rewards == {"answer": -0.01} and not env.solved


def test_local_jsonl_corpus_and_questions(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  rows = [{"id": "0", "contents": '"Velmora"\nVelmora is the capital of Ostrand.'},
          {"id": "1", "contents": '"Kestrel Bay"\nKestrel Bay is a harbour town in Lunmark.'},
          {"id": "2", "contents": '"Ostrand"\nOstrand is a northern kingdom.'},
          {"id": "3", "contents": '"Lunmark"\nLunmark borders Ostrand to the south.'}]
  corpus.write_text("\n".join(json.dumps(r) for r in rows))
  questions = tmp_path / "q.jsonl"
  questions.write_text(json.dumps({"question": "What is the capital of Ostrand?",
                                   "golden_answers": ["Velmora"]}))
  kwargs = {"corpus_path": str(corpus), "questions_path": str(questions), "index": 0}
  env = registry.make_env("search", **json.loads(json.dumps(kwargs)))
  env.step("verifier", "<verify>no</verify>")
  env.step("search", "<search>capital of Ostrand</search>")
  context = env.observe("answer").user
  assert context.index("Velmora is the capital") < context.index("Doc 2")
  env.step("verifier", "<verify>yes</verify>")
  assert env.step("answer", "<answer>velmora</answer>").done and env.solved
  hits = search.Retriever(search_data.search_corpus(str(corpus))).retrieve("harbour town")
  assert [h["title"] for h in hits] == ["Kestrel Bay"]


def test_questions_file_is_read_once_for_many_envs(tmp_path, monkeypatch):
  corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "q.jsonl"
  corpus.write_text(json.dumps({"title": "Ostrand", "text": "Ostrand is a kingdom."}))
  questions.write_text("\n".join(json.dumps({"question": f"q{i}", "answers": [f"a{i}"]})
                                 for i in range(3)))
  reads = []
  real = search_data.read_records
  monkeypatch.setattr(search_data, "read_records", lambda path: reads.append(path) or real(path))
  kwargs = {"corpus_path": str(corpus), "questions_path": str(questions)}
  envs = [registry.make_env("search", index=i, **kwargs) for i in (0, 1, 2, 0)]
  assert [e.question["answers"] for e in envs] == [["a0"], ["a1"], ["a2"], ["a0"]]
  assert [str(p) for p in reads].count(str(questions)) == 1
