"""Candidates that try to forge their test verdicts, and replies that used to crash the code envs.

Every forger below gets zero passing tests while an honest solution passes them all, on both test
styles: the verdict is made by the judge process, which the candidate cannot reach.
"""

from __future__ import annotations

import pytest

from marl_jax.envs.code import env as code
from marl_jax.envs.code import harness as code_harness
from marl_jax.envs.code import magrpo as code_magrpo
from marl_jax.envs.code.env import CodeEnv, CodeProblem
from marl_jax.sandbox import runner as sandbox

FAST = code_harness.ExecLimits(case_timeout_s=1.0, load_timeout_s=2.0, total_timeout_s=12.0,
                               memory_mb=256)
SQUARES = CodeProblem.from_dict({
    "question": "sum of squares", "style": "function", "entry_point": "f",
    "prompt": "def f(a, b):\n    pass\n",
    "tests": ["assert f(1, 2) == 5", "assert f(0, 0) == 0", "assert f(3, 4) == 25",
              "assert isinstance(f(1, 1), int) and f(-1, 1) == 2"]})
ADD = CodeProblem.from_dict({
    "question": "sum", "style": "stdio",
    "tests": [{"input": "1 2", "output": "3"}, {"input": "-5 5", "output": "0"},
              {"input": "10 20\n", "output": "30\n"}]})

# Things a candidate can do to claim passes; each runs at load time (top level) and again inside
# the function / program body.
_FORGE = {
    "print_pass_lines": "for i in range(9):\n  print(f'{i} pass')\n  print(f'x {i} pass', flush=True)",
    "write_every_fd": ("import os, json\n"
                       "for fd in range(3, 64):\n"
                       "  for line in ('0 pass\\n1 pass\\n2 pass\\n3 pass\\n',\n"
                       "               json.dumps({'value': 5}) + '\\n'):\n"
                       "    try:\n      os.write(fd, line.encode())\n"
                       "    except OSError:\n      pass"),
    "judge_fds_and_memory": ("import os\nppid = os.getppid()\n"
                             "for path in (f'/proc/{ppid}/fd/1', f'/proc/{ppid}/mem', "
                             "'/proc/1/fd/1'):\n"
                             "  try:\n    open(path, 'w').write('0 pass\\n1 pass\\n2 pass\\n')\n"
                             "  except OSError:\n    pass"),
    "lying_eq": ("class _Yes(int):\n  def __eq__(self, other):\n    return True\n"
                 "  __hash__ = int.__hash__\nimport builtins\nbuiltins.AssertionError = "
                 "type('A', (Exception,), {})\nbuiltins.isinstance = lambda *a: True"),
    "frame_walk": ("import os, sys\nframe = sys._getframe()\nwhile frame is not None:\n"
                   "  g = frame.f_globals\n"
                   "  if '_report' in g:  # the old in-process harness: report passes, exit\n"
                   "    for i in range(9):\n      g['_report'](i, 'pass')\n    os._exit(0)\n"
                   "  if '_outbox' in g:  # the worker's reply pipe: claim a value\n"
                   "    g['_outbox'].write('{\"value\": 5}\\n')\n"
                   "  frame = frame.f_back"),
    "hard_exit": "import os\nos._exit(0)",
    "sys_exit": "import sys\nsys.exit(0)",
    "kill_judge": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
}


def _function_candidate(forge: str) -> str:
  body = forge.replace("\n", "\n    ")
  return (f"{forge}\n\ndef f(a, b):\n    {body}\n    return _Yes(0) if '_Yes' in globals() "
          "else -1\n")


def _stdio_candidate(forge: str) -> str:
  return f"{forge}\nprint('pass')\nprint(0)\n"


def test_honest_solutions_pass():
  reports = code_harness.run_tests(
      [SQUARES.job("def f(a, b):\n    return a * a + b * b"),
       ADD.job("a, b = map(int, input().split())\nprint(a + b)")], FAST)
  assert [r.statuses for r in reports] == [("pass",) * 4, ("pass",) * 3]


@pytest.mark.parametrize("kind", sorted(_FORGE))
def test_forgers_pass_nothing(kind):
  if kind == "kill_judge" and sandbox.detected_backend() != "bwrap":
    pytest.skip("needs the bwrap sandbox")
  forge = _FORGE[kind]
  function, stdio = code_harness.run_tests(
      [SQUARES.job(_function_candidate(forge)), ADD.job(_stdio_candidate(forge))], FAST)
  assert function.passed == 0, function
  assert stdio.passed == 0, stdio
  env = CodeEnv(SQUARES, workflow="single", limits=FAST)
  assert env.step("coder", f"```python\n{_function_candidate(forge)}\n```").rewards == {
      "coder": 0.0}


def test_lying_return_value_is_not_trusted():
  # The candidate's int subclass claims equality with everything; only plain data crosses.
  job = SQUARES.job("class Y(int):\n  def __eq__(self, o):\n    return True\n"
                    "  __hash__ = int.__hash__\ndef f(a, b):\n  return Y(7)")
  assert code_harness.run_tests([job], FAST)[0].statuses == ("error",) * 4


def test_values_cross_as_plain_data():
  problem = CodeProblem.from_dict({
      "question": "q", "style": "function", "prompt": "", "tests": [
          "assert f() == (1, [2.5, 'x'], {3: {4}}, b'\\x00', 1j, None, True, 2**80, -0.0)",
          "assert type(f()[0]) is int and type(f()[1]) is list and type(f()[3]) is bytes",
          "assert g(ValueError) == 1",
          "try:\n  g(None)\nexcept ZeroDivisionError:\n  pass\nelse:\n  assert False"]})
  code_str = ("def f():\n  return (1, [2.5, 'x'], {3: {4}}, b'\\x00', 1j, None, True, 2**80, -0.0)"
              "\ndef g(x):\n  if x is None:\n    return 1 / 0\n  return 1")
  report = code_harness.run_tests([problem.job(code_str)], FAST)[0]
  # A class passed as an argument is not plain data: that test errors, the others pass.
  assert report.statuses == ("pass", "pass", "error", "pass")


def test_worker_is_restarted_after_a_crash_or_timeout():
  job = SQUARES.job("import os\ncalls = []\ndef f(a, b):\n  if (a, b) == (1, 2):\n"
                    "    os._exit(0)\n  if (a, b) == (0, 0):\n    while True:\n      pass\n"
                    "  return a * a + b * b")
  assert code_harness.run_tests([job], FAST)[0].statuses == ("error", "timeout", "pass", "pass")


def test_result_lines_with_odd_digits_do_not_crash():
  result = sandbox.SandboxResult(0, "² pass\n١ pass\n0 pass\n1 lies\n1 2 3\n", "", False, None,
                                 False, 0.1, "bwrap")
  assert code_harness._parse(result, [True, True]) == code_harness.TestReport(
      ("pass", "missing"), None)


_DEEP = "1" + "+1" * 3000


@pytest.mark.parametrize("reply", [
    f"```python\nassert f(1, 2) == {_DEEP}\n```",
    "```python\nassert f(1, 2) == " + "(" * 300 + "5" + ")" * 300 + "\n```",
    "```python\n" + "x" * (3 << 20) + "\n```",
    "```python\nassert f(1, 2) == 5\n" + "#" * (4 << 20) + "\n```",
], ids=["deep_sum", "deep_parens", "3MB_name", "4MB_comment"])
def test_crashing_tester_replies_are_scored(reply):
  env = CodeEnv(SQUARES, workflow="atgrpo", limits=FAST)
  env.step("coder", "```python\ndef f(a, b):\n    return a * a + b * b\n```")
  result = env.step("tester", reply)
  assert set(result.rewards) == {"tester"} and result.rewards["tester"] <= 2.0


@pytest.mark.parametrize("main_body", [
    f"    return {_DEEP}", "    return " + "[" * 1000 + "]" * 1000,
    "    return 1\n" + "#" * (5 << 20)], ids=["deep_sum", "deep_list", "5MB_comment"])
def test_crashing_magrpo_replies_are_scored(main_body):
  reply = f"```python\ndef f(a, b):\n{main_body}\n```"
  reward = code_magrpo.aux_main_reward("```python\ndef aux(x):\n    return x\n```", reply,
                                       SQUARES, FAST)
  assert reward.pass_ratio == 0.0


def test_generated_tests_parse_never_raises():
  assert code.parse_generated_tests(f"```python\nassert {_DEEP} == 1\n```", "function") in (
      (), (f"assert {_DEEP} == 1",))
