"""Math graders: the math-verify worker gives math-verify's own verdicts, behind a hedge filter
that gives it one reading of each answer or refuses it; its bounds hold (CPU budget, wall
backstop, a dying worker, the address-space cap), it works off the main thread, and the envs,
configs and evaluation use the grader they name."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from math_verify import parse, verify

from configs import atgrpo_games, atgrpo_math, drmas_math
from marl_jax.envs.math import answers as math_answers
from marl_jax.envs.math import grading, hedges
from marl_jax.training import evaluation, setup
from marl_jax.workflows import registry

# (answer, gold): equal and unequal forms, including ones the two graders judge differently.
PAIRS = [("42", "42"), ("0.5", "\\frac{1}{2}"), ("x = 5", "5"), ("\\approx 54", "54"),
         ("3\\frac{1}{3}", "10/3"), ("\\text{the answer is } 9", "9"), ("(1, 2)", "(1,2)"),
         ("2, 3", "3, 2"), ("x^2+2x+1", "(x+1)^2"), ("0.333", "\\frac13"), ("7", "8"),
         ("\\sqrt{8}", "2\\sqrt{2}"), ("\\$5", "5"), ("1,000", "1000"), ("-5", "5")]
HOSTILE = "(9^{9999})^{9999}"  # math-verify computes this power: tens of seconds


@pytest.fixture(scope="module")
def grader():
  g = grading.MathVerifyGrader()
  yield g
  g.close()


def _direct(pred: str, gold: str) -> bool:
  """math-verify called in this (main) thread, as its documentation shows."""
  return verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}"))


def test_worker_verdicts_are_math_verifys(grader):
  verdicts = [grader.equivalent(p, g) for p, g in PAIRS]
  assert verdicts == [_direct(p, g) for p, g in PAIRS]
  assert any(verdicts) and not all(verdicts)  # the list exercises both answers
  assert grader.timeouts == grader.crashes == 0


# (answer, gold, verdict): the hedges. math-verify alone grants each hedge both values;
# the verdict is the one reading the project's checker takes (asserted against it below).
HEDGES = [("200\\%", "2", False), ("200\\%", "200", True), ("2\\%", "2", True),
          ("2\\%", "0.02", False), ("1 \\quad 2", "3", False), ("1 \\quad 2", "1", False),
          ("3 \\qquad 4", "7", False), ("1\\ 2", "3", False), ("5\\mathrm{e}", "5", False),
          ("5\\mathrm{e}", "5e", True), ("10\\,000", "0", False), ("10\\,000", "10000", True)]


def test_math_verify_alone_grants_the_hedges_two_readings():
  """Why the filter: math-verify 0.9.0, called directly, accepts each hedge for two values."""
  assert _direct("200\\%", "2") and _direct("200\\%", "200")
  assert _direct("2\\%", "2") and _direct("2\\%", "0.02")
  assert _direct("1 \\quad 2", "3") and _direct("5\\mathrm{e}", "5")
  assert _direct("10\\,000", "0")


@pytest.mark.parametrize("pred, gold, verdict", HEDGES)
def test_hedges_reach_math_verify_in_one_reading_or_not_at_all(grader, pred, gold, verdict):
  assert math_answers.is_equiv(pred, gold) is verdict  # the project's checker agrees
  assert grader.equivalent(pred, gold) is verdict
  assert grader.equivalent(gold, pred) is verdict  # the gold role holds agents' answers too


def test_one_answer_rewrites_or_refuses():
  assert hedges.one_answer("200\\%") == "200" and hedges.one_answer("12.5%") == "12.5"
  assert hedges.one_answer("5\\mathrm{e}") == "5e" and hedges.one_answer("2\\text{ i }") == "2i"
  assert hedges.one_answer("1\\,234\\,567") == "1234567"
  for two in ("1 \\quad 2", "1\\ 2", "1~2", "1 2", "1.5 \\hspace{1em} .5", "1\\,2"):
    assert hedges.one_answer(two) is None, two
  for one in ("2 \\frac{1}{2}", "(1, 2)", "x = 2", "5\\,\\text{cm}", "\\frac{1}{2}", "2e^{3}"):
    assert hedges.one_answer(one) == one


def test_no_answer_grades_false_without_a_request(grader):
  before = dict(grader._cache)
  for pred in (None, "", "   ", "1" * 1001):
    assert grader.equivalent(pred, "1") is False
  assert grader._cache == before


def test_grades_off_the_main_thread(grader):
  """math-verify's own timeout is a SIGALRM, refused outside the main thread; the worker's
  bound is not."""
  out = []
  thread = threading.Thread(target=lambda: out.append(grader.equivalent("1/2", "0.5")))
  thread.start()
  thread.join()
  assert out == [True]


def test_cpu_budget_cuts_off_a_hostile_answer_and_the_next_one_is_graded():
  g = grading.MathVerifyGrader(cpu_budget_s=0.5)
  try:
    assert g.equivalent("1", "1") is True  # started and warm
    start = time.monotonic()
    assert g.equivalent(HOSTILE, "1") is False
    assert time.monotonic() - start < 15.0  # 0.5 CPU-seconds, on a loaded machine
    assert (g.timeouts, g.crashes) == (1, 0)
    assert g.equivalent("x = 5", "5") is True  # a replacement worker answers
  finally:
    g.close()


def test_wall_limit_bounds_a_worker_that_makes_no_progress():
  g = grading.MathVerifyGrader(wall_limit_s=1.0)
  try:
    assert g.equivalent("2", "2") is True
    os.kill(g._proc.pid, signal.SIGSTOP)  # uses no CPU: only the wall backstop can end it
    start = time.monotonic()
    assert g.equivalent("3", "3") is False
    assert 1.0 <= time.monotonic() - start < 10.0
    assert g.timeouts == 1
    assert g.equivalent("3", "3") is True  # not cached as False: asked again, now answered
  finally:
    g.close()


def test_a_worker_that_dies_mid_request_grades_false_and_is_replaced():
  g = grading.MathVerifyGrader(cpu_budget_s=60.0)
  try:
    assert g.equivalent("2", "2") is True
    pid = g._proc.pid
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    assert g.equivalent(HOSTILE, "2") is False
    assert (g.timeouts, g.crashes) == (0, 1)
    assert g.equivalent("4", "4") is True and g._proc.pid != pid
  finally:
    g.close()


def test_worker_address_space_is_capped():
  g = grading.MathVerifyGrader(memory_mb=1536)
  try:
    assert g.equivalent("1", "1") is True
    with open(f"/proc/{g._proc.pid}/limits") as f:
      line = next(row for row in f if row.startswith("Max address space"))
    assert line.split()[3:5] == [str(1536 * 2**20)] * 2
  finally:
    g.close()


@pytest.mark.parametrize("workflow", ["single", "atgrpo"])
def test_envs_reward_with_the_grader_they_name(workflow):
  """'\\approx 54' is 54 to math-verify, not to the builtin checker: the reward follows the
  env's grader."""
  problem = {"question": "What is 50 + 4?", "answer": "54"}
  verdicts = {name: grading.equivalent(name, "\\approx 54", "54") for name in grading.GRADERS}
  assert verdicts == {"builtin": False, "math_verify": True}
  for name, verdict in verdicts.items():
    env = registry.make_env("math", problem=problem, workflow=workflow, grader=name)
    assert env.grader == name
    agent = env.agents[-1]
    if workflow == "atgrpo":
      env.step("tool", "```python\nprint(54)\n```", tool_output="54\n")
    result = env.step(agent, "So the total is \\boxed{\\approx 54}.")
    assert result.rewards[agent] == float(verdict) and env.solved is verdict
    if workflow == "atgrpo":  # the agreement check with the tool's answer uses it too
      assert result.info["agree"] is verdict


def test_unknown_grader_is_refused():
  with pytest.raises(ValueError, match=r"unknown math grader 'sympy'; expected one of "
                                       r"\('builtin', 'math_verify'\)"):
    registry.make_env("math", seed=0, grader="sympy")


def test_atgrpo_math_grades_with_math_verify_and_evaluation_reports_it():
  for variant in atgrpo_games.TASK_VARIANTS:
    c = atgrpo_math.get_config(f"{variant},cpu")
    assert evaluation.answer_grader(setup.problems(c, 0, 1, for_eval=True)[0]) == {
        "grader": "math_verify"}, variant
  c = drmas_math.get_config("cpu")
  assert evaluation.answer_grader(setup.problems(c, 0, 1, for_eval=True)[0]) == {
      "grader": "builtin"}
