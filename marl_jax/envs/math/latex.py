"""A bounded recursive-descent parser from LaTeX math answers to sympy values.

Model text is untrusted, so nothing here calls `eval` or `sympy.parse_expr` (which evaluates
Python), and every kind of work is bounded: nesting depth, exponents, factorials, the estimated
size of every power's result (a `(9^{9999})^{9999}` is refused before sympy computes it), and a
deadline checked between steps. `answers.is_equiv` is the caller; the grammar it covers is listed
in that module's docstring.
"""

from __future__ import annotations

import gc
import re
import threading
import time
from typing import Any

import sympy

MAX_DEPTH = 40  # parser recursion depth.
MAX_EXPONENT = 10_000  # |integer exponent| of a non-trivial numeric base.
MAX_FACTORIAL = 1000
MAX_RESULT_BITS = 100_000  # estimated size of a power's result (2^{10000} still fits)

_FUNCS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec,
    "csc": sympy.csc, "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "ln": sympy.log, "log": sympy.log, "exp": sympy.exp,
}
_OPEN_CLOSE = {"(": ")", "[": "]", "{": "}"}


class ParseError(Exception):
  """The text is not in the supported grammar (or exceeds a bound)."""


class _CollectorTime(threading.local):
  """CPU seconds the calling thread has spent in the cyclic garbage collector (`gc.callbacks`
  run in the thread whose allocation triggered the collection)."""
  spent = 0.0
  started = 0.0


_COLLECTOR = _CollectorTime()


def _count_collection(phase: str, info: dict[str, int]) -> None:
  del info
  if phase == "start":
    _COLLECTOR.started = time.thread_time()
  else:
    _COLLECTOR.spent += time.thread_time() - _COLLECTOR.started


gc.callbacks.append(_count_collection)


def clock() -> float:
  """The budget's clock: CPU seconds of the calling thread, less those it spent collecting
  garbage. A wall clock would let the machine's load decide a verdict (another process holding
  the core made a 40 ms check miss 0.25 s); a collection that happens to start inside a check
  walks the whole process's heap (a second or more in a long-lived trainer or test worker), which
  is not the check's work either."""
  return time.thread_time() - _COLLECTOR.spent


def check_deadline(deadline: float | None) -> None:
  if deadline is not None and clock() > deadline:
    raise ParseError("time budget exhausted")


_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|(\\[a-zA-Z]+)|([a-zA-Z])|(\S))")


def _tokenize(text: str) -> tuple[list[tuple[str, str]], frozenset[int]]:
  """The tokens, and the indices of the numbers written after a space: `1 2` (or `1 \\text{ or }
  2` once the words are gone) is two answers, not the product 2, so such a number never starts an
  implicit product (`2 x` and `x^23` still do: the space is before the letter, or there is none)."""
  tokens, spaced = [], set()
  for match in _TOKEN.finditer(text):
    num, cmd, letter, other = match.groups()
    if num is not None:
      if match.group(0)[0].isspace() and tokens:
        spaced.add(len(tokens))
      tokens.append(("num", num))
    elif cmd is not None:
      tokens.append(("cmd", cmd[1:]))
    elif letter is not None:
      tokens.append(("var", letter))
    elif other is not None:
      tokens.append(("op", other))
  return tokens, frozenset(spaced)


class _Parser:
  """expr := term (± term)*; term := unary ((* / \\cdot \\times \\div | implicit) unary)*;
  unary := ± unary | power; power := postfix (^ unary-group)?; postfix := atom !*."""

  def __init__(self, tokens: list[tuple[str, str]], spaced: frozenset[int] = frozenset(),
               deadline: float | None = None):
    self.tokens = tokens
    self.spaced = spaced
    self.pos = 0
    self.depth = 0
    self.deadline = deadline

  def peek(self) -> tuple[str, str] | None:
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self, kind: str | None = None, value: str | None = None) -> tuple[str, str]:
    tok = self.peek()
    if tok is None or (kind and tok[0] != kind) or (value and tok[1] != value):
      raise ParseError(f"expected {kind} {value}, got {tok}")
    self.pos += 1
    return tok

  def at(self, kind: str, value: str | None = None) -> bool:
    tok = self.peek()
    return tok is not None and tok[0] == kind and (value is None or tok[1] == value)

  def expr(self) -> Any:
    self.depth += 1
    if self.depth > MAX_DEPTH:
      raise ParseError("too deep")
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
          raise ParseError("division by zero")
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
    if kind == "num":
      return self.pos not in self.spaced
    if kind == "var":
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
        raise ParseError("factorial of a non-integer or huge value")
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
    check_deadline(self.deadline)
    tok = self.peek()
    if tok is None:
      raise ParseError("unexpected end")
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
          raise ParseError("division by zero")
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
    raise ParseError(f"unsupported token {tok}")


def _pow(base: Any, exponent: Any) -> Any:
  """base**exponent, refused when the exponent or the result would be huge: each exponent alone is
  bounded, and so is (bits of the base's numbers) x |exponent|, the size sympy would compute, and
  the exponent a symbolic power ends up with (`(x^{9999})^{9999}` = x^{99980001})."""
  if exponent.is_number and exponent.is_real and base not in (0, 1, -1):
    if abs(exponent) > MAX_EXPONENT:
      raise ParseError("exponent too large")
    base_bits = sum(int(abs(r.p)).bit_length() + int(r.q).bit_length()
                    for r in base.atoms(sympy.Rational))
    if base_bits * max(1.0, float(abs(exponent))) > MAX_RESULT_BITS:
      raise ParseError("power too large")
  if base == 0 and exponent.is_number and exponent.is_negative:
    raise ParseError("division by zero")
  value = base**exponent
  if any(p.exp.is_number and p.exp.is_real and abs(p.exp) > MAX_EXPONENT
         for p in value.atoms(sympy.Pow)):
    raise ParseError("exponent too large")
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


def parse(s: str, deadline: float | None = None) -> Any | None:
  """Normalised answer (`answers.normalize`) -> sympy value, ("tuple", open, close, [values]) or
  ("set", [values]); None when the text is not in the grammar, exceeds a bound or `deadline`
  (on `clock()`) passes."""
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
  except (ParseError, ArithmeticError, TypeError, ValueError, RecursionError):
    return None


def _parse_one(text: str, deadline: float | None) -> Any:
  if not text:
    raise ParseError("empty")
  parser = _Parser(*_tokenize(text), deadline=deadline)
  value = parser.expr()
  if parser.peek() is not None:
    raise ParseError(f"trailing tokens from {parser.peek()}")
  return value
