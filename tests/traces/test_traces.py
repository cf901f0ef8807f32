"""Orchestration traces: recorder output validates, bad traces are rejected, files round-trip,
replay recomputes rewards exactly and catches tampering, statistics and the command line behave.

A toy task, "word_count", stands in for the game workflows: a writer sends a sentence, a counter
agent calls a (simulated) tool that counts its words, and the rewards depend on the stored texts
only.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from marl_jax.traces import recorder as recorder_lib
from marl_jax.traces import replay as replay_lib
from marl_jax.traces import schema, stats, store

_REPO = pathlib.Path(__file__).resolve().parents[2]

# The toy task's reward recomputation, as a module so the CLI subprocess can import it too.
_TOY_MODULE = '''
from marl_jax.traces.replay import REPLAYERS, event_text


def rewards_from_texts(sentence, tool_output):
  words = len(sentence.split())
  correct = tool_output.strip() == str(words)
  return {"team": 1.0 if correct else 0.0, "agent:writer": words / 7,
          "tool": 0.5 if tool_output.strip().isdigit() else -1.0}


def recompute(trace, content):
  by_type = {e["type"]: e for e in trace["events"]}
  return rewards_from_texts(event_text(by_type["message"], content),
                            event_text(by_type["tool_result"], content))


REPLAYERS.register("word_count", recompute, replace=True)
'''

_SENTENCES = ["the quick brown fox", "jumps over the lazy dog today", "héllo wörld ✓"]


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory) -> pathlib.Path:
  path = tmp_path_factory.mktemp("toy")
  (path / "toy_word_count.py").write_text(_TOY_MODULE)
  return path


@pytest.fixture(scope="module")
def toy(toy_dir):
  spec = importlib.util.spec_from_file_location("toy_word_count", toy_dir / "toy_word_count.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # registers the replayer
  return module


def _episode(toy, index: int, sentence: str, *, wrong_tool: bool = False,
             clock: str = "wall") -> tuple[dict, dict]:
  rec = recorder_lib.TraceRecorder("word_count", f"sentence={index}", trace_id=f"wc-{index}",
                                   topology="centralized", clock=clock)
  decide = rec.event("orchestrator_decision", "orchestrator", content="Count the words.", tokens=5)
  spawn_w = rec.event("spawn", "orchestrator", receiver="writer", role="writer",
                      after=[(decide, "causal")])
  spawn_c = rec.event("spawn", "orchestrator", receiver="counter", role="counter",
                      after=[(decide, "causal")])
  msg = rec.event("message", "writer", sender="writer", receiver="counter", content=sentence,
                  tokens=len(sentence.split()), after=[(spawn_w, "spawn")], trusted=False, turn=0)
  program = f"print(len({sentence!r}.split()))"
  call = rec.event("tool_call", "counter", tool="python", content=program, tokens=12,
                   after=[(msg, "message"), (spawn_c, "spawn")], turn=0)
  output = str(len(sentence.split()) + (1 if wrong_tool else 0)) + "\n"
  result = rec.event("tool_result", "python", tool="python", content=output,
                     after=[(call, "tool_dependency")])
  back = rec.event("return", "counter", sender="counter", receiver="orchestrator", content=output,
                   after=[(result, "return")])
  final = rec.event("aggregate", "orchestrator", content=output)
  rec.edge(back, final, "aggregate")
  for channel, value in toy.rewards_from_texts(sentence, output).items():
    rec.set_reward(channel, value)
  rec.set_metric("task_success", 0.0 if wrong_tool else 1.0)
  return rec.finish()


@pytest.fixture
def episodes(toy):
  return [_episode(toy, i, s, wrong_tool=(i == 2)) for i, s in enumerate(_SENTENCES)]


@pytest.fixture
def trace_file(tmp_path, episodes) -> pathlib.Path:
  path = tmp_path / "run" / "traces.jsonl"
  with store.TraceWriter(path) as writer:
    for trace, content in episodes:
      writer.write(trace, content)
  return path


def test_recorder_output_validates(episodes):
  trace, content = episodes[0]
  schema.validate(trace)
  events = trace["events"]
  assert [e["id"] for e in events] == [f"e{i}" for i in range(8)]
  assert all(a["t"] <= b["t"] for a, b in zip(events, events[1:]))
  assert events[3] == {"id": "e3", "t": events[3]["t"], "type": "message", "agent": "writer",
                       "from": "writer", "to": "counter", "trusted": False,
                       "content_ref": store.content_ref("the quick brown fox"), "tokens": 4,
                       "turn": 0}
  edges = {(e["src"], e["dst"], e["type"]) for e in trace["edges"]}
  # orchestrator's own timeline e0 -> e1 -> e2 -> e7 is temporal; the rest are the caller's links
  assert {("e0", "e1", "temporal"), ("e1", "e2", "temporal"), ("e2", "e7", "temporal"),
          ("e4", "e6", "temporal"), ("e3", "e4", "message"), ("e4", "e5", "tool_dependency"),
          ("e5", "e6", "return"), ("e6", "e7", "aggregate")} <= edges
  assert len(edges) == len(trace["edges"]) == 12
  assert trace["costs"]["tokens"] == 5 + 4 + 12
  assert (trace["costs"]["tool_calls"], trace["costs"]["messages"]) == (1, 1)
  assert trace["costs"]["wall_clock_s"] >= events[-1]["t"]
  assert trace["task_id"] == "word_count/sentence=0" and trace["topology"] == "centralized"
  assert trace["rewards"] == {"team": 1.0, "agent:writer": 4 / 7, "tool": 0.5}
  refs = {e["content_ref"] for e in events if "content_ref" in e}
  assert refs == set(content) and all(store.content_ref(t) == r for r, t in content.items())


def test_logical_clock_is_deterministic(toy):
  first, _ = _episode(toy, 0, "a b c", clock="logical")
  second, _ = _episode(toy, 0, "a b c", clock="logical")
  assert [e["t"] for e in first["events"]] == list(range(8))
  first["costs"].pop("wall_clock_s"), second["costs"].pop("wall_clock_s")
  assert first == second


def _minimal() -> dict:
  return {"trace_id": "t", "task_id": "word_count/0",
          "events": [{"id": "a", "t": 0, "type": "message", "agent": "x"},
                     {"id": "b", "t": 1.5, "type": "return", "agent": "y", "custom": [1, 2]}],
          "edges": [{"src": "a", "dst": "b", "type": "causal"}],
          "rewards": {"team": 1}, "costs": {"tokens": 0, "wall_clock_s": 0, "gpu_s": 3.0}}


def test_minimal_trace_is_valid():
  schema.validate(_minimal())  # extra event keys and extra numeric cost entries are allowed


@pytest.mark.parametrize("mutate, path, words", [
    (lambda t: t.update(content={}), "$", "'content' was unexpected"),
    (lambda t: t["costs"].update(tokens=-1), "$.costs.tokens", "less than the minimum of 0"),
    (lambda t: t["costs"].pop("wall_clock_s"), "$.costs", "'wall_clock_s' is a required"),
    (lambda t: t["events"][1].update(type="chat"), "$.events[1].type", "'chat' is not one of"),
    (lambda t: t["events"][0].update(t=-0.1), "$.events[0].t", "less than the minimum of 0"),
    (lambda t: t["events"][0].pop("agent"), "$.events[0]", "'agent' is a required"),
    (lambda t: t["events"][0].update(trusted="yes"), "$.events[0].trusted", "not of type"),
    (lambda t: t.update(events=[], edges=[]), "$.events", "should be non-empty"),
    (lambda t: t["edges"][0].update(weight=1), "$.edges[0]", "'weight' was unexpected"),
    (lambda t: t["edges"][0].update(type="next"), "$.edges[0].type", "'next' is not one of"),
    (lambda t: t["edges"][0].update(dst="zzz"), "$.edges[0].dst", "unknown event id 'zzz'"),
    (lambda t: t["events"][1].update(id="a"), "$.events[1].id", "duplicate event id 'a'"),
    (lambda t: t["rewards"].update(team="high"), "$.rewards.team", "not of type 'number'"),
    (lambda t: t.update(topology="star"), "$.topology", "'star' is not one of"),
    (lambda t: t.update(trace_id=""), "$.trace_id", "should be non-empty"),
    (lambda t: t["rewards"].update(team=json.loads("1e999")), "$.rewards.team", "non-finite"),
    (lambda t: t["costs"].update(gpu_s=float("nan")), "$.costs.gpu_s", "non-finite"),
    (lambda t: t["events"][1].update(custom=[1, -math.inf]), "$.events[1].custom[1]",
     "non-finite"),
])
def test_invalid_traces_are_rejected(mutate, path, words):
  trace = _minimal()
  mutate(trace)
  with pytest.raises(schema.TraceValidationError) as info:
    schema.validate(trace)
  assert info.value.path == path
  assert str(info.value).startswith(f"invalid trace '{trace['trace_id']}': at {path}: ")
  assert words in str(info.value)


def test_recorder_rejects_bad_input():
  rec = recorder_lib.TraceRecorder("word_count", "0")
  first = rec.event("message", "a")
  with pytest.raises(ValueError, match="unknown event type 'chat'"):
    rec.event("chat", "a")
  with pytest.raises(ValueError, match="unknown event 'e9'"):
    rec.event("return", "b", after=[("e9", "causal")])
  with pytest.raises(ValueError, match="unknown edge type 'next'"):
    rec.edge(first, first, "next")
  with pytest.raises(ValueError, match=r"clash with schema fields"):
    rec.event("message", "a", **{"from": "a"})
  with pytest.raises(ValueError, match="reward 'team' must be a finite number"):
    rec.set_reward("team", float("nan"))
  with pytest.raises(ValueError, match="unknown topology 'ring'"):
    recorder_lib.TraceRecorder("word_count", "0", topology="ring")
  trace, _ = rec.finish()
  assert [e["id"] for e in trace["events"]] == ["e0"]  # failed calls left nothing behind
  with pytest.raises(RuntimeError, match="is finished"):
    rec.event("message", "a")


def test_write_read_round_trip(trace_file, episodes, toy):
  assert [t for _, t in store.iter_traces(trace_file)] == [trace for trace, _ in episodes]
  content = store.read_content(trace_file)
  assert content == {ref: text for _, c in episodes for ref, text in c.items()}
  lines = store.content_path(trace_file).read_text(encoding="utf-8").splitlines()
  assert len(lines) == len(content)  # the shared prompt "Count the words." is stored once
  with store.TraceWriter(trace_file) as writer:  # appending later still stores each text once
    writer.write(*_episode(toy, 3, "the quick brown fox"))
  assert len(list(store.iter_traces(trace_file))) == 4
  assert len(store.content_path(trace_file).read_text(encoding="utf-8").splitlines()) == len(lines)


def test_writer_refuses_bad_traces(tmp_path, episodes):
  trace, content = copy.deepcopy(episodes[0])
  with store.TraceWriter(tmp_path / "t.jsonl") as writer:
    broken = dict(trace, extra=1)
    with pytest.raises(schema.TraceValidationError, match="'extra' was unexpected"):
      writer.write(broken, content)
    ref = trace["events"][0]["content_ref"]
    with pytest.raises(ValueError, match=f"refers to {ref} but no text was given"):
      writer.write(trace, {k: v for k, v in content.items() if k != ref})
    with pytest.raises(ValueError, match="hashes to"):
      writer.write(trace, dict(content, **{ref: "something else"}))
    trace["rewards"]["team"] = float("inf")
    with pytest.raises(ValueError, match="non-finite number"):
      writer.write(trace, content)
  assert not list(store.iter_traces(tmp_path / "t.jsonl"))


def test_writer_refuses_non_finite_numbers_validate_does_not_see(tmp_path):
  """An event's free-form field may hold a tuple, which `validate` does not walk into: the
  writer's own JSON check still refuses its infinity with one line."""
  rec = recorder_lib.TraceRecorder("t", "{}", topology="unknown", clock="logical")
  rec.event("orchestrator_decision", "orchestrator", scores=(1.0, float("inf")))
  trace, content = rec.finish()
  schema.validate(trace)
  with store.TraceWriter(tmp_path / "t.jsonl") as writer:
    with pytest.raises(ValueError, match=f"trace '{trace['trace_id']}' holds a non-finite number"):
      writer.write(trace, content)
  assert not list(store.iter_traces(tmp_path / "t.jsonl"))


def test_replay_reproduces_rewards_exactly(trace_file):
  content = store.read_content(trace_file)
  for _, trace in store.iter_traces(trace_file):
    assert replay_lib.replay(trace, content) == []


def test_replay_detects_tampered_rewards(trace_file):
  content = store.read_content(trace_file)
  trace = [t for _, t in store.iter_traces(trace_file)][1]
  trace["rewards"]["agent:writer"] = np.nextafter(trace["rewards"]["agent:writer"], 1.0)
  trace["rewards"]["bonus"] = 1.0
  del trace["rewards"]["tool"]
  found = {m.what: m for m in replay_lib.replay(trace, content)}
  assert set(found) == {"agent:writer", "bonus", "tool"}
  assert found["agent:writer"].recomputed == 6 / 7 and found["agent:writer"].recorded != 6 / 7
  assert "no such reward" in found["tool"].detail and "does not produce" in found["bonus"].detail


def test_replay_detects_tampered_content(trace_file):
  trace = [t for _, t in store.iter_traces(trace_file)][0]
  content = store.read_content(trace_file)
  message = next(e for e in trace["events"] if e["type"] == "message")
  content[message["content_ref"]] = "the quick brown fox jumps"  # writer now seems to say 5 words
  found = replay_lib.replay(trace, content)
  assert {m.what for m in found} == {message["content_ref"], "team", "agent:writer"}
  assert "altered" in str(next(m for m in found if m.what == message["content_ref"]))
  del content[message["content_ref"]]
  found = replay_lib.replay(trace, content)
  assert {m.what for m in found} == {message["content_ref"], "replayer"}
  assert "missing from the store" in str(found[0]) and "AttributeError" in found[1].detail


def test_replay_needs_a_registered_task(episodes):
  trace, content = copy.deepcopy(episodes[0])
  trace["task_id"] = "unknown_task/0"
  with pytest.raises(ValueError, match="unknown replayer 'unknown_task'"):
    replay_lib.replay(trace, content)
  with pytest.raises(ValueError, match="already registered"):
    replay_lib.REPLAYERS.register("word_count", lambda t, c: {})


def test_stats_match_hand_computation(episodes):
  traces = [trace for trace, _ in episodes]
  summary = stats.summarize(traces)
  assert summary["episodes"] == 3 and summary["events"] == 24
  assert summary["tasks"] == {"word_count": 3} and summary["topologies"] == {"centralized": 3}
  assert summary["events_by_type"] == {"aggregate": 3, "message": 3, "orchestrator_decision": 3,
                                       "return": 3, "spawn": 6, "tool_call": 3, "tool_result": 3}
  assert summary["edges_by_type"]["temporal"] == 3 * 4
  assert summary["events_by_agent"] == {"counter": 6, "orchestrator": 12, "python": 3, "writer": 3}
  assert summary["mean_events_per_episode"] == 8
  words = np.array([4, 6, 3])
  np.testing.assert_allclose(summary["rewards"]["agent:writer"]["mean"], np.mean(words / 7))
  assert summary["rewards"]["team"] == {"mean": 2 / 3, "min": 0.0, "max": 1.0, "count": 3}
  assert summary["costs"]["tokens"]["total"] == 3 * (5 + 12) + words.sum()
  assert summary["costs"]["tool_calls"]["total"] == 3 and summary["costs"]["messages"]["mean"] == 1
  assert summary["metrics"]["task_success"]["mean"] == 2 / 3
  spans = [t["events"][-1]["t"] - t["events"][0]["t"] for t in traces]
  np.testing.assert_allclose(summary["mean_episode_span_t"], np.mean(spans))
  text = stats.format_summary(summary)
  assert "episodes: 3" in text and "reward team: mean=0.6667" in text
  json.dumps(summary)


def _stop_episode(task: str, decisions: list[tuple[str, bool]], solved: bool, cap: int = 3):
  """A learned-stop trace: (decision, answer right) after each round, as the workflow records."""
  events = [{"id": f"e{i}", "t": float(i), "type": "orchestrator_decision", "agent": "coordinator",
             "decision": d, "correct": right, "round": i + 1, "rounds_left": cap - i - 1}
            for i, (d, right) in enumerate(decisions)]
  trace = dict(_minimal(), task_id=task, events=events, edges=[], metrics={
      "task_success": float(solved)})
  schema.validate(trace)
  return trace


def test_premature_stops_are_judged_by_siblings_that_continued():
  """Task a: a wrong stop after round 1 while a sibling continued from a wrong round 1 and was
  right in round 2: premature. Task b: the sibling that continued stayed wrong: not premature;
  its own wrong stop after round 2 has no sibling that continued from round 2: unjudged. Task c:
  a wrong stop with no sibling: unjudged. A right stop and the last round are never wrong stops."""
  traces = [
      _stop_episode("math/a", [("stop", False)], False),
      _stop_episode("math/a", [("continue", False), ("stop", True)], True),
      _stop_episode("math/b", [("stop", False)], False),
      _stop_episode("math/b", [("continue", False), ("stop", False)], False),
      _stop_episode("math/c", [("stop", False)], False),
      _stop_episode("math/c", [("continue", True), ("continue", True)], True),
  ]
  got = stats.summarize(traces)["decisions"]
  want = dict(decisions=9, stop=5, wrong_stops=4, premature_stops=1, wrong_stops_unjudged=2,
              continues_from_wrong=2, later_round_fixes=1, over_runs=2)
  assert {k: got[k] for k in want} == want
  assert got["premature_rate"] == 1 / 5 and got["over_run_rate"] == 2 / 4


def _cli(*args: str, toy_dir: pathlib.Path) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_REPO), str(toy_dir)]))
  return subprocess.run([sys.executable, "-m", "experiments.traces", *args], cwd=_REPO, env=env,
                        capture_output=True, text=True, timeout=60, check=False)


def test_cli(trace_file, toy_dir, tmp_path):
  ok = _cli("validate", str(trace_file), toy_dir=toy_dir)
  assert ok.returncode == 0 and ok.stdout.strip() == f"{trace_file}: 3 traces valid"
  summary = _cli("stats", str(trace_file), "--json", toy_dir=toy_dir)
  assert summary.returncode == 0 and json.loads(summary.stdout)["episodes"] == 3
  replayed = _cli("replay", str(trace_file), "--module", "toy_word_count", toy_dir=toy_dir)
  assert replayed.returncode == 0, replayed.stderr
  assert replayed.stdout.strip() == f"{trace_file}: 3 traces replayed, 0 mismatches"

  lines = trace_file.read_text(encoding="utf-8").splitlines()
  tampered = json.loads(lines[1])
  tampered["rewards"]["team"] = 0.0
  trace_file.write_text("\n".join([lines[0], json.dumps(tampered), lines[2]]) + "\n")
  replayed = _cli("replay", str(trace_file), "--module", "toy_word_count", toy_dir=toy_dir)
  assert replayed.returncode == 1
  assert "MISMATCH trace 'wc-1': team: recorded 0.0, recomputed 1.0" in replayed.stdout

  tampered["costs"]["tokens"] = -3
  trace_file.write_text("\n".join([lines[0], json.dumps(tampered)]) + "\n")
  for command in ("validate", "stats", "replay"):
    bad = _cli(command, str(trace_file), "--module", "toy_word_count", toy_dir=toy_dir) \
        if command == "replay" else _cli(command, str(trace_file), toy_dir=toy_dir)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr == (f"error: {trace_file}:2: invalid trace 'wc-1': at $.costs.tokens: "
                          "-3 is less than the minimum of 0\n")

  missing = _cli("validate", str(tmp_path / "nope.jsonl"), toy_dir=toy_dir)
  assert missing.returncode == 1
  assert missing.stderr == f"error: {tmp_path / 'nope.jsonl'}: no such trace file\n"
  garbage = tmp_path / "garbage.jsonl"
  garbage.write_text("{not json\n")
  bad = _cli("validate", str(garbage), toy_dir=toy_dir)
  assert bad.returncode == 1 and bad.stderr.startswith(f"error: {garbage}:1: not valid JSON")
  unknown = _cli("replay", str(trace_file), "--module", "no_such_module_xyz", toy_dir=toy_dir)
  assert unknown.returncode == 1 and "cannot import replayer module 'no_such_module_xyz'" in \
      unknown.stderr
  assert _cli("--help", toy_dir=toy_dir).returncode == 0
  assert _cli("frobnicate", toy_dir=toy_dir).returncode == 2


def test_cli_one_line_errors_for_damaged_files(trace_file, toy_dir, tmp_path):
  lines = trace_file.read_text(encoding="utf-8").splitlines()
  # A reward of 1e999 is read by Python's json as infinity; validate must refuse it.
  huge = tmp_path / "huge.jsonl"
  huge.write_text(lines[0].replace('"team":', '"team":1e999,"was":', 1) + "\n")
  assert '"team":1e999' in huge.read_text()
  result = _cli("validate", str(huge), toy_dir=toy_dir)
  assert result.returncode == 1 and "Traceback" not in result.stderr
  assert result.stderr == (f"error: {huge}:1: invalid trace 'wc-0': at $.rewards.team: "
                           "non-finite number; expected a finite number\n")
  # Invalid UTF-8 on line 2: the file and line are named.
  broken = tmp_path / "broken.jsonl"
  broken.write_bytes(lines[0].encode() + b"\n" + b'{"trace_id": "\xff\xfe"}\n')
  result = _cli("validate", str(broken), toy_dir=toy_dir)
  assert result.returncode == 1 and "Traceback" not in result.stderr
  assert result.stderr.startswith(f"error: {broken}:2: not valid UTF-8")
  assert len(result.stderr.splitlines()) == 1
  # Replay without the content store blames the missing store, not a replayer.
  lonely = tmp_path / "lonely.jsonl"
  lonely.write_text(trace_file.read_text(encoding="utf-8"), encoding="utf-8")
  result = _cli("replay", str(lonely), "--module", "toy_word_count", toy_dir=toy_dir)
  assert result.returncode == 1 and result.stdout == ""
  assert result.stderr == (f"error: {lonely}: its content store {lonely}.content.jsonl is missing; "
                           "replay recomputes rewards from the stored texts, expected beside the "
                           "trace file\n")
  # A directory given as the trace file.
  result = _cli("stats", str(tmp_path), toy_dir=toy_dir)
  assert result.stderr == f"error: {tmp_path}: is a directory; expected a JSONL trace file\n"
