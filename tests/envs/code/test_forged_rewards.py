"""Rewards a policy could forge through the judge's namespace or its output comparison.

Each forger below is a wrong program plus a trick; it must score exactly what the same wrong
program scores without the trick (the honest wrong answer), while a right program still passes.
"""

from __future__ import annotations

import pytest

from marl_jax.envs.code import data as code_data
from marl_jax.envs.code import harness as code_harness
from marl_jax.envs.code import magrpo as code_magrpo
from marl_jax.envs.code.env import CodeEnv, CodeProblem

FAST = code_harness.ExecLimits(case_timeout_s=1.0, load_timeout_s=2.0, total_timeout_s=12.0,
                               memory_mb=256)
TRUNCATE = CodeProblem.from_dict(code_data.humaneval()[2])  # tests call abs(candidate(x) - y)


def _ratio(problem: CodeProblem, code: str) -> float:
  return code_harness.run_tests([problem.job(code)], FAST)[0].ratio


def test_shadowed_abs_scores_like_the_honest_wrong_answer():
  wrong = "def truncate_number(number):\n    return 0.5\n"
  assert _ratio(TRUNCATE, wrong) == pytest.approx(1 / 3)
  assert _ratio(TRUNCATE, "def abs(x):\n    return 0\n" + wrong) == pytest.approx(1 / 3)
  assert _ratio(TRUNCATE, "def truncate_number(number):\n    return number % 1.0\n") == 1.0


_DEDUPE_TESTS = ["assert sorted(f([3, 1, 3])) == [1, 3]", "assert len(f([2, 2, 2])) == 1",
                 "assert set(f([5, 4, 5])) == {4, 5}", "assert f([1, 2]) == list(range(1, 3))",
                 "assert len(f([1, 1, 1])) == 1"]
_SHADOWS = ("def sorted(x):\n    return [1, 3]\ndef len(x):\n    return 1\n"
            "def set(x):\n    return {4, 5}\ndef range(*a):\n    return []\n")


@pytest.mark.parametrize("entry_point", ["f", None], ids=["humaneval_like", "mbpp_like"])
def test_shadowed_builtins_in_the_tests_give_nothing(entry_point):
  problem = CodeProblem.from_dict({"question": "dedupe and sort", "style": "function",
                                   "entry_point": entry_point, "prompt": "def f(xs):\n    pass\n",
                                   "tests": _DEDUPE_TESTS})
  wrong = "def f(xs):\n    return []\n"
  assert _ratio(problem, wrong) == 0.0
  assert _ratio(problem, _SHADOWS + wrong) == 0.0
  assert _ratio(problem, "def f(xs):\n    return sorted(set(xs))\n") == 1.0


def test_magrpo_default_argument_walrus_gives_nothing():
  problem = TRUNCATE
  main = "```python\ndef truncate_number(number):\n    return aux(number) * 1.0\n```"
  honest = code_magrpo.aux_main_reward("```python\ndef aux(number):\n    return 0.5\n```", main,
                                       problem, FAST)
  forged = code_magrpo.aux_main_reward(
      "```python\ndef aux(number, _s=(abs := lambda v: 0)):\n    return 0.5\n```", main, problem,
      FAST)
  assert honest.total == pytest.approx(0.4 + 0.6 + 0.5 + 1 / 3 + 0.5 + 1.0)
  assert forged.total == pytest.approx(honest.total)


def test_stop_iteration_from_the_candidate_does_not_end_the_tests_loop():
  # `all(map(candidate, xs))`: a StopIteration raised by the candidate would end map() early and
  # make all() of nothing True.
  problem = CodeProblem.from_dict({"question": "q", "style": "function", "entry_point": "f",
                                   "prompt": "def f(x):\n    pass\n",
                                   "tests": ["assert all(map(f, [1, 2, 3]))"]})
  assert _ratio(problem, "def f(x):\n    raise StopIteration\n") == 0.0
  assert _ratio(problem, "def f(x):\n    return x > 0\n") == 1.0


def _numeric_stdio_problems() -> list[CodeProblem]:
  problems = [code_data.stdio_problem(seed) for seed in range(20)]
  numeric = [p for p in problems if all(t["output"].strip().lstrip("-").isdigit()
                                        for t in p["tests"])]
  return [CodeProblem.from_dict(p) for p in numeric[:6]]


@pytest.mark.parametrize("token", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_non_finite_output_matches_no_number(token):
  problems = _numeric_stdio_problems()
  assert len(problems) == 6
  reports = code_harness.run_tests([p.job(f"print({token!r})") for p in problems], FAST)
  assert [r.passed for r in reports] == [0] * 6
  honest = code_harness.run_tests([p.job(p.solution) for p in problems], FAST)
  assert all(r.all_passed for r in honest)


def test_tester_expecting_nan_is_not_paid_for_a_wrong_program():
  problem = CodeProblem.from_dict({
      "question": "sum", "style": "stdio",
      "tests": [{"input": "1 2", "output": "3"}, {"input": "-5 5", "output": "0"}]})
  env = CodeEnv(problem, workflow="atgrpo", limits=FAST)
  env.step("coder", "```python\nprint(7)\n```")
  pair = "**Test Input:**\n```\n{}\n```\n**Test Output:**\n```\n{}\n```\n"
  result = env.step("tester", pair.format("1 1", "nan") + pair.format("2 2", "nan"))
  assert result.rewards == {"tester": 0.0}


def _judge_same():
  judge = {}
  exec(code_harness._JUDGE_COMPARE, judge)
  return judge["_same"]


def test_same_compares_exact_text_or_finite_numbers():
  same = _judge_same()
  assert same("3\n", "3") and same("0.1000000001", "0.1") and same("Infinity", "Infinity")
  assert not same("nan", "5") and not same("inf", "1e999") and not same("nan", "NaN")
  assert not same("0.2", "0.1") and not same("1 2", "1")


def test_same_compares_integers_exactly_at_any_size():
  same = _judge_same()
  big = 2**53 + 1  # a float cannot hold it: float(big) == float(big - 1)
  assert float(big) == float(big - 1)
  assert not same(str(big - 1), str(big)) and same(str(big), str(big))
  assert not same("1000006781", "1000006281")  # the answer + 500: 5e-7 relative
  assert same("007", "7") and same("+7", "7") and same("-0", "0") and not same("-7", "7")
  assert not same("5.0", "5") and not same("5e0", "5")  # an integer is expected: an integer
  assert same("5", "5.0") and same("2.0000001", "2.0")  # a real is expected: within 1e-6
  assert not same("2.00001", "2.0")
  digits = "9" * 5000  # past int()'s 4300-digit limit: compared by its digits
  assert same(digits, digits) and not same(digits[:-1] + "8", digits)


_TRIANGLE = CodeProblem.from_dict({
    "question": "Read n and print n * (n + 1) // 2.", "style": "stdio",
    "tests": [{"input": "44721", "output": "1000006281"},  # 44721 * 44722 / 2
              {"input": "100000", "output": "5000050000"},
              {"input": "2000000", "output": "2000001000000"}]})


@pytest.mark.parametrize("program, passed", [
    ("n = int(input())\nprint(n * (n + 1) // 2)", 3),
    ("n = int(input())\nprint(n * (n + 1) // 2 + 500)", 0),  # scored 3/3 with a float tolerance
    ("n = int(input())\nprint(n * (n - 1) // 2)", 0),  # passed the 2,000,000 case
    ("n = int(input())\nprint(float(n * (n + 1) // 2))", 0),  # 2000001000000.0: not an integer
], ids=["right", "plus_500", "off_by_one", "as_float"])
def test_large_integer_answers_are_judged_exactly(program, passed):
  for case in _TRIANGLE.tests:  # the expected outputs are what they claim
    n = int(case["input"])
    assert int(case["output"]) == n * (n + 1) // 2
  assert code_harness.run_tests([_TRIANGLE.job(program)], FAST)[0].passed == passed


def test_answers_modulo_a_prime_and_beyond_float_precision_are_exact():
  modulus = 10**9 + 7
  cases = [(n, pow(2, n, modulus)) for n in (10**5, 10**9, 10**18)]
  problem = CodeProblem.from_dict({
      "question": "Print 2^n mod 1e9+7; then print 3^n.", "style": "stdio",
      "tests": [{"input": str(n), "output": f"{r}\n{3**60}"} for n, r in cases]})
  right = "n = int(input())\nprint(pow(2, n, 10**9 + 7))\nprint(3**60)"
  off = "n = int(input())\nprint(pow(2, n, 10**9 + 7) + 1)\nprint(3**60)"
  near = "n = int(input())\nprint(pow(2, n, 10**9 + 7))\nprint(3**60 + 1)"  # 3^60 > 2^53
  reports = code_harness.run_tests([problem.job(p) for p in (right, off, near)], FAST)
  assert [r.passed for r in reports] == [3, 0, 0]


def test_humaneval_asserts_that_cannot_fail_are_not_tests():
  """HumanEval's `assert True, "..."` lines: on 36 problems (48 lines) every program that loads
  passed them. The counted tests are every statement with an assert except those (read off the
  text here), so every problem keeps its real tests."""
  problems = [CodeProblem.from_dict(p) for p in code_data.humaneval()]
  vacuous = {p.id: [s for s in p.tests if s.startswith("assert True")] for p in problems}
  vacuous = {k: v for k, v in vacuous.items() if v}
  assert len(vacuous) == 36 and sum(map(len, vacuous.values())) == 48
  for p in problems:
    names = code_harness.candidate_names(p.job(""))
    assert names == {p.entry_point, "candidate"}
    counted = [code_harness.is_counted(s, names) for s in p.tests]
    assert counted == [("assert" in s and not s.startswith("assert True")) for s in p.tests]
    assert any(counted)


_VOWELS = CodeProblem.from_dict(code_data.humaneval()[64])  # 7 tests and one `assert True`


@pytest.mark.parametrize("main, total", [
    ("def vowels_count(s):\n    return aux(s) - 100\n", 0.4 + 0.6 + 0.5),  # was 3.125
    ("def vowels_count(s):\n    return -100\n", 0.4 + 0.6 + 0.5),  # was 1.625
    ("def vowels_count(s):\n    n = aux(s)\n    return n + (s[-1] in 'yY')\n",
     0.4 + 0.6 + 0.5 + 1.0 + 0.5 + 1.0),
], ids=["garbage_calling_aux", "garbage", "right"])
def test_magrpo_gate_opens_only_on_a_real_test(main, total):
  aux = "```python\ndef aux(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n```"
  reward = code_magrpo.aux_main_reward(aux, f"```python\n{main}```", _VOWELS, FAST)
  assert reward.total == pytest.approx(total)


def test_a_tests_own_names_are_not_the_candidate():
  """MBPP-like (no entry point): `x` is the test's, `f` the candidate's; only the assert that
  calls `f` is a test, so a wrong `f` passes nothing."""
  problem = CodeProblem.from_dict({"question": "sum a list", "style": "function",
                                   "tests": ["x = [1, 2]", "assert x == [1, 2]",
                                             "assert f(x) == 3", "assert True"]})
  assert code_harness.candidate_names(problem.job("")) == {"f"}
  assert code_harness.run_tests([problem.job("def f(xs):\n    return 0\n")], FAST)[0].statuses \
      == ("fail",)
  assert _ratio(problem, "def f(xs):\n    return sum(xs)\n") == 1.0


def test_a_testers_asserts_that_cannot_fail_are_not_paid():
  problem = CodeProblem.from_dict({"question": "add", "style": "function", "entry_point": "add",
                                   "prompt": "def add(a, b):\n    pass\n",
                                   "tests": ["assert add(1, 2) == 3"]})
  env = CodeEnv(problem, workflow="atgrpo", limits=FAST)
  env.step("coder", "```python\ndef add(a, b):\n    return 0\n```")
  vacuous = env.step("tester", "```python\nassert True\nassert 1 == 1\nadd = max\n"
                               "assert add(1, 2) == 2\n```")
  assert vacuous.rewards == {"tester": 0.0} and not env.agreed
