r"""How often the two math graders disagree: the project's checker ('builtin') and math-verify.

  python -m experiments.grader_agreement [--problems=100] [--fuzz=1000] [--seed=0] [--out=F.json]

Two stated sets of replies, each graded by both (`marl_jax/envs/math/grading.py`), the answer
extracted from the reply as the math envs extract it:
  generated  for the first `--problems` seeds of every generated level (`envs/math/data.py`), the
             gold answer written in each of the renderings below inside `\boxed{}`: some equal the
             gold answer by construction (`intended` True), some do not (wrong values), so each
             grader's misses are counted too.
  fuzz       `--fuzz` replies of the fuzz corpus (`experiments/fuzz_envs.replies`, the same
             seeded stream), graded as the fuzz run's two math targets grade them: the last
             `\boxed{}` against "2", and the raw reply against "\frac{1}{2}".
Prints a Markdown table per set (pairs, both true, both false, builtin only, math-verify only,
math-verify's timeouts and crashes, the answers its hedge filter refused (`hedges.one_answer`:
two numbers side by side, e.g. `1 \quad 2`, which math-verify read as their sum), and per
rendering the misses) and up to `--examples` disagreements each way and refusals; `--out` also
writes them as JSON. The renderings include hedges math-verify granted two readings before the
filter (`percent_hundredfold` `200\%` for 2, `side_by_side`, `upright_e`).
"""

from __future__ import annotations

import argparse
import fractions
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

from experiments import fuzz_envs
from marl_jax.envs.math import answers, data, grading, hedges


def _frac(value: fractions.Fraction, command: str = "frac") -> str:
  sign = "-" if value < 0 else ""
  return f"{sign}\\{command}{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _decimal(value: fractions.Fraction, places: int) -> str:
  return f"{float(value):.{places}f}"


def _terminates(value: fractions.Fraction) -> bool:
  q = value.denominator
  for p in (2, 5):
    while q % p == 0:
      q //= p
  return q == 1


def renderings(gold: str) -> Iterator[tuple[str, str, bool]]:
  """(kind, answer text, whether it equals `gold` by construction) for a generated answer
  (an integer or a fraction p/q in lowest terms)."""
  value = fractions.Fraction(gold)
  whole = value.denominator == 1
  yield "exact", gold, True
  yield "dollars", f"\\${gold}", True
  yield "units", f"{gold} apples", True
  yield "text_units", f"{gold}\\text{{ apples}}", True
  yield "assignment", f"x = {gold}", True
  yield "text", f"\\text{{{gold}}}", True
  yield "wrong_plus_one", data.format_number(value + 1), False
  if value:
    yield "wrong_sign", data.format_number(-value), False
  yield "sentence", f"\\text{{the answer is }} {gold}", True
  yield "percent", f"{gold}\\%", True  # one reading: the number itself, as the checker reads it
  if value:  # hedges math-verify granted before the filter: each is another value than gold
    yield "percent_hundredfold", f"{data.format_number(100 * value)}\\%", False
    yield "side_by_side", f"{data.format_number(value - 1)} \\quad 1", False
    yield "upright_e", f"{gold}\\mathrm{{e}}", False
  if whole:
    yield "trailing_zero", f"{gold}.0", True
    yield "over_one", f"\\frac{{{gold}}}{{1}}", True
    yield "doubled_fraction", f"\\frac{{{2 * value}}}{{2}}", True
    tenth = _decimal(value / 10, 6).rstrip("0").rstrip(".")
    yield "scientific", f"{tenth} \\times 10^{{1}}", True
    yield "approx", f"\\approx {gold}", True
    if abs(value) >= 1000:
      yield "thousands", f"{value.numerator:,}", True
    return
  yield "latex_frac", _frac(value), True
  yield "dfrac", _frac(value, "dfrac"), True
  yield "unreduced", f"{value.numerator * 2}/{value.denominator * 2}", True
  yield "reciprocal", data.format_number(1 / value), False
  if _terminates(value):
    yield "decimal", _decimal(value, 6).rstrip("0"), True
  else:
    yield "rounded", _decimal(value, 3), False
  if value > 1:
    whole_part, rest = divmod(value, 1)
    yield "mixed_number", f"{whole_part}{_frac(rest)}", True


def generated_pairs(problems: int) -> Iterator[tuple[str, str | None, str, bool | None]]:
  """(kind, extracted answer, gold, intended) for the generated set."""
  for level in data.LEVELS:
    for seed in range(problems):
      gold = data.arithmetic_problem(seed, level)["answer"]
      for kind, text, intended in renderings(gold):
        reply = f"Working it out step by step.\nThe answer is \\boxed{{{text}}}."
        yield kind, answers.last_boxed(reply), gold, intended


def fuzz_pairs(count: int, seed: int) -> Iterator[tuple[str, str | None, str, bool | None]]:
  """(target, answer, gold, None) for the fuzz set: the fuzz run's two math targets."""
  rng = random.Random(f"grader_agreement/{seed}")
  for _ in range(count):
    reply = fuzz_envs.replies(rng)
    yield "last_boxed", answers.last_boxed(reply), "2", None
    yield "raw_reply", reply, "\\frac{1}{2}", None


def compare(pairs: Iterator[tuple[str, str | None, str, bool | None]],
            math_verify: Callable[[str | None, str], bool], examples: int) -> dict[str, Any]:
  """Both graders' verdicts on every pair: counts, per-kind misses, disagreement examples."""
  counts = {"pairs": 0, "both_true": 0, "both_false": 0, "builtin_only": 0,
            "math_verify_only": 0, "math_verify_refused": 0}
  kinds: dict[str, dict[str, int]] = {}
  shown: dict[str, list[dict[str, Any]]] = {"builtin_only": [], "math_verify_only": [],
                                             "math_verify_refused": []}
  for kind, pred, gold, intended in pairs:
    ours, theirs = answers.is_equiv(pred, gold), math_verify(pred, gold)
    refused = isinstance(pred, str) and hedges.one_answer(pred) is None
    counts["pairs"] += 1
    counts["math_verify_refused"] += refused
    outcome = ("both_true" if ours and theirs else "both_false" if not (ours or theirs)
               else "builtin_only" if ours else "math_verify_only")
    counts[outcome] += 1
    row = kinds.setdefault(kind, {"pairs": 0, "builtin_wrong": 0, "math_verify_wrong": 0,
                                  "disagree": 0})
    row["pairs"] += 1
    row["disagree"] += ours != theirs
    if intended is not None:
      row["builtin_wrong"] += ours != intended
      row["math_verify_wrong"] += theirs != intended
    for shelf in (outcome, "math_verify_refused" if refused else None):
      if shelf in shown and len(shown[shelf]) < examples:
        shown[shelf].append({"kind": kind, "answer": (pred or "")[:120], "gold": gold,
                             "intended": intended})
  return {**counts, "by_kind": kinds, "examples": shown}


def _table(name: str, result: dict[str, Any]) -> str:
  lines = [f"### {name}: {result['pairs']} pairs, both true {result['both_true']}, both false "
           f"{result['both_false']}, builtin only {result['builtin_only']}, math-verify only "
           f"{result['math_verify_only']}, refused by its hedge filter "
           f"{result['math_verify_refused']}",
           "", "| kind | pairs | disagree | builtin wrong | math-verify wrong |",
           "|---|---|---|---|---|"]
  for kind, row in result["by_kind"].items():
    lines.append(f"| {kind} | {row['pairs']} | {row['disagree']} | {row['builtin_wrong']} | "
                 f"{row['math_verify_wrong']} |")
  for side, rows in result["examples"].items():
    for row in rows:
      lines.append(f"- {side}: `{row['answer']}` vs gold `{row['gold']}` ({row['kind']})")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--problems", type=int, default=100, help="seeds per generated level")
  parser.add_argument("--fuzz", type=int, default=1000, help="fuzz corpus replies")
  parser.add_argument("--seed", type=int, default=0, help="fuzz corpus seed")
  parser.add_argument("--examples", type=int, default=5, help="disagreements shown each way")
  parser.add_argument("--out", default="", help="also write the report here as JSON")
  args = parser.parse_args(argv)
  for name in ("problems", "fuzz", "examples"):
    if getattr(args, name) < 0:
      parser.error(f"--{name}={getattr(args, name)}; expected an integer >= 0")
  mv = grading.MathVerifyGrader()
  report = {}
  for name, pairs in (("generated", generated_pairs(args.problems)),
                      ("fuzz", fuzz_pairs(args.fuzz, args.seed))):
    before = (mv.timeouts, mv.crashes)
    report[name] = compare(pairs, mv.equivalent, args.examples)
    report[name]["math_verify_timeouts"] = mv.timeouts - before[0]
    report[name]["math_verify_crashes"] = mv.crashes - before[1]
    print(_table(name, report[name]), flush=True)
    print(f"math-verify timeouts {report[name]['math_verify_timeouts']}, crashes "
          f"{report[name]['math_verify_crashes']}\n", flush=True)
  mv.close()
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main()
