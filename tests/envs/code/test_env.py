"""Code tasks: HumanEval through the code env (canonical solutions pass every test, wrong ones do
not), the MAGRPO aux/main reward against hand-computed values, the AT-GRPO coder/tester loop
through the rollout engine, loaders, and hostile programs.

All 164 HumanEval canonical solutions take ~28 s through the harness on the 2-core dev machine
(two sandboxes at a time); set MARL_FULL_HUMANEVAL=1 to run them all here."""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from marl_jax.envs.code import env as code
from marl_jax.envs.code import harness as code_harness
from marl_jax.envs.code import magrpo as code_magrpo
from marl_jax.envs.code import data as code_data
from marl_jax.sandbox import runner as sandbox
from marl_jax.envs.code.env import CodeEnv, CodeProblem
from marl_jax.workflows import registry, replay
from marl_jax.workflows import rollout as R

FAST = code_harness.ExecLimits(case_timeout_s=0.5, load_timeout_s=1.0, total_timeout_s=4.0,
                               memory_mb=256)
HUMANEVAL = code_data.humaneval()


def _fenced(code: str) -> str:
  return f"Here it is.\n```python\n{code}\n```"


def _humaneval_ids() -> list[int]:
  if os.environ.get("MARL_FULL_HUMANEVAL") == "1":
    return list(range(len(HUMANEVAL)))
  return sorted(random.Random(0).sample(range(len(HUMANEVAL)), 20))


def test_humaneval_ships_164_problems():
  assert len(HUMANEVAL) == 164
  assert sum(len(p["tests"]) for p in HUMANEVAL) > 1000


def test_humaneval_canonical_solutions_pass_and_wrong_ones_do_not():
  for i in _humaneval_ids():
    problem = HUMANEVAL[i]
    env = registry.make_env("code", humaneval_index=i, workflow="single")
    result = env.step("coder", _fenced(problem["solution"]))
    assert result.rewards == {"coder": 1.0}, problem["id"]
    assert env.solved and result.done
    wrong = CodeEnv(CodeProblem.from_dict(problem), workflow="single", limits=FAST)
    result = wrong.step("coder", _fenced(problem["prompt"] + "    return None\n"))
    assert result.rewards["coder"] < 1.0 and not wrong.solved, problem["id"]


SQUARES = CodeProblem.from_dict({
    "question": "sum of squares", "style": "function", "entry_point": "sum_of_squares",
    "prompt": "def sum_of_squares(a, b):\n    \"\"\"Return a*a + b*b.\"\"\"\n",
    "tests": ["assert candidate(1, 2) == 5", "assert candidate(0, 0) == 0",
              "assert candidate(3, 4) == 25", "assert candidate(-1, 1) == 2"],
    "test_setup": "candidate = sum_of_squares"})
AUX_SQUARE = _fenced("def aux(x):\n    return x * x")
AUX_BOTH = _fenced("def aux(a, b):\n    return a * a + b * b")
HEAD = "def sum_of_squares(a, b):\n"

# (aux reply, main body, hand-computed reward). Level values: aux 0.4, main 0.6, parse 0.5,
# tests 1.0 x ratio; bonus block (>= 1 pass, aux defined, main calls aux): +0.5, +1.0 unless a
# thin wrapper, -0.5 if an aux value is ignored.
MAGRPO_CASES = {
    "collaborates": (AUX_SQUARE, "    return aux(a) + aux(b)", 0.4 + 0.6 + 0.5 + 1 + 0.5 + 1),
    "thin_return": (AUX_BOTH, "    return aux(a, b)", 0.4 + 0.6 + 0.5 + 1 + 0.5),
    "thin_assign": (AUX_BOTH, "    r = aux(a, b)\n    return r", 0.4 + 0.6 + 0.5 + 1 + 0.5),
    "thin_docstring": (AUX_BOTH, '    """Delegate."""\n    return aux(a, b)',
                       0.4 + 0.6 + 0.5 + 1 + 0.5),
    "computed_args": (AUX_BOTH, "    return aux(a, b + 0)", 0.4 + 0.6 + 0.5 + 1 + 0.5 + 1),
    "no_aux": ("I cannot help.", "    return a * a + b * b", 0.6 + 0.5 + 1),
    "main_missing": (AUX_SQUARE, None, 0.4),
    "main_without_return": (AUX_SQUARE, "    print(a)", 0.4),
    "syntax_error": (AUX_SQUARE, "    return a * a + (b * b", 0.4 + 0.6),
    "ignores_value": (AUX_SQUARE, "    aux(a)\n    return a * a + b * b",
                      0.4 + 0.6 + 0.5 + 1 + 0.5 + 1 - 0.5),
    "half_pass": (AUX_SQUARE, "    return aux(a) + b", 0.4 + 0.6 + 0.5 + 0.5 + 0.5 + 1),
    "no_pass": (AUX_SQUARE, "    return aux(a) - 1000", 0.4 + 0.6 + 0.5),
    "aux_without_return": (_fenced("def aux(x):\n    print(x)"),
                           "    aux(a)\n    return a * a + b * b", 0.6 + 0.5 + 1),
    "looping_main": (AUX_SQUARE, "    while True:\n        aux(a)\n    return 0", 0.4 + 0.6 + 0.5),
}


@pytest.mark.parametrize("name", sorted(MAGRPO_CASES))
def test_magrpo_reward_matches_hand_computed(name):
  aux, body, expected = MAGRPO_CASES[name]
  main = "def other(a, b):\n    return 0" if body is None else HEAD + body
  reward = code_magrpo.aux_main_reward(aux, _fenced(main), SQUARES, FAST)
  assert reward.total == pytest.approx(expected), reward


def test_magrpo_env_through_rollout_on_humaneval():
  problem = HUMANEVAL[2]
  replies = {"aux": _fenced("def aux(x):\n    return x"), "main": _fenced(problem["solution"])}

  def generate(requests, policy_id, params):
    for r in requests:  # parallel agents: main never sees the aux agent's reply
      assert r.agent == "aux" or "def aux(x)" not in r.messages[1]["content"]
    return [R.Generation(replies[r.agent]) for r in requests]

  spec = registry.workflow_spec("code", "magrpo", per_role=True)
  res = R.rollout([R.Problem("code", {"humaneval_index": 2, "workflow": "magrpo"}, 0)], spec,
                  generate, None, R.RolloutConfig(k=2, trace_clock="logical"))
  # aux defined 0.4 + main 0.6 + parses 0.5 + all tests 1.0; main does not call aux: no bonus.
  assert [(s.agent, s.policy_id, s.reward) for s in res.samples] == [
      ("aux", 0, 2.5), ("aux", 0, 2.5), ("main", 1, 2.5), ("main", 1, 2.5)]
  episode = res.episodes[0]
  assert episode.solved
  assert replay.recompute_rewards(episode.trace, episode.content) == episode.rewards
  env = registry.make_env("code", humaneval_index=2, workflow="magrpo")
  assert problem["prompt"] in env.observe("main").user


ADD = {"question": "Read two integers and print their sum.", "style": "stdio",
       "tests": [{"input": "1 2", "output": "3"}, {"input": "-5 5", "output": "0"},
                 {"input": "10 20\n", "output": "30\n"}], "solution": None}
TESTS_REPLY = ("**Test Input:**\n```\n2 2\n```\n**Test Output:**\n```\n4\n```\n"
               "**Test Input:**\n```\n7 -1\n```\n**Test Output:**\n```\n6\n```")


def test_atgrpo_code_coder_tester_loop():
  replies = {"coder": [_fenced("print(-1)"), _fenced("a, b = map(int, input().split())\n"
                                                    "print(a + b)")],
             "tester": [TESTS_REPLY, TESTS_REPLY]}

  def generate(requests, policy_id, params):
    return [R.Generation(replies[r.agent].pop(0)) for r in requests]

  res = R.rollout([R.Problem("code", {"problem": ADD, "workflow": "atgrpo"}, 0)],
                  registry.workflow_spec("code", "atgrpo"), generate, None,
                  R.RolloutConfig(k=1, trace_clock="logical"))
  # turn 0: wrong code fails the gt tests (0) and the tester's tests (0 + 0); turn 1: right code
  # passes both: coder 1, tester 1 + 1; the generated tests pass, so the episode ends.
  assert [(s.agent, s.turn, s.reward) for s in res.samples] == [
      ("coder", 0, 0.0), ("tester", 0, 0.0), ("coder", 1, 1.0), ("tester", 1, 2.0)]
  assert "test 1: fail" in res.samples[2].messages[1]["content"]
  assert res.episodes[0].solved
  episode = res.episodes[0]
  assert replay.recompute_rewards(episode.trace, episode.content) == episode.rewards


def test_atgrpo_code_function_style_tests():
  problem = HUMANEVAL[0]
  env = registry.make_env("code", humaneval_index=0)
  assert env.step("coder", _fenced(problem["solution"])).rewards == {"coder": 1.0}
  tests = _fenced("assert has_close_elements([1.0, 2.0], 0.5) == False\n"
                  "assert has_close_elements([1.0, 1.1], 0.5) == True\n"
                  "assert has_close_elements([1.0], 0.5) == True")
  result = env.step("tester", tests)
  assert result.rewards == {"tester": pytest.approx(2 / 3 + 1.0)} and not result.done
  assert env.step("coder", "no code").rewards == {"coder": 0.0}
  assert not env.solved


def test_generated_test_parsing():
  assert code.parse_generated_tests(TESTS_REPLY, "stdio") == (
      {"input": "2 2\n", "output": "4\n"}, {"input": "7 -1\n", "output": "6\n"})
  assert code.parse_generated_tests("Output:\n```\n4\n```", "stdio") == ()
  reply = _fenced("import math\nx = 2\nassert f(x) == 4\nassert f(1) == 1")
  assert code.parse_generated_tests(reply, "function") == (
      "import math", "x = 2", "assert f(x) == 4", "assert f(1) == 1")
  assert code.parse_generated_tests(_fenced("x = (1"), "function") == ()
  start = time.monotonic()  # floods are parsed in linear time
  assert code.parse_generated_tests("input\n```\n" * 20_000, "stdio") == ()
  assert time.monotonic() - start < 1.0


def test_loaders_and_generated_stdio(tmp_path):
  mbpp = tmp_path / "mbpp.jsonl"
  mbpp.write_text(json.dumps({"task_id": 7, "text": "Double x.", "code": "def dbl(x):\n"
                              "    return 2 * x", "test_list": ["assert dbl(2) == 4",
                                                              "assert dbl(0) == 0"]}) + "\n")
  apps = tmp_path / "apps.jsonl"
  apps.write_text(json.dumps({"problem_id": 1, "question": "Echo.", "input_output": json.dumps(
      {"inputs": ["hi\n"], "outputs": ["hi\n"]}), "solutions": json.dumps(["print(input())"])}))
  for path, fmt in ((mbpp, "mbpp"), (apps, "apps")):
    row = code_data.load_code(str(path), fmt)[0]
    env = registry.make_env("code", path=str(path), fmt=fmt, index=0, workflow="single")
    assert env.step("coder", _fenced(row["solution"])).rewards == {"coder": 1.0}
  for seed in range(5):
    row = code_data.stdio_problem(seed)
    assert row == code_data.stdio_problem(seed)
    env = registry.make_env("code", stdio_seed=seed, workflow="single")
    assert env.step("coder", _fenced(row["solution"])).rewards == {"coder": 1.0}


HOSTILE = {
    "infinite_loop": "while True:\n    pass",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                 "        pass",
    "memory_bomb": "x = []\nwhile True:\n    x.append(bytearray(50 * 2**20))",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "forged_results": "import os\nfor i in range(9):\n    print(f'x {i} pass')\n"
                      "    os.write(1, f'x {i} pass\\n'.encode())",
    "hard_exit": "import os\nos._exit(0)",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("style", ["stdio", "function"])
def test_hostile_programs_fail_without_crashing(kind, style):
  if kind in ("fork_bomb", "kill_parent") and sandbox.detected_backend() != "bwrap":
    pytest.skip("needs the bwrap sandbox (PID namespace, enforced process limit)")
  problem = CodeProblem.from_dict(ADD) if style == "stdio" else SQUARES
  env = CodeEnv(problem, workflow="single", limits=FAST)
  result = env.step("coder", _fenced(HOSTILE[kind]))
  assert result.rewards == {"coder": 0.0} and not env.solved
  if style == "stdio":
    return
  main = HEAD + "    " + HOSTILE[kind].replace("\n", "\n    ") + "\n    return -1"
  reward = code_magrpo.aux_main_reward(AUX_SQUARE, _fenced(main), SQUARES, FAST)
  assert reward.pass_ratio == 0.0


def test_coder_reply_is_read_up_to_max_reply_chars():
  from marl_jax.envs.base import MAX_REPLY_CHARS
  solution = _fenced("def sum_of_squares(a, b):\n    return a * a + b * b")
  inside = " " * (MAX_REPLY_CHARS - len(solution)) + solution
  past = " " + inside  # the closing fence now lies past the cut: the block runs to the cut
  beyond = " " * MAX_REPLY_CHARS + solution  # the fence starts past the cut: no code
  for reply, reward, has_code in [(inside, 1.0, True), (past, 0.0, True), (beyond, 0.0, False),
                                  (None, 0.0, False)]:
    env = CodeEnv(SQUARES, workflow="single", limits=FAST)
    result = env.step("coder", reply)
    assert result.rewards == {"coder": reward} and result.info["format_error"] == (not has_code)
