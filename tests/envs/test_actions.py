"""Action-list parsing from model outputs: correct lists, and None (never an exception) otherwise."""

from __future__ import annotations

import random

import pytest

from marl_jax.envs import actions
from marl_jax.envs.games import plan_path
from marl_jax.envs.games import sudoku
from marl_jax.envs.games.base import FORMAT_PENALTY
from marl_jax.workflows import registry


@pytest.mark.parametrize("text, expected", [
    ('I go right then down.\n#### ["R", "D"]', ["R", "D"]),
    ("#### ['U','L']", ["U", "L"]),
    ("#### [U, R, d]", ["U", "R", "d"]),
    ("#### []", []),
    ('#### ["R", "D",]', ["R", "D"]),
    ("####\n```json\n[\"R\"]\n```", ["R"]),
    ("#### Final answer: [[0, 1, 3], [2, -1, 4]]", [[0, 1, 3], [2, -1, 4]]),
    ("#### [(0, 1, 3), (2, 0, 4)]", [[0, 1, 3], [2, 0, 4]]),
    ('first #### ["L"] then I changed my mind #### ["R"]', ["R"]),  # the last marker wins
    ("#### \uff3b\"R\"\uff0c \"D\"\uff3d", ["R", "D"]),  # full-width brackets and comma
    ("#### [\u201cR\u201d, \u2018D\u2019]", ["R", "D"]),  # curly quotes
    ("\u4f60\u597d \U0001f600 #### [\"U\"] \U0001f600", ["U"]),
])
def test_plan_answer_parses(text, expected):
  assert actions.parse_plan_answer(text) == expected


@pytest.mark.parametrize("text", [
    "",
    "no marker at all [\"R\"]",
    "#### R D",
    "#### [\"R\", \"D\"",  # unterminated
    "#### [\"R\" \"D\"]",  # missing comma
    "#### [1.5, 2]",
    "#### [\"R\", {\"a\": 1}]",
    "#### [\"R\n\"]",  # newline inside a string
    "#### ]][[",
    "#### [" * 50,
    "#### " + "[" * 100_000 + "]" * 100_000,  # hostile nesting
    "#### [[[[1]]]]",  # deeper than any game format
    "#### [" + ",".join(["1"] * 10_000) + "]",  # too many items
    "#### [12345678901234567890]",
    "#### [\u00e9t\u00e9]",
    "\x00\x01#### [\x00]",
    None,
    12345,
])
def test_malformed_plan_answer_is_none(text):
  assert actions.parse_plan_answer(text) is None


def test_huge_output_is_bounded():
  flood = "x" * 5_000_000
  assert actions.parse_plan_answer(flood) is None
  assert actions.parse_plan_answer(flood + '#### ["R"]') == ["R"]
  assert actions.parse_plan_answer('#### ' + "[" + " " * 1_000_000 + '"R"]') is None  # past the scan cap
  assert actions.parse_tool_output(flood + '**Actions List**: ["L"]\n' + flood) == ["L"]


@pytest.mark.parametrize("stdout, expected", [
    ('searching...\n**Actions List**: ["U", "R"]\n', ["U", "R"]),
    ("**Actions List**: ['D']", ["D"]),
    ("Actions list: [L, L]", ["L", "L"]),
    ("actions_list = [[0, 0, 1]]", [[0, 0, 1]]),
    ('**Actions List**: ["U"]\n**Actions List**: ["D"]\n', ["D"]),  # the final print wins
    ('**Actions List**: [[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]]',
     [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]),
])
def test_tool_output_parses(stdout, expected):
  assert actions.parse_tool_output(stdout) == expected


@pytest.mark.parametrize("stdout", [
    "", '["U", "R"]', "Traceback (most recent call last):\n  ...\nNameError: x",
    "**Actions List**: None", "**Actions List**:", None])
def test_malformed_tool_output_is_none(stdout):
  assert actions.parse_tool_output(stdout) is None


def test_extract_code():
  assert actions.extract_code("plan:\n```python\nprint(1)\n```\ndone") == "print(1)\n"
  two = "```python\na = 1\n```\ntext\n```python\nb = 2\n```"
  assert actions.extract_code(two) == "b = 2\n"
  assert actions.extract_code("```\nprint(2)\n```") == "print(2)\n"
  assert actions.extract_code("```python\nprint(3)") == "print(3)"  # unterminated fence
  assert actions.extract_code("```python\nx = 1\n```\n```text\nout\n```") == "x = 1\n"
  assert actions.extract_code("just prose") is None
  assert actions.extract_code(None) is None


def test_random_garbage_never_raises():
  rng = random.Random(0)
  alphabet = '[](),\'"#*:-0123456789 URDLud\n\t\u201c\u201d\uff3b\uff3d\u00e9\U0001f600\x00\\'
  for _ in range(3000):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
    for fn in (actions.parse_plan_answer, actions.parse_tool_output, actions.extract_code):
      out = fn(text)
      assert out is None or isinstance(out, (list, str))


def test_coercion_rejects_wrong_element_types():
  game = plan_path.generate(0)
  assert game.coerce_actions(["u", " Right ", "X"]) == ("U", "R", "X")  # X: an invalid move
  assert game.coerce_actions([0, 1]) is None
  assert game.coerce_actions([["U"]]) is None
  sud = sudoku.generate(0)
  assert sud.coerce_actions([[0, 1, 2]]) == ((0, 1, 2),)
  assert sud.coerce_actions([[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 0, 1]])[-3:] == (
      (3, 0, 4), (3, 1, 3), (3, 3, 1))  # 0 = leave the cell as it is
  assert sud.coerce_actions(["U"]) is None
  assert sud.coerce_actions([[0, 1]]) is None
  assert sud.coerce_actions([[0, 1, "2"]]) is None


@pytest.mark.parametrize("name", ["plan_path", "sokoban", "sudoku"])
@pytest.mark.parametrize("reply", [
    "", "I think the answer is right.", "#### nothing", "#### [{}]", "####" * 10_000,
    "#### " + "[" * 10_000, "\U0001f600" * 10_000, "#### [[[[1]]]]"])
def test_malformed_replies_cost_the_format_penalty(name, reply):
  env = registry.make_env(name, seed=1)
  before = env.game.render()
  tool = env.step("tool", "```python\nprint('hi')\n```", tool_output=reply)
  assert tool.actions is None and tool.rewards == {"tool": FORMAT_PENALTY}
  plan = env.step("plan", reply)
  assert plan.actions is None
  assert plan.rewards == {"plan": FORMAT_PENALTY, "tool": env.game.format_penalty}
  assert env.game.render() == before and env.game.steps == 0
  single = registry.make_env(name, seed=1, mode="single")
  assert single.step("solver", reply).rewards == {"solver": FORMAT_PENALTY}
