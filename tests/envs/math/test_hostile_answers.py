"""The math checker under replies built to make it hang or lie: every check ends in milliseconds
(size bounds on powers, floating-point evaluation at random points, a per-call time budget)."""

from __future__ import annotations

import gc
import time

import pytest

from marl_jax.envs.math import answers as math_answers

HOSTILE = [
    "(9^{9999})^{9999}", "\\boxed{(9^{9999})^{9999}}", "(x^{9999})^{9999}",
    "x^{9999}x^{9999}x^{9999}", "(10!)^{9999}", "(\\sqrt{2}^{9999})^{9999}", "((2^{99})^{99})^{99}",
    "\\sin{2^{9999}}", "e^{e^{e^{9}}}", "2^{9999}\\cdot" * 60 + "1", "(1+x)^{9999}",
    "\\sqrt[9999]{9^{9999}}^{9999}", ", ".join(str(i) for i in range(250)),
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_answer_is_checked_quickly(text):
  for gold in ("1", "x", ", ".join(str(i) for i in reversed(range(250)))):
    start = time.monotonic()
    math_answers.is_equiv(math_answers.last_boxed(text) or text, gold)
    assert time.monotonic() - start < 1.0, (text[:40], gold[:20])


def test_bounded_powers_still_compare_exactly():
  # Independent values: 2^300 as a Python int, (x^2)^3 = x^6 by hand.
  assert math_answers.is_equiv("(2^{100})^{3}", str(2**300))
  assert not math_answers.is_equiv("(2^{100})^{3}", str(2**300 + 1))
  assert math_answers.is_equiv("(x^{2})^{3}", "x^6")
  assert math_answers.is_equiv("2^{10000}", "2^{10000}")
  assert math_answers.parse("(9^{9999})^{9999}") is None  # refused, not computed


def test_overflowing_values_are_not_equal():
  # At the random points both sides overflow a float; inf == inf proves nothing.
  assert not math_answers.is_equiv("x^{9999}", "x^{9998}")
  assert not math_answers.is_equiv("\\sqrt{2}^{9999}", "1")


def test_time_budget_is_enforced(monkeypatch):
  monkeypatch.setattr(math_answers, "CHECK_BUDGET_S", -1.0)
  assert not math_answers.is_equiv("1/2", "0.5")  # needs parsing: over budget
  assert math_answers.is_equiv("0.5", "0.5")  # equal strings need no work


def test_time_budget_counts_this_threads_work_not_waiting(monkeypatch):
  """A loaded machine must not change a verdict: time spent waiting (here asleep, as when another
  process holds the core) is not spent from the budget."""
  monkeypatch.setattr(math_answers, "CHECK_BUDGET_S", 0.2)
  normalize = math_answers.normalize

  def waiting(s):
    time.sleep(0.1)
    return normalize(s)

  monkeypatch.setattr(math_answers, "normalize", waiting)
  start = time.monotonic()
  assert math_answers.is_equiv("x^2+2x+1", "(x+1)^2")
  assert time.monotonic() - start > 0.2  # over the budget in wall-clock time


def _spending(normalize, seconds, work):
  """`normalize` after `work()` has run until this thread spent `seconds` of CPU on it."""
  def spend(s):
    start = time.thread_time()
    while time.thread_time() - start < seconds:
      work()
    return normalize(s)
  return spend


def test_time_budget_leaves_out_garbage_collection(monkeypatch):
  """A collection that starts inside a check walks the whole process's heap; its CPU time is not
  the check's. The same CPU time spent on the check's own thread's other work runs the budget
  out, so the budget is still counted."""
  monkeypatch.setattr(math_answers, "CHECK_BUDGET_S", 0.2)
  normalize = math_answers.normalize
  monkeypatch.setattr(math_answers, "normalize", _spending(normalize, 0.3, gc.collect))
  assert math_answers.is_equiv("x^2+2x+1", "(x+1)^2")
  busy = _spending(normalize, 0.3, lambda: sum(range(1000)))
  monkeypatch.setattr(math_answers, "normalize", busy)
  assert not math_answers.is_equiv("x^2+2x+1", "(x+1)^2")


@pytest.mark.parametrize("pred, gold", [
    ("1 \\text{ or } 2", "2"), ("1 \\text{ or } 2", "1"), ("1 \\text{ and } 2", "2"),
    ("1 \\mbox{or} 2", "2"), ("5\\mathrm{e}", "5"), ("5 \\mathrm{i}", "5"), ("1 2", "2"),
    ("3 \\quad 4", "12"),
])
def test_two_answers_or_a_constant_are_not_accepted(pred, gold):
  assert not math_answers.is_equiv(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("5\\text{ cm}", "5"), ("5 \\mathrm{m}", "5"), ("12\\text{ meters}", "12"),
    ("5\\mathrm{e}", "5e"), ("2\\pi", "2 \\pi"), ("x^23", "3x^2"), ("2 x", "2x"),
])
def test_units_constants_and_spacing_still_compare(pred, gold):
  assert math_answers.is_equiv(pred, gold)
