"""Fuzzes every parser and env step that reads model text with random and adversarial replies.

A reply is anything a policy can emit, so each target must return (a score, a parse or None) for
every string: no exception, no call over `--hang_s`, bounded memory. Targets: the game action
parsers and game env steps, the math answer checker, the code env (coder and tester steps, the
tests parser), MAGRPO (function finder and the aux/main reward), the writing reward, and the search
tag/route parsing and env step. Steps that run sandboxed programs start processes (about 30 ms a
reply on 2 cores: most replies hold no runnable code), so their count is its own flag,
`--sandboxed`, and they count as hung only past their programs' own time limits (two harness runs
of `_FAST` plus a second) rather than `--hang_s`: a reply whose program loops forever takes its
0.5 s case limit per test by design. The math-verify targets grade in a worker process
(`envs/math/grading.py`) that enforces its own bound, so they count as hung only past it
(`grading.WALL_LIMIT_S`, plus a second for the replacement worker's start); their memory is the
worker's, capped there (`grading.MEMORY_MB`), not traced here.

  python -m experiments.fuzz_envs --replies=10000 --sandboxed=10000 --out=fuzz.json  # ~16 min

Prints (and writes) JSON: per target the calls, exceptions (type, message, reply prefix, first
few), hangs, slowest call and peak traced memory (tracemalloc, MiB).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from marl_jax.envs import actions
from marl_jax.workflows import registry
from marl_jax.envs.code import env as code_env
from marl_jax.envs.code import harness
from marl_jax.envs.code import magrpo
from marl_jax.envs.math import answers, grading
from marl_jax.envs.search import env as search_env
from marl_jax.envs.writing import env as writing_env

_ALPHABET = ("abcxyz019 \n\t{}[]()<>\\^_$#*+-=/.,:;'\"`!|~@%&?" + "İıßﬁẞ²³١٢٣४५๑𝟙٠٫" +
             "\u202e\u200b\ufeff\x00\x0b\x1c\u2028")
_FRAGMENTS = [
    "\\boxed{", "}", "\\frac{", "{", "^{9999}", "(9^{9999})^{9999}", "\\sqrt[", "]", "!" * 5,
    "```python\n", "```\n", "```", "<answer>", "</answer>", "<search>", "</search>",
    "<verify>no</verify>", "<verify>yes</verify>", "####", "Answer:", "[[1, 2], [3, 4]]",
    "['U', 'D', 'L', 'R']", "actions: ", "[", "]", "def f(a, b):\n    return ",
    "def aux(x):\n    return x\n", "assert f(1, 2) == 5\n", "print(", ")", "1+" * 50,
    "(" * 60, ")" * 60, "İ" * 4, "\ud800", "\\left(", "\\right)", "**Test Input:**\n```\n1 2\n```",
    "**Test Output:**\n```\n3\n```", "import os\nos._exit(0)\n", "while True:\n    pass\n",
    "2^{99999999}", "\\infty", "x^{x^{x}}", ", ".join(["1"] * 40), "e" * 30,
]


def replies(rng: random.Random) -> str:
  """One reply: random characters, a splice of adversarial fragments, or a flood."""
  kind = rng.random()
  if kind < 0.35:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 300)))
  if kind < 0.85:
    parts = [rng.choice(_FRAGMENTS) for _ in range(rng.randint(1, 12))]
    parts += ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 20)))
              for _ in range(rng.randint(0, 4))]
    rng.shuffle(parts)
    return "".join(parts)
  if kind < 0.99:  # deep nesting
    depth = rng.randint(50, 3000)
    return rng.choice([("(" * depth) + "1" + (")" * depth), "1" + "+1" * depth,
                       "\\boxed{" + "{" * depth + "}" * depth + "}", "[" * depth + "]" * depth,
                       f"```python\nassert f(1, 2) == {'1' + '+1' * depth}\n```",
                       f"```python\ndef f(a, b):\n    return {'-' * depth}1\n```"])
  size = rng.choice([1 << 20, 3 << 20])  # a megabyte flood
  return rng.choice(["x", "{", "\\boxed{", "```", "<answer>", "1+", "İ"]) * (size // 2)


_SQUARES = code_env.CodeProblem.from_dict({
    "question": "sum of squares", "style": "function", "entry_point": "f",
    "prompt": "def f(a, b):\n    pass\n", "tests": ["assert f(1, 2) == 5", "assert f(3, 4) == 25"]})
_ADD = code_env.CodeProblem.from_dict({
    "question": "sum", "style": "stdio",
    "tests": [{"input": "1 2", "output": "3"}, {"input": "-5 5", "output": "0"}]})
_FAST = harness.ExecLimits(case_timeout_s=0.5, load_timeout_s=1.0, total_timeout_s=4.0,
                           memory_mb=256)


def _step_all(make: Callable[[], Any]) -> Callable[[str], Any]:
  """Steps every agent of a fresh env in order with the reply (also as tool output)."""
  def run(reply: str) -> Any:
    env = make()
    for agent in env.agents:
      if env.done:
        break
      env.step(agent, reply, tool_output=reply)
    return env.solved
  return run


def _code_steps(problem: code_env.CodeProblem) -> Callable[[str], Any]:
  def run(reply: str) -> Any:
    env = code_env.CodeEnv(problem, workflow="atgrpo", limits=_FAST)
    env.step("coder", reply)
    return env.step("tester", reply).rewards
  return run


def targets() -> dict[str, tuple[Callable[[str], Any], bool]]:
  """name -> (call on one reply, whether it runs sandboxed programs)."""
  games = {name: registry.make_env(name, seed=0) for name in ("plan_path", "sokoban", "sudoku")}
  math_env = registry.make_env("math", problem={"question": "1+1?", "answer": "2"})
  verified_env = registry.make_env("math", problem={"question": "1+1?", "answer": "2"},
                                   grader="math_verify")
  math_verify = grading.default_math_verify().equivalent
  search = registry.make_env("search", seed=0, index=0)
  writing = registry.make_env("writing", seed=0)
  out: dict[str, tuple[Callable[[str], Any], bool]] = {
      "actions.parse_list": (actions.parse_list, False),
      "actions.parse_plan_answer": (actions.parse_plan_answer, False),
      "actions.parse_tool_output": (actions.parse_tool_output, False),
      "actions.extract_code": (actions.extract_code, False),
      "math.last_boxed+is_equiv": (lambda r: answers.is_equiv(answers.last_boxed(r), "2"), False),
      "math.is_equiv_raw": (lambda r: answers.is_equiv(r, "\\frac{1}{2}"), False),
      "math.program_answer": (lambda r: answers.is_equiv(answers.program_answer(r), "2"), False),
      "math.env_steps": (_step_all(math_env.clone), False),
      "math.math_verify.last_boxed": (lambda r: math_verify(answers.last_boxed(r), "2"), False),
      "math.math_verify.raw": (lambda r: math_verify(r, "\\frac{1}{2}"), False),
      "math.math_verify.env_steps": (_step_all(verified_env.clone), False),
      "code.parse_generated_tests": (
          lambda r: (code_env.parse_generated_tests(r, "function"),
                     code_env.parse_generated_tests(r, "stdio")), False),
      "magrpo.find_function": (lambda r: magrpo.find_function(magrpo.agent_code(r), "f"), False),
      "writing.reward": (lambda r: [writing_env.writing_reward(r, r[::-1], task)
                                    for task in ("tldr", "arxiv")], False),
      "writing.env_steps": (_step_all(writing.clone), False),
      "search.tag+route": (lambda r: (search_env.tag(r, "answer"), search_env.route(r)), False),
      "search.env_steps": (_step_all(search.clone), False),
      "code.env_steps_function": (_code_steps(_SQUARES), True),
      "code.env_steps_stdio": (_code_steps(_ADD), True),
      "magrpo.aux_main_reward": (
          lambda r: magrpo.aux_main_reward(r, r, _SQUARES, _FAST).total, True),
  }
  for name, env in games.items():
    out[f"games.{name}.env_steps"] = (_step_all(env.clone), False)
  return out


def _timed(call: Callable[[str], Any], reply: str) -> tuple[float, Exception | None]:
  start = time.monotonic()
  try:
    call(reply)
  except Exception as e:  # the finding this script exists to report
    return time.monotonic() - start, e
  return time.monotonic() - start, None


def fuzz(name: str, call: Callable[[str], Any], count: int, seed: int,
         hang_s: float) -> dict[str, Any]:
  """Runs `call` on `count` generated replies; exceptions are caught and counted, not raised.

  Memory is traced (tracemalloc), which slows allocation-heavy calls several-fold, so a call
  over `hang_s` is timed again with tracing paused and counts as a hang only if it is slow there
  too (the report's `slowest_s` is the untraced time of such calls)."""
  rng = random.Random(f"{name}/{seed}")
  errors: dict[str, int] = {}
  examples, hangs, slowest, peak = [], 0, 0.0, 0
  tracemalloc.start()
  for _ in range(count):
    reply = replies(rng)
    elapsed, error = _timed(call, reply)
    if error is not None:
      key = type(error).__name__
      errors[key] = errors.get(key, 0) + 1
      if len(examples) < 5:
        examples.append({"type": key, "message": str(error)[:200], "reply": reply[:120]})
    if elapsed > hang_s:
      peak = max(peak, tracemalloc.get_traced_memory()[1])
      tracemalloc.stop()
      elapsed, _ = _timed(call, reply)
      tracemalloc.start()
    slowest = max(slowest, elapsed)
    if elapsed > hang_s:
      hangs += 1
      if len(examples) < 5:
        examples.append({"type": "hang", "seconds": round(elapsed, 2), "reply": reply[:120]})
  peak = max(peak, tracemalloc.get_traced_memory()[1])
  tracemalloc.stop()
  return {"calls": count, "exceptions": sum(errors.values()), "by_type": errors, "hangs": hangs,
          "slowest_s": round(slowest, 3), "peak_mib": round(peak / 2**20, 1),
          "examples": examples}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--replies", type=int, default=10_000, help="per in-process target")
  parser.add_argument("--sandboxed", type=int, default=10_000, help="per sandboxed target")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--hang_s", type=float, default=1.0)
  parser.add_argument("--only", default="", help="comma-separated target name prefixes")
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  prefixes = [p for p in args.only.split(",") if p]
  report = {}
  for name, (call, sandboxed) in targets().items():
    if prefixes and not any(name.startswith(p) for p in prefixes):
      continue
    count = args.sandboxed if sandboxed else args.replies
    hang_s = 2 * _FAST.total_timeout_s + 1.0 if sandboxed else args.hang_s
    if name.startswith("math.math_verify."):
      hang_s = max(hang_s, grading.WALL_LIMIT_S + 1.0)
    report[name] = fuzz(name, call, count, args.seed, hang_s)
    print(json.dumps({name: {k: v for k, v in report[name].items() if k != "examples"}}),
          file=sys.stderr, flush=True)
  text = json.dumps(report, indent=1)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text)
  print(text)
  return report


if __name__ == "__main__":
  main()
