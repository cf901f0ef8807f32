"""`experiments.traces show`: an episode of the rollout engine printed per agent and turn, with
the prompts the policy was really given, its replies, the env's parse and the rewards the rollout
credited; bad episode numbers end in one line."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from marl_jax.traces.store import TraceWriter
from marl_jax.workflows import registry
from marl_jax.workflows import rollout as R

_REPO = pathlib.Path(__file__).resolve().parents[2]
PROBLEM = {"question": "What is 3/4 + 1/4 + 5?", "answer": "6"}
REPLIES = {"solver": ["I think it is 5.", "Recounting: 3/4 + 1/4 = 1, so \\boxed{6}."],
           "verifier": ["The answer is missing.\n<verify>reject</verify>"]}


def _episode_file(tmp_path: pathlib.Path) -> tuple[pathlib.Path, list[R.Request], R.RolloutResult]:
  """A Dr. MAS math episode (solver, verifier, solver) from scripted replies, written as a trace
  file; also the requests the policy received, in order."""
  queues = {agent: list(texts) for agent, texts in REPLIES.items()}
  seen: list[R.Request] = []

  def generate(requests, policy_id, params):
    del policy_id, params
    seen.extend(requests)
    return [R.Generation(queues[r.agent].pop(0)) for r in requests]

  problems = [R.Problem("math", {"problem": PROBLEM, "workflow": "drmas"}, 0)]
  result = R.rollout(problems, registry.workflow_spec("math", "drmas"), generate, None,
                     R.RolloutConfig(k=1, trace_clock="logical"))
  path = tmp_path / "eval.jsonl"
  with TraceWriter(path) as writer:
    for episode in result.episodes:
      writer.write(episode.trace, episode.content)
  return path, seen, result


def _show(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(_REPO))
  return subprocess.run([sys.executable, "-m", "experiments.traces", "show", *args], cwd=_REPO,
                        env=env, capture_output=True, text=True, timeout=120, check=False)


def test_show_prints_prompts_replies_parses_and_rewards(tmp_path):
  path, seen, result = _episode_file(tmp_path)
  shown = _show(str(path), "--episode=0", "--prompt_chars=80")
  assert shown.returncode == 0, shown.stderr
  out = shown.stdout
  blocks = out.split("\n--- ")[1:]
  assert len(blocks) == len(seen) == 3
  for block, request, sample in zip(blocks, seen, result.samples):
    assert block.startswith(f"turn {sample.turn}, {request.agent} (")
    user = request.messages[-1]["content"]
    tail = ("..." if len(user) > 80 else "") + user[-80:]
    indented = "\n".join("    " + line for line in tail.splitlines())
    assert f"prompt:\n{indented}\n" in block  # the prompt's end, as the policy received it
    reply = REPLIES[request.agent][sum(r.agent == request.agent for r in
                                       seen[:seen.index(request)])]
    assert "reply:\n" + "\n".join("    " + line for line in reply.splitlines()) in block
    assert f"\nreward: {sample.reward:g}" in block
  parses = [json.loads(line[len("parsed: "):]) for line in out.splitlines()
            if line.startswith("parsed: ")]
  assert [p.get("answer") for p in parses] == [None, None, "6"]  # no \boxed, verifier, boxed
  assert parses[1]["verdict"] == "reject" and parses[0]["format_error"] is True
  rewards = result.episodes[0].rewards
  assert rewards["team"] == 1.0  # the episode ends solved
  assert "\nrewards: " + ", ".join(f"{k}={v:g}" for k, v in sorted(rewards.items())) + "\n" in out
  assert any(len(r.messages[-1]["content"]) > 80 for r in seen)  # some prompt was cut


def test_show_refuses_an_episode_outside_the_file(tmp_path):
  path, _, _ = _episode_file(tmp_path)
  shown = _show(str(path), "--episode=1")
  assert shown.returncode == 1 and shown.stdout == ""
  assert shown.stderr == (f"error: --episode=1: {path} holds 1 traces; expected 0 <= N < 1\n")


def test_the_content_store_beside_a_trace_file_shows_that_file(tmp_path):
  """`show FILE.content.jsonl` (the side file every trace file has) shows FILE; without FILE it
  says which file it wanted, in one line."""
  path, _, _ = _episode_file(tmp_path)
  side = f"{path}.content.jsonl"
  shown, direct = _show(side, "--prompt_chars=0"), _show(str(path), "--prompt_chars=0")
  assert shown.returncode == 0 and shown.stdout == direct.stdout, shown.stderr
  assert shown.stderr == f"{side} is a content store: reading its trace file {path}\n"
  os.rename(path, tmp_path / "moved.jsonl")
  missing = _show(side)
  assert missing.returncode == 1 and missing.stderr == (
      f"error: {side} is the content store of the trace file {path}, which is missing; expected "
      "a trace file (FILE, not FILE.content.jsonl)\n")
