"""Math answers: extraction from model text and equivalence checking, never raising.

Extraction: the last `\\boxed{...}` / `\\fbox{...}` (nested braces), GSM8K's `#### answer`, and the
answer a tool agent's program printed (its last output line).

Equivalence (`is_equiv(pred, gold)`): both answers are normalised (dollar signs, `\\left`/`\\right`,
spacing commands, `\\text{}` wrappers, units after a number, degrees, percent signs, thousands
separators, a leading `x =`), compared as strings, and otherwise parsed into sympy by a small
recursive-descent parser written here. The parser never calls `eval`/`sympy.parse_expr` (model text
is untrusted: `parse_expr` evaluates Python). Hostile text cannot hang the trainer: input length,
nesting depth, exponents, factorials and the size of every power's result are bounded (a
`(9^{9999})^{9999}` is refused before sympy computes it, whether numeric or symbolic), free
variables are evaluated in floating point (no exact rationals of millions of digits), and each
`is_equiv` call has a time budget (`CHECK_BUDGET_S`) checked between steps, after which it answers
False. math-verify (PyPI) was not adopted: its time limit is a SIGALRM, valid only in the main
thread, and it would need the same bounds around sympy; this parser is small and bounded. It covers integers, decimals
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

import cmath
import random
import re
import time
from typing import Any

import sympy

MAX_ANSWER_CHARS = 1000  # longer "answers" are not answers; also bounds parsing time.
MAX_DEPTH = 40  # parser recursion depth.
MAX_EXPONENT = 10_000  # |integer exponent| of a non-trivial numeric base.
MAX_FACTORIAL = 1000
MAX_RESULT_BITS = 100_000  # estimated size of a power's result (2^{10000} still fits)
CHECK_BUDGET_S = 0.25  # per is_equiv call; typical answers take a few milliseconds
MAX_SCAN_CHARS = 20_000  # tail of a reply searched for \boxed
_MAX_BOXED_TRIES = 4  # unbalanced \boxed{ candidates skipped before giving up
_REL_TOL = 1e-9
_NUM_POINTS = 5

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K = re.compile(r"####\s*(.+)")
_FUNCS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec,
    "csc": sympy.csc, "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "ln": sympy.log, "log": sympy.log, "exp": sympy.exp,
}
_OPEN_CLOSE = {"(": ")", "[": "]", "{": "}"}
_SPACING = re.compile(r"\\[,;:! ]|\\(?:left|right|big|Big|bigg|Bigg|displaystyle)(?![a-zA-Z])|~")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_UNITS = re.compile(r"^([^a-zA-Z\\]*\d[^a-zA-Z\\]*?)\s+[a-zA-Z]{2,}[a-zA-Z .]*$")  # "5 cm"
_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\s*\{\s*[a-zA-Z][a-zA-Z .]*\}")  # "5\text{ m}"
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


class _ParseError(Exception):
  """Internal: the text is not in the supported grammar (or exceeds a bound)."""


def _check_deadline(deadline: float | None) -> None:
  if deadline is not None and time.monotonic() > deadline:
    raise _ParseError("time budget exhausted")


_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|(\\[a-zA-Z]+)|([a-zA-Z])|(\S))")


def _tokenize(text: str) -> list[tuple[str, str]]:
  tokens = []
  for match in _TOKEN.finditer(text):
    num, cmd, letter, other = match.groups()
    if num is not None:
      tokens.append(("num", num))
    elif cmd is not None:
      tokens.append(("cmd", cmd[1:]))
    elif letter is not None:
      tokens.append(("var", letter))
    elif other is not None:
      tokens.append(("op", other))
  return tokens


class _Parser:
  """expr := term (± term)*; term := unary ((* / \\cdot \\times \\div | implicit) unary)*;
  unary := ± unary | power; power := postfix (^ unary-group)?; postfix := atom !*."""

  def __init__(self, tokens: list[tuple[str, str]], deadline: float | None = None):
    self.tokens = tokens
    self.pos = 0
    self.depth = 0
    self.deadline = deadline

  def peek(self) -> tuple[str, str] | None:
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self, kind: str | None = None, value: str | None = None) -> tuple[str, str]:
    tok = self.peek()
    if tok is None or (kind and tok[0] != kind) or (value and tok[1] != value):
      raise _ParseError(f"expected {kind} {value}, got {tok}")
    self.pos += 1
    return tok

  def at(self, kind: str, value: str | None = None) -> bool:
    tok = self.peek()
    return tok is not None and tok[0] == kind and (value is None or tok[1] == value)

  def expr(self) -> Any:
    self.depth += 1
    if self.depth > MAX_DEPTH:
      raise _ParseError("too deep")
    value = self.term()
    while self.at("op", "+") or self.at("op", "-"):
      sign = self.take()[1]
      rhs = self.term()
      value = value + rhs if sign == "+" else value - rhs
    self.depth -= 1
    return value

  def term(self) -> Any:
    value = self.unary()
    while True:
      if self.at("op", "*") or self.at("cmd", "cdot") or self.at("cmd", "times"):
        self.take()
        value = value * self.unary()
      elif self.at("op", "/") or self.at("cmd", "div"):
        self.take()
        denominator = self.unary()
        if denominator == 0:
          raise _ParseError("division by zero")
        value = value / denominator
      elif self._starts_atom():
        value = value * self.power()
      else:
        return value

  def _starts_atom(self) -> bool:
    tok = self.peek()
    if tok is None:
      return False
    kind, value = tok
    if kind in ("num", "var"):
      return True
    if kind == "cmd":
      return value in ("frac", "sqrt", "pi", "infty") or value in _FUNCS
    return value in ("(", "{")

  def _signs(self) -> int:
    """Consumes leading +/- signs (a loop, not recursion: `------1` must not exhaust the stack)."""
    sign = 1
    while self.at("op", "-") or self.at("op", "+"):
      sign = -sign if self.take()[1] == "-" else sign
    return sign

  def unary(self) -> Any:
    sign = self._signs()
    value = self.power()
    return -value if sign < 0 else value

  def power(self) -> Any:
    base = self.postfix()
    if not self.at("op", "^"):
      return base
    self.take()
    exponent = self.group() if self.at("op", "{") else self._exponent_atom()
    return _pow(base, exponent)

  def _exponent_atom(self) -> Any:
    sign = self._signs()
    value = self._single_char_num() if self.at("num") else self.postfix()
    return -value if sign < 0 else value

  def postfix(self) -> Any:
    value = self.atom()
    while self.at("op", "!"):
      self.take()
      if not (value.is_Integer and 0 <= value <= MAX_FACTORIAL):
        raise _ParseError("factorial of a non-integer or huge value")
      value = sympy.factorial(value)
    return value

  def _single_char_num(self) -> Any:
    """One digit of a NUM token (`\\frac12`, `x^23` = x^2 * 3); the rest stays a token."""
    _, text = self.take("num")
    if len(text) > 1:
      self.pos -= 1
      self.tokens[self.pos] = ("num", text[1:])
    return sympy.Integer(text[0])

  def group(self) -> Any:
    """A `{...}` group, or a single character/command argument (`\\frac12`, `\\sqrt2`)."""
    if self.at("op", "{"):
      self.take()
      value = self.expr()
      self.take("op", "}")
      return value
    if self.at("num"):
      return self._single_char_num()
    return self.atom()

  def atom(self) -> Any:
    _check_deadline(self.deadline)
    tok = self.peek()
    if tok is None:
      raise _ParseError("unexpected end")
    kind, value = tok
    if kind == "num":
      self.take()
      return sympy.Rational(value)
    if kind == "var":
      self.take()
      return {"e": sympy.E, "i": sympy.I}.get(value) or sympy.Symbol(value)
    if kind == "op" and value in ("(", "[", "{"):
      self.take()
      inner = self.expr()
      self.take("op", _OPEN_CLOSE[value])
      return inner
    if kind == "op" and value == "|":
      self.take()
      inner = self.expr()
      self.take("op", "|")
      return sympy.Abs(inner)
    if kind == "cmd":
      self.take()
      if value == "frac":
        numerator = self.group()
        denominator = self.group()
        if denominator == 0:
          raise _ParseError("division by zero")
        return numerator / denominator
      if value == "sqrt":
        if self.at("op", "["):
          self.take()
          index = self.expr()
          self.take("op", "]")
          return _pow(self.group(), 1 / index)
        return sympy.sqrt(self.group())
      if value == "pi":
        return sympy.pi
      if value == "infty":
        return sympy.oo
      if value in _FUNCS:
        return _FUNCS[value](self.group() if self.at("op", "{") else self.power())
    raise _ParseError(f"unsupported token {tok}")


def _pow(base: Any, exponent: Any) -> Any:
  """base**exponent, refused when the exponent or the result would be huge: each exponent alone is
  bounded, and so is (bits of the base's numbers) x |exponent|, the size sympy would compute, and
  the exponent a symbolic power ends up with (`(x^{9999})^{9999}` = x^{99980001})."""
  if exponent.is_number and exponent.is_real and base not in (0, 1, -1):
    if abs(exponent) > MAX_EXPONENT:
      raise _ParseError("exponent too large")
    base_bits = sum(int(abs(r.p)).bit_length() + int(r.q).bit_length()
                    for r in base.atoms(sympy.Rational))
    if base_bits * max(1.0, float(abs(exponent))) > MAX_RESULT_BITS:
      raise _ParseError("power too large")
  if base == 0 and exponent.is_number and exponent.is_negative:
    raise _ParseError("division by zero")
  value = base**exponent
  if any(p.exp.is_number and p.exp.is_real and abs(p.exp) > MAX_EXPONENT
         for p in value.atoms(sympy.Pow)):
    raise _ParseError("exponent too large")
  return value


def _split_top(text: str) -> list[str]:
  """`text` split at commas outside any brackets."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts]


def parse(answer: str, deadline: float | None = None) -> Any | None:
  """Normalised answer -> sympy value, ("tuple", open, close, [values]) or ("set", [values]);
  None when the text is not in the grammar, exceeds a bound or `deadline` (monotonic) passes."""
  s = normalize(answer)
  if not s:
    return None
  try:
    if s[0] in "([" and s[-1] in ")]" and len(s) > 2:
      parts = _split_top(s[1:-1])
      if len(parts) > 1:
        return ("tuple", s[0], s[-1], [_parse_one(p, deadline) for p in parts])
    if s[0] == "{" and s[-1] == "}":
      inner = _split_top(s[1:-1])
      if len(inner) > 1:
        return ("set", [_parse_one(p, deadline) for p in inner])
    parts = _split_top(s)
    if len(parts) > 1:
      return ("set", [_parse_one(p, deadline) for p in parts])
    return _parse_one(s, deadline)
  except (_ParseError, ArithmeticError, TypeError, ValueError, RecursionError):
    return None


def _parse_one(text: str, deadline: float | None) -> Any:
  if not text:
    raise _ParseError("empty")
  parser = _Parser(_tokenize(text), deadline)
  value = parser.expr()
  if parser.peek() is not None:
    raise _ParseError(f"trailing tokens from {parser.peek()}")
  return value


def _values_equal(a: Any, b: Any, deadline: float | None) -> bool:
  """Exact, then numeric comparison; free symbols are substituted inside evalf (floating point),
  so a large power at a random point costs no exact arithmetic."""
  try:
    _check_deadline(deadline)
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
      _check_deadline(deadline)
      point = {s: sympy.Rational(rng.randint(1, 997), rng.randint(1, 97)) for s in symbols}
      if not _close(complex(a.evalf(30, subs=point)), complex(b.evalf(30, subs=point))):
        return False
    return True
  except (_ParseError, ArithmeticError, TypeError, ValueError, AttributeError, RecursionError):
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


def is_equiv(pred: str | None, gold: str) -> bool:
  """Whether the predicted answer equals the gold one (module doc); never raises."""
  if not isinstance(pred, str) or not isinstance(gold, str) or not pred.strip():
    return False
  if len(pred) > MAX_ANSWER_CHARS:
    return False
  deadline = time.monotonic() + CHECK_BUDGET_S
  p, g = normalize(pred), normalize(gold)
  if p == g:
    return True
  parsed_p, parsed_g = parse(p, deadline), parse(g, deadline)
  if parsed_p is None or parsed_g is None:
    return p.replace(" ", "").lower() == g.replace(" ", "").lower()
  return _parsed_equal(parsed_p, parsed_g, deadline)
