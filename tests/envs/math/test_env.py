"""Math tasks: the answer checker against hand-labelled cases, extraction, the word-problem
generator (re-derived independently), file loaders, and the AT-GRPO / Dr. MAS / MARFT envs through
the rollout engine, including hostile tool programs."""

from __future__ import annotations

import fractions
import json
import os
import re
import time
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marl_jax.envs.math import answers as math_answers
from marl_jax.envs.math import data as math_data
from marl_jax.envs.math import env as math_env
from marl_jax.envs.math import orchestration_spawn
from marl_jax.sandbox import runner as sandbox
from marl_jax.workflows import registry, replay
from marl_jax.workflows import rollout as R

# (prediction, gold, equivalent?) labelled by hand.
CASES = [
    ("42", "42", True), ("42.0", "42", True), ("0.5", "\\frac{1}{2}", True),
    ("1/2", "\\frac12", True), ("\\dfrac{3}{4}", "0.75", True), ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("2\\sqrt2", "\\sqrt{8}", True), ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("1,000", "1000", True), ("x = 5", "5", True), ("5 \\text{ cm}", "5", True),
    ("5 inches", "5", True), ("50\\%", "50", True), ("90^\\circ", "90", True),
    ("(1, 2)", "(1,2)", True), ("\\left(1,2\\right)", "(1,2)", True), ("2, 3", "3, 2", True),
    ("\\{1,2\\}", "\\{2,1\\}", True), ("x^2+2x+1", "(x+1)^2", True),
    ("\\sqrt[3]{27}", "3", True), ("2^{10}", "1024", True), ("5!", "120", True),
    ("-\\frac{1}{2}", "-0.5", True), ("\\frac{-1}{2}", "-\\frac12", True),
    ("\\text{Evelyn}", "Evelyn", True), ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("2\\cdot 3", "6", True), ("\\$5", "5", True), (".5", "1/2", True),
    ("e^{i\\pi}", "-1", True), ("3+2i", "2i+3", True), ("\\frac{2}{4}", "\\frac{1}{2}", True),
    ("3.14", "\\pi", False), ("0.333", "\\frac13", False), ("(1,2)", "[1,2]", False),
    ("x^2+1", "(x+1)^2", False), ("7", "8", False), ("10 m", "10", False),
    ("2, 3", "2, 3, 4", False), ("\\frac{1}{3}", "\\frac{1}{2}", False), ("-5", "5", False),
    ("\\sqrt{2}", "1.414", False), ("Evelyn", "Evelina", False), ("", "0", False),
    ("10^{10^{10}}", "1", False), ("9^9^9", "1", False),
]


@pytest.mark.parametrize("pred,gold,expected", CASES)
def test_answer_checker_hand_labelled(pred, gold, expected):
  assert math_answers.is_equiv(pred, gold) is expected


def test_hostile_answers_are_bounded_and_never_eval():
  marker = "/tmp/marl_math_eval_marker"
  hostile = ["(" * 5000 + "1" + ")" * 5000, "9^{9^{9^{9}}}", "1" * 100_000, "2^{99999999}!",
             f"__import__('os').system('touch {marker}')", "\\frac{1}{0}", "x^{x^{x^{x}}}",
             "\\boxed{" * 300, None, "}{", "\\sqrt[0]{2}", "0^{-1}"]
  start = time.monotonic()
  for text in hostile:
    assert math_answers.is_equiv(text, "1") is False
  assert math_answers.last_boxed("\\boxed{" * 50_000) is None  # flooding reply, bounded scan
  assert math_answers.is_equiv("-" * 900 + "2", "2") is True  # signs loop, no deep recursion
  assert time.monotonic() - start < 5.0
  assert not os.path.exists(marker)


def test_extraction():
  assert math_answers.last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{\\sqrt{2}}}.") == \
      "\\frac{1}{\\sqrt{2}}"
  assert math_answers.last_boxed("\\boxed 5$ end") == "5"
  assert math_answers.last_boxed("\\fbox{x} and \\boxed{unbalanced") == "x"
  assert math_answers.last_boxed("no answer") is None
  assert math_answers.gsm8k_answer("She pays 3 + 4 = 7.\n#### 1,207") == "1207"
  assert math_answers.program_answer("step 1\n\nAnswer: 3/4\n") == "3/4"
  assert math_answers.program_answer("x\n\\boxed{12}") == "12"
  assert math_answers.program_answer("7\n[error: wall-clock timeout after 1 s]") is None
  assert math_answers.program_answer("") is None


def _rederive(question: str) -> fractions.Fraction:
  """Independent re-derivation of a generated problem's answer from its text."""
  n = [int(x) for x in re.findall(r"\d+", question)]
  if "buys" in question:
    return fractions.Fraction(n[0] + n[1] * n[2] - n[3])
  if "reads" in question:
    return fractions.Fraction(n[0] * n[1] + n[2] * n[3])
  if "keeps" in question:
    return fractions.Fraction(n[0] - n[1], n[2])
  if "spends" in question:
    return n[0] - fractions.Fraction(n[0] * n[1], n[2]) - n[3]
  return fractions.Fraction(n[0] + n[1], n[2])


def test_arithmetic_generator_is_seeded_and_exact():
  kinds = set()
  keywords = ("buys", "reads", "keeps", "spends", "mixes")
  for seed in range(300):
    problem = math_data.arithmetic_problem(seed)
    assert problem == math_data.arithmetic_problem(seed)
    expected = _rederive(problem["question"])
    assert fractions.Fraction(problem["answer"]) == expected
    assert expected >= 0
    kinds |= {k for k in keywords if k in problem["question"]}
  assert kinds == set(keywords)
  assert math_data.arithmetic_problem(1) != math_data.arithmetic_problem(2)


def test_generated_solutions_compute_the_answer():
  """Each worked solution's first expression, evaluated exactly, and its last value are the
  answer (the warm-start teaches these lines)."""
  for seed in range(300):
    problem = math_data.arithmetic_problem(seed)
    parts = [p.strip() for p in problem["solution"].split("=")]
    exact = eval(re.sub(r"\d+", lambda m: f"fractions.Fraction({m.group()})", parts[0]))
    assert exact == fractions.Fraction(problem["answer"]), (seed, problem["solution"])
    assert parts[-1] == problem["answer"]


def test_one_step_level_is_one_exact_operation():
  """`level="one_step"`: each problem is one +, - or * of the two numbers in its text (re-derived
  here from the wording), a whole number >= 0, its worked solution that one line; all three
  operations occur, and the default level is unchanged."""
  ops = {"more": lambda a, b: a + b, "gives away": lambda a, b: a - b,
         "packs": lambda a, b: a * b}
  seen = set()
  for seed in range(200):
    problem = math_data.arithmetic_problem(seed, "one_step")
    assert problem == math_data.arithmetic_problem(seed, "one_step")
    (word,) = [w for w in ops if w in problem["question"]]
    a, b = [int(x) for x in re.findall(r"\d+", problem["question"])]
    expected = ops[word](a, b)
    assert problem["answer"] == str(expected) and expected >= 0
    assert problem["solution"].endswith(f"= {expected}") and problem["solution"].count("=") == 1
    seen.add(word)
  assert seen == set(ops)
  assert math_data.arithmetic_problem(3) == math_data.arithmetic_problem(3, "multi_step")
  env = registry.make_env("math", workflow="learned_stop", seed=5, level="one_step")
  assert env.problem.question == math_data.arithmetic_problem(5, "one_step")["question"]


def test_equation_level_carries_a_check_its_answer_alone_passes():
  """`level="equation"`: a * x + b = c with a, b, c read from the wording (a boxes, b more, c in
  all; re-derived here), x a whole number; the row's check is that equation, the answer passes
  it and its neighbours do not, and the worked solution's first expression is the answer."""
  for seed in range(200):
    problem = math_data.arithmetic_problem(seed, "equation")
    assert problem == math_data.arithmetic_problem(seed, "equation")
    a, b, c = [int(v) for v in re.findall(r"\d+", problem["question"])]
    x = fractions.Fraction(c - b, a)
    assert x.denominator == 1 and problem["answer"] == str(x)
    assert problem["check"] == f"{a} * x + {b} == {c}"
    assert math_answers.satisfies(problem["check"], problem["answer"])
    assert not math_answers.satisfies(problem["check"], str(x + 1))
    assert not math_answers.satisfies(problem["check"], str(x - 1))
    first = problem["solution"].split(" = ")[0]
    assert eval(re.sub(r"\d+", lambda m: f"fractions.Fraction({m.group()})", first)) == x
  env = registry.make_env("math", workflow="spawn_checked", seed=4, level="equation")
  assert env.problem.check == math_data.arithmetic_problem(4, "equation")["check"]


def test_satisfies_substitutes_exactly_and_refuses_other_checks():
  check = "3 * x + 7 == 25"
  for candidate, expected in (("6", True), ("6.0", True), ("\\frac{12}{2}", True),
                              ("12/2", True), ("5", False), ("x = 6", True), ("six", False),
                              ("", False), (None, False), ("6, 7", False)):
    assert math_answers.satisfies(check, candidate) is expected, candidate
  assert math_answers.satisfies("(x - 1) / 2 == -x", "1/3")  # exact rationals
  assert not math_answers.satisfies("1 / (x - 2) == 1", "2")  # a division by zero fails
  for bad, message in (("3 * x + 7", "expected one equation"),
                       ("x ** 2 == 4", "outside its grammar"),
                       ("__import__('os') == 0", "outside its grammar"),
                       ("x == 1 == 1", "expected one equation"), ("x ==", "not an equation")):
    with pytest.raises(ValueError, match=message):
      math_answers.satisfies(bad, "1")


def test_level_is_refused_where_it_picks_nothing():
  with pytest.raises(ValueError, match="unknown arithmetic level 'hard'"):
    registry.make_env("math", workflow="drmas", seed=1, level="hard")
  with pytest.raises(ValueError, match="level='one_step' .* needs seed="):
    registry.make_env("math", workflow="drmas", problem={"question": "1+1?", "answer": "2"},
                      level="one_step")


@pytest.mark.parametrize("workflow", ["drmas", "learned_stop", "single"])
def test_demonstrations_solve_with_valid_formats(workflow):
  """Replying with every agent's demonstration solves each problem with no format penalty; the
  verifier's and coordinator's demonstrations judge the current answer (reject / continue while
  it is wrong)."""
  for seed in range(20):
    env = registry.make_env("math", workflow=workflow, seed=seed)
    answer = math_data.arithmetic_problem(seed)["answer"]
    steps = math_data.arithmetic_problem(seed)["solution"]
    if workflow != "single":
      assert env.demonstration("verifier") == (  # no answer yet
          f"Proposed answer: None. Checking: {steps}.\n<verify>reject</verify>")
      env.step("solver", "I think it is \\boxed{-1}.")  # wrong: answers are >= 0
      assert env.demonstration("verifier") == (
          f"Proposed answer: -1. Checking: {steps}.\n<verify>reject</verify>")
      assert math_env.verdict(env.demonstration("verifier")) == "reject"
      if workflow == "learned_stop":
        assert env.demonstration("coordinator") == "#### continue"
      env = registry.make_env("math", workflow=workflow, seed=seed)
    rewards = []
    while not env.done:
      for agent in env.agents:
        if env.done:
          break
        reply = env.demonstration(agent)
        rewards.append(env.step(agent, reply).rewards)
    assert env.solved and all(v >= 0 for r in rewards for v in r.values()), (seed, rewards)
    assert env.problem.demonstration().endswith(f"\\boxed{{{answer}}}.")
  env = registry.make_env("math", workflow="drmas", problem={"question": "1 + 1?", "answer": "2"})
  env.step("solver", "\\boxed{2}")
  assert env.demonstration("verifier") == (
      "Proposed answer: 2. Checking: the answer is 2.\n<verify>approve</verify>")
  with pytest.raises(ValueError, match="unknown agent 'critic'"):
    registry.make_env("math", workflow="drmas", seed=0).demonstration("critic")


@pytest.mark.parametrize("workflow", ["spawn", "delegate"])
def test_dispatcher_demonstrations_spread_over_every_choice(workflow):
  """The dispatcher demonstrates a valid decision picked by the question's CRC-32 (counts 1-4, or
  the 15 non-empty sets of the 4 specialists, in SPECIALISTS order), so the warm-start favours
  none; the workers' and the aggregator's demonstrations then solve the problem with no
  penalty."""
  names = list(orchestration_spawn.SPECIALISTS)
  seen = set()
  for seed in range(200):
    env = registry.make_env("math", workflow=workflow, seed=seed)
    crc = zlib.crc32(math_data.arithmetic_problem(seed)["question"].encode())
    if workflow == "spawn":
      expected = tuple(f"worker_{i}" for i in range(1, crc % 4 + 2))
    else:
      expected = tuple(n for i, n in enumerate(names) if (1 + crc % 15) >> i & 1)
    reply = env.demonstration("dispatcher")
    result = env.step("dispatcher", reply)
    assert env.spawned == expected and not result.info["format_error"], (seed, reply)
    seen.add(expected)
    rewards = [result.rewards]
    for agent in (*expected, "aggregator"):
      rewards.append(env.step(agent, env.demonstration(agent)).rewards)
    assert env.solved and all(v == 0.0 for r in rewards for v in r.values()), (seed, rewards)
  assert len(seen) == (4 if workflow == "spawn" else 15)


def test_mistakes_are_wrong_results_in_the_demonstration_shape():
  """The solver's mistake is the worked solution with its last value and boxed answer moved by
  +-1, +-2 or +-10: wrong, and told apart from the demonstration only by the arithmetic."""
  offsets = set()
  for seed in range(100):
    env = registry.make_env("math", workflow="learned_stop", seed=seed)
    problem = math_data.arithmetic_problem(seed)
    mistake = env.mistake("solver")
    wrong = math_answers.last_boxed(mistake)
    offset = fractions.Fraction(wrong) - fractions.Fraction(problem["answer"])
    assert offset in (1, -1, 2, -2, 10, -10) and not env.problem.correct(wrong), (seed, mistake)
    offsets.add(offset)
    steps = problem["solution"]
    assert mistake == f"{steps[:-len(problem['answer'])]}{wrong}\nThe answer is \\boxed{{{wrong}}}."
    assert env.mistake("verifier") is None and env.mistake("coordinator") is None
  assert len(offsets) == 6
  no_steps = math_env.MathProblem("What is 7 / 2?", "7/2")
  assert no_steps.mistake() in {f"The answer is \\boxed{{{v}}}." for v in
                                ("9/2", "5/2", "11/2", "3/2", "27/2", "-13/2")}
  assert math_env.MathProblem("Simplify x + x.", "2x").mistake() is None  # not a number
  with pytest.raises(ValueError, match="unknown agent 'critic'"):
    registry.make_env("math", workflow="drmas", seed=0).mistake("critic")


def test_loaders(tmp_path):
  gsm = tmp_path / "gsm8k.jsonl"
  gsm.write_text(json.dumps({"question": "q1", "answer": "work\n#### 1,234"}) + "\n")
  math_file = tmp_path / "math.jsonl"
  math_file.write_text(json.dumps({"problem": "q2", "solution": "so \\boxed{\\frac{1}{2}}."}))
  aime = tmp_path / "aime.parquet"
  pq.write_table(pa.Table.from_pylist([{"problem": "q3", "answer": 204}]), aime)
  assert math_data.load_math(str(gsm)) == [{"question": "q1", "answer": "1234"}]
  assert math_data.load_math(str(math_file)) == [{"question": "q2", "answer": "\\frac{1}{2}"}]
  assert math_data.load_math(str(aime), "plain") == [{"question": "q3", "answer": "204"}]
  env = registry.make_env("math", path=str(math_file), index=0, workflow="single")
  assert env.step("solver", "\\boxed{0.5}").rewards == {"solver": 1.0}
  with pytest.raises(ValueError, match="exactly one"):
    registry.make_env("math", seed=1, problem={"question": "q", "answer": "1"})
  with pytest.raises(ValueError, match="unknown math workflow"):
    registry.make_env("math", seed=1, workflow="debate")


def _scripted(replies):
  """A policy answering each agent from `replies[agent]`: a list consumed per call (per episode
  order is deterministic with k=1)."""
  queues = {agent: list(texts) for agent, texts in replies.items()}

  def generate(requests, policy_id, params):
    del policy_id, params
    return [R.Generation(queues[r.agent].pop(0)) for r in requests]

  return generate


PROBLEM = {"question": "What is 3/4 + 1/4 + 5?", "answer": "6"}


def test_atgrpo_math_turns_rewards_and_replay():
  gen = _scripted({"tool": ["```python\nprint(5)\n```", "```python\nfrom fractions import "
                            "Fraction as F\nprint(F(3, 4) + F(1, 4) + 5)\n```"],
                   "reasoner": ["It is \\boxed{6}.", "Both say \\boxed{6.0}."]})
  problem = R.Problem("math", {"problem": PROBLEM, "workflow": "atgrpo"}, 0)
  res = R.rollout([problem], registry.workflow_spec("math", "atgrpo"), gen, None,
                  R.RolloutConfig(k=1, tool_timeout_s=5.0, trace_clock="logical"))
  got = [(s.agent, s.turn, s.reward, s.team_reward) for s in res.samples]
  # turn 0: tool wrong (5), reasoner right (6): they disagree, so a second turn; turn 1: agree.
  assert got == [("tool", 0, 0.0, 1.0), ("reasoner", 0, 1.0, 1.0),
                 ("tool", 1, 1.0, 1.0), ("reasoner", 1, 1.0, 1.0)]
  episode = res.episodes[0]
  assert episode.solved and episode.turns == 2
  assert replay.recompute_rewards(episode.trace, episode.content) == episode.rewards


def test_drmas_math_loop_penalties_and_last_loop_without_verifier():
  gen = _scripted({"solver": ["The answer is 5", "\\boxed{6}"],
                   "verifier": ["Looks wrong. <verify>reject</verify>"]})
  problem = R.Problem("math", {"problem": PROBLEM, "workflow": "drmas"}, 0)
  res = R.rollout([problem], registry.workflow_spec("math", "drmas"), gen, None,
                  R.RolloutConfig(k=1))
  got = [(s.agent, s.turn, s.reward, s.team_reward) for s in res.samples]
  # no \boxed on the first solver call: -0.1; the verifier is skipped on the 2nd (last) loop.
  assert got == [("solver", 0, -0.1, 1.0), ("verifier", 0, 0.0, 1.0), ("solver", 1, 0.0, 1.0)]
  env = registry.make_env("math", problem=PROBLEM, workflow="drmas")
  env.step("solver", "\\boxed{7}")
  result = env.step("verifier", "fine <verify>approve</verify>")
  assert result.done and not env.solved and registry.workflow_spec("math", "drmas").exit_when(
      "fine <verify>approve</verify>")
  env = registry.make_env("math", problem=PROBLEM, workflow="drmas")
  env.step("solver", "\\boxed{6}")
  env.step("verifier", "bad. <verify>reject</verify>")
  assert "rejected" in env.observe("solver").user


# Dr. MAS's verifier rule (DrMAS agent_system/agent/agents/math/verifier_agent.py): an approve tag
# approves, else a reject tag rejects, else (no verdict tag) the reply approves.
VERIFIER_REPLIES = [
    ("Looks right. <verify>approve</verify>", True),
    ("Step 2 is wrong. <verify>reject</verify>", False),
    ("I checked every step and it is fine.", True),  # no tag: approve
    ("<verify> reject </verify>", False),
    ("<verify>reject</verify> on reflection <verify>approve</verify>", True),
    ("<verify>approve</verify> no wait <verify>reject</verify>", True),  # approve anywhere wins
    ("<verify>maybe</verify>", True),
]


@pytest.mark.parametrize("reply,approved", VERIFIER_REPLIES)
def test_drmas_verifier_rule(reply, approved):
  assert math_env.approves(reply) == approved
  env = registry.make_env("math", problem=PROBLEM, workflow="drmas", max_turns=3)
  env.step("solver", "\\boxed{7}")
  assert env.step("verifier", reply).done == approved


def test_drmas_tagless_verifier_reply_ends_the_loop():
  """Through the workflow loop: a verifier reply without a verdict tag ends the episode after one
  solver call (Dr. MAS approves it) and is charged the format penalty."""
  gen = _scripted({"solver": ["\\boxed{7}", "\\boxed{6}"],
                   "verifier": ["I think this is fine."]})
  problem = R.Problem("math", {"problem": PROBLEM, "workflow": "drmas"}, 0)
  res = R.rollout([problem], registry.workflow_spec("math", "drmas"), gen, None,
                  R.RolloutConfig(k=1))
  got = [(s.agent, s.turn, s.reward, s.team_reward) for s in res.samples]
  assert got == [("solver", 0, 0.0, 0.0), ("verifier", 0, -0.1, 0.0)]
  assert not res.episodes[0].solved


def test_marft_chain_feedback_and_last_agent_scoring():
  gen = _scripted({"reasoner": ["plan A", "plan B", "plan C"],
                   "actor": ["\\boxed{4}", "\\boxed{5}", "\\boxed{6}"]})
  problem = R.Problem("math", {"problem": PROBLEM, "workflow": "marft"}, 0)
  res = R.rollout([problem], registry.workflow_spec("math", "marft"), gen, None, R.RolloutConfig(k=1))
  assert [(s.agent, s.turn, s.reward) for s in res.samples] == [
      ("reasoner", 0, 0.0), ("actor", 0, 0.0), ("reasoner", 1, 0.0), ("actor", 1, 0.0),
      ("reasoner", 2, 0.0), ("actor", 2, 1.0)]
  actor_prompt = res.samples[3].messages[1]["content"]
  assert "The answer is incorrect." in actor_prompt and "plan B" in actor_prompt
  assert res.samples[2].messages[0]["content"].startswith("You are the reasoner")
  env = registry.make_env("math", problem=PROBLEM, workflow="marft", roles=["teacher", "student"])
  for _ in range(3):
    env.step("teacher", "hint")
    result = env.step("student", "\\boxed{1}")
  assert result.done and not env.solved and env.turn == 3


HOSTILE = {
    "infinite_loop": "while True:\n  pass",
    "fork_bomb": "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass",
    "memory_bomb": "x = []\nwhile True:\n  x.append(bytearray(50 * 2**20))",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(6)",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_tool_programs_fail_without_crashing(kind):
  if kind in ("fork_bomb", "kill_parent") and sandbox.detected_backend() != "bwrap":
    pytest.skip("needs the bwrap sandbox (PID namespace, enforced process limit)")
  gen = _scripted({"tool": [f"```python\n{HOSTILE[kind]}\n```"] * 2,
                   "reasoner": ["\\boxed{5}"] * 2})
  problem = R.Problem("math", {"problem": PROBLEM, "workflow": "atgrpo", "max_turns": 1}, 0)
  res = R.rollout([problem], registry.workflow_spec("math", "atgrpo", max_turns=1), gen, None,
                  R.RolloutConfig(k=2, mode="tree", tool_timeout_s=1.0, tool_memory_mb=256))
  assert [s.reward for s in res.samples if s.agent == "tool"] == [0.0, 0.0]
  assert not res.episodes[0].solved
