"""Math answers: extraction from model text and equivalence checking, never raising.

Extraction: the last `\\boxed{...}` / `\\fbox{...}` (nested braces), GSM8K's `#### answer`, and the
answer a tool agent's program printed (its last output line).

Equivalence (`is_equiv(pred, gold)`): both answers are normalised (dollar signs, `\\left`/`\\right`,
spacing commands, `\\text{}` wrappers, units after a number, degrees, percent signs, thousands
separators, a leading `x =`), compared as strings, and otherwise parsed into sympy by a small
recursive-descent parser written here (`latex.py`). The parser never calls `eval`/`sympy.parse_expr` (model text
is untrusted: `parse_expr` evaluates Python). Hostile text cannot hang the trainer: input length,
nesting depth, exponents, factorials and the size of every power's result are bounded (a
`(9^{9999})^{9999}` is refused before sympy computes it, whether numeric or symbolic), free
variables are evaluated in floating point (no exact rationals of millions of digits), and each
`is_equiv` call has a time budget (`CHECK_BUDGET_S`) checked between steps, after which it answers
False. It is the 'builtin' grader of `grading.py`, which also offers math-verify (in a bounded
worker process) for the configs whose paper grades with it; extraction (`last_boxed`,
`program_answer`, `gsm8k_answer`) and the substitution check (`satisfies`) are this module's under
either grader. It covers integers, decimals
(kept exact as rationals), `a/b`, `\\frac` (also `\\dfrac`, `\\tfrac`, `\\frac12`), `\\sqrt{}`,
`\\sqrt[n]{}`, `^`, `\\cdot`, `\\times`, `\\div`, implicit products (`2\\pi`, `3x`), `\\pi`, `e`,
`i`, `\\infty`, `!`, `|x|`, common functions (`\\sin`, `\\log`, ...), one-letter variables,
tuples/intervals (ordered, bracket kinds must match) and bare comma lists or `\\{...\\}` sets
(unordered).

Two parsed values are equal when their difference is exactly zero (rationals), within a relative
1e-9 (irrational constants), or, with free variables, numerically zero at several random points.
A decimal that merely rounds the exact value (0.333 for 1/3) is NOT accepted.
"""

from __future__ import annotations

import ast
import cmath
import fractions
import operator
import random
import re
from typing import Any

import sympy

from marl_jax.envs.math import latex

MAX_ANSWER_CHARS = 1000  # longer "answers" are not answers; also bounds parsing time.
CHECK_BUDGET_S = 0.25  # CPU seconds per is_equiv call (latex.clock); typical answers take a few ms
MAX_SCAN_CHARS = 20_000  # tail of a reply searched for \boxed
_MAX_BOXED_TRIES = 4  # unbalanced \boxed{ candidates skipped before giving up
_REL_TOL = 1e-9
_NUM_POINTS = 5

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K = re.compile(r"####\s*(.+)")
_SPACING = re.compile(r"\\[,;:! ]|\\(?:left|right|big|Big|bigg|Bigg|displaystyle)(?![a-zA-Z])|~")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_UNITS = re.compile(r"^([^a-zA-Z\\]*\d[^a-zA-Z\\]*?)\s+[a-zA-Z]{2,}[a-zA-Z .]*$")  # "5 cm"
# A unit is the last thing of an answer ("5\text{ m}"), never a word between two values ("1
# \text{ or } 2" is two answers) nor `\mathrm{e}` / `\mathrm{i}` (the constants, upright).
_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\s*\{\s*(?![ei]\s*\})[a-zA-Z][a-zA-Z .]*\}\s*$")
_LHS_VAR = re.compile(r"^[a-zA-Z](_\{?\w+\}?)?\s*=(?!=)")


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` (balanced braces) or `\\boxed x` in `text`, else None."""
  if not isinstance(text, str):
    return None
  text = text[-MAX_SCAN_CHARS:]  # answers come last; bounds the work on flooding replies
  matches = list(_BOXED.finditer(text))
  for match in matches[:-_MAX_BOXED_TRIES - 1:-1]:
    start = match.end()
    if start < len(text) and text[start] == "{":
      depth = 0
      for i in range(start, len(text)):
        if text[i] == "{":
          depth += 1
        elif text[i] == "}":
          depth -= 1
          if depth == 0:
            return text[start + 1:i].strip()
      continue  # unbalanced: try an earlier one
    bare = re.match(r"[^\s$]+", text[start:])
    if bare:
      return bare.group()
  return None


def gsm8k_answer(solution: str) -> str | None:
  """The answer after the last `####` of a GSM8K solution (thousands commas removed)."""
  found = _GSM8K.findall(solution or "")
  return found[-1].strip().replace(",", "") if found else None


def program_answer(stdout: str | None) -> str | None:
  """What a tool program printed as its answer: its last non-empty line (a `\\boxed{}` in it, or
  the text after an `answer:` label). None for no output or a failed run (the rollout engine
  appends an `[error: ...]` line to the output of a program that failed)."""
  if not isinstance(stdout, str):
    return None
  lines = [line.strip() for line in stdout.strip().splitlines() if line.strip()]
  if not lines or lines[-1].startswith("[error:"):
    return None
  last = lines[-1][:MAX_ANSWER_CHARS]
  boxed = last_boxed(last)
  if boxed is not None:
    return boxed
  labelled = re.search(r"answer\s*(?:is)?\s*[:=]\s*(.+)$", last, re.IGNORECASE)
  return labelled.group(1).strip() if labelled else last


def normalize(answer: str) -> str:
  """String-level normalisation shared by the comparison and the parser."""
  s = answer.strip()[:MAX_ANSWER_CHARS]
  s = s.replace("\\$", "").replace("$", "")
  for opener, closer in (("\\(", "\\)"), ("\\[", "\\]")):
    if s.startswith(opener) and s.endswith(closer):
      s = s[2:-2]
  s = _SPACING.sub(" ", s)
  s = _DEGREES.sub("", s)
  s = s.replace("\\%", "").replace("%", "").replace("{,}", "")
  s = re.sub(r"\\[dt]frac", r"\\frac", s)
  s = s.replace("\\{", "{").replace("\\}", "}") if s.startswith("\\{") else s
  without_units = _TEXT_UNIT.sub("", s)
  if re.search(r"\d", without_units):
    s = without_units
  for _ in range(3):  # nested \text{\textbf{...}}
    s = _TEXT_CMD.sub(r"\1", s)
  s = s.strip().rstrip(".").strip()
  s = _LHS_VAR.sub("", s).strip()
  units = _UNITS.match(s)
  if units:
    s = units.group(1).strip()
  if _THOUSANDS.match(s):
    s = s.replace(",", "")
  return re.sub(r"\s+", " ", s)


def _values_equal(a: Any, b: Any, deadline: float | None) -> bool:
  """Exact, then numeric comparison; free symbols are substituted inside evalf (floating point),
  so a large power at a random point costs no exact arithmetic."""
  try:
    latex.check_deadline(deadline)
    if a.has(sympy.oo, -sympy.oo, sympy.zoo) or b.has(sympy.oo, -sympy.oo, sympy.zoo):
      return a == b
    diff = a - b
    if diff == 0:
      return True
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    if not symbols:
      if a.is_Rational and b.is_Rational:
        return False
      return _close(complex(a.evalf(30)), complex(b.evalf(30)))
    rng = random.Random(0)
    for _ in range(_NUM_POINTS):
      latex.check_deadline(deadline)
      point = {s: sympy.Rational(rng.randint(1, 997), rng.randint(1, 97)) for s in symbols}
      if not _close(complex(a.evalf(30, subs=point)), complex(b.evalf(30, subs=point))):
        return False
    return True
  except (latex.ParseError, ArithmeticError, TypeError, ValueError, AttributeError, RecursionError):
    return False


def _close(x: complex, y: complex) -> bool:
  """Relative closeness of two finite values (an overflow to inf proves nothing)."""
  if not (cmath.isfinite(x) and cmath.isfinite(y)):
    return False
  return abs(x - y) <= _REL_TOL * max(1.0, abs(x), abs(y))


def _parsed_equal(a: Any, b: Any, deadline: float | None) -> bool:
  if isinstance(a, tuple) or isinstance(b, tuple):
    if not (isinstance(a, tuple) and isinstance(b, tuple)) or a[0] != b[0]:
      return False
    if a[0] == "tuple":
      return (a[1:3] == b[1:3] and len(a[3]) == len(b[3])
              and all(_values_equal(x, y, deadline) for x, y in zip(a[3], b[3])))
    return _unordered_equal(a[1], b[1], deadline)
  return _values_equal(a, b, deadline)


def _unordered_equal(xs: list[Any], ys: list[Any], deadline: float | None) -> bool:
  if len(xs) != len(ys):
    return False
  remaining = list(ys)
  for x in xs:
    match = next((i for i, y in enumerate(remaining) if _values_equal(x, y, deadline)), None)
    if match is None:
      return False
    remaining.pop(match)
  return True


def parse(answer: str, deadline: float | None = None) -> Any | None:
  """`answer` normalised and parsed (`latex.parse`); None outside the grammar or its bounds."""
  return latex.parse(normalize(answer), deadline)


def is_equiv(pred: str | None, gold: str) -> bool:
  """Whether the predicted answer equals the gold one (module doc); never raises."""
  if not isinstance(pred, str) or not isinstance(gold, str) or not pred.strip():
    return False
  if len(pred) > MAX_ANSWER_CHARS:
    return False
  deadline = latex.clock() + CHECK_BUDGET_S
  p, g = normalize(pred), normalize(gold)
  if p == g:
    return True
  parsed_p, parsed_g = parse(p, deadline), parse(g, deadline)
  if parsed_p is None or parsed_g is None:
    return p.replace(" ", "").lower() == g.replace(" ", "").lower()
  return _parsed_equal(parsed_p, parsed_g, deadline)


_CHECK_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv}


def _check_value(node: ast.AST, x: fractions.Fraction, check: str) -> fractions.Fraction:
  """One side of a check: whole numbers, x, + - * /, unary minus (exact rationals)."""
  if isinstance(node, ast.Constant) and type(node.value) is int:
    return fractions.Fraction(node.value)
  if isinstance(node, ast.Name) and node.id == "x":
    return x
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    return -_check_value(node.operand, x, check)
  if isinstance(node, ast.BinOp) and type(node.op) in _CHECK_OPS:
    return _CHECK_OPS[type(node.op)](_check_value(node.left, x, check),
                                     _check_value(node.right, x, check))
  raise ValueError(f"check {check!r}: {ast.dump(node)[:60]} is outside its grammar (whole "
                   "numbers, x, + - * / and parentheses on each side of one ==)")


def satisfies(check: str, candidate: str | None) -> bool:
  """Whether the answer `candidate` makes the equation `check` in x hold exactly, e.g.
  `3 * x + 7 == 25` with x = 6: an answer verified by substitution, without knowing the right
  one (as public tests check code). A candidate that is not a rational number fails; a check
  outside its grammar raises ValueError."""
  try:
    tree = ast.parse(check, mode="eval").body
  except SyntaxError as e:
    raise ValueError(f"check {check!r} is not an equation: {e.msg}") from None
  if not (isinstance(tree, ast.Compare) and len(tree.ops) == 1 and isinstance(tree.ops[0], ast.Eq)):
    raise ValueError(f"check {check!r}: expected one equation, LEFT == RIGHT")
  value = parse(candidate) if isinstance(candidate, str) and candidate.strip() else None
  x = fractions.Fraction(0)
  if isinstance(value, sympy.Rational):
    x = fractions.Fraction(int(value.p), int(value.q))
  try:
    holds = (_check_value(tree.left, x, check) == _check_value(tree.comparators[0], x, check))
  except ZeroDivisionError:
    holds = False
  return holds and isinstance(value, sympy.Rational)
