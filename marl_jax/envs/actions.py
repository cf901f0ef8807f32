"""Parse action lists out of model outputs, never raising.

The AT-GRPO games receive actions two ways: the tool agent's program prints
`**Actions List**: [...]`, and the plan agent (or a single agent) ends its reply with `#### [...]`.
Model text is untrusted: it may lack the marker, hold garbage, be megabytes long, nest brackets
thousands deep or use full-width/curly unicode punctuation. Every failure returns None, which the
games map to the format penalty; no input raises.

The list grammar is a small subset of Python/JSON literals, parsed by hand (not `ast.literal_eval`,
whose parser can be driven into deep recursion or large allocations by hostile input):

  value := list | string | int | bareword
  list  := '[' [value (',' value)* [',']] ']'   (or '(' ... ')' below the top level)
  string:= '...' | "..." | curly-quoted, on one line
  int   := ['-'] digits
  bareword := letter (letter | digit | '_')*   e.g. [U, R, D] -> ['U', 'R', 'D']

Nesting depth, item count and the scanned length are capped. Element types (strings for moves,
int triples for Sudoku) are checked by each game's `coerce_actions`, not here.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from marl_jax.envs.base import MAX_REPLY_CHARS

PLAN_MARKER = "####"
MAX_SEGMENT_CHARS = 50_000  # text scanned after a marker; a real action list is far shorter.
MAX_DEPTH = 3  # Sudoku grids / fill lists need 2.
MAX_ITEMS = 4096  # all values in one list, nested ones included.

_TOOL_MARKER = re.compile(r"actions[ _]?list", re.IGNORECASE)
_CODE_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_INT = re.compile(r"-?[0-9]{1,9}(?![0-9.])")
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")
_QUOTES = {"'": "'", '"': '"', "\u201c": "\u201d\u201c\"", "\u2018": "\u2019\u2018'"}
_CLOSE = {"[": "]", "(": ")"}


class _ParseError(Exception):
  """Internal: the segment is not a well-formed action list."""


class _Parser:
  """Recursive-descent parser over one (already bounded) text segment."""

  def __init__(self, text: str):
    self.text = text
    self.pos = 0
    self.items = 0

  def _skip_space(self) -> None:
    while self.pos < len(self.text) and self.text[self.pos].isspace():
      self.pos += 1

  def _peek(self) -> str:
    self._skip_space()
    if self.pos >= len(self.text):
      raise _ParseError("unexpected end")
    return self.text[self.pos]

  def parse_list(self, depth: int) -> list[Any]:
    if depth > MAX_DEPTH:
      raise _ParseError("too deep")
    close = _CLOSE[self.text[self.pos]]
    self.pos += 1
    out: list[Any] = []
    if self._peek() == close:
      self.pos += 1
      return out
    while True:
      out.append(self.parse_value(depth))
      self.items += 1
      if self.items > MAX_ITEMS:
        raise _ParseError("too many items")
      ch = self._peek()
      self.pos += 1
      if ch == close:
        return out
      if ch != ",":
        raise _ParseError(f"unexpected {ch!r}")
      if self._peek() == close:  # trailing comma
        self.pos += 1
        return out

  def parse_value(self, depth: int) -> Any:
    ch = self._peek()
    if ch in _CLOSE:
      return self.parse_list(depth + 1)
    if ch in _QUOTES:
      return self._parse_string(_QUOTES[ch])
    if ch == "-" or ch.isdigit():
      return self._parse_int()
    if ch.isalpha() and ch.isascii():
      return self._parse_word()
    raise _ParseError(f"unexpected {ch!r}")

  def _parse_string(self, closers: str) -> str:
    start = self.pos + 1
    end = start
    while end < len(self.text) and self.text[end] not in closers:
      if self.text[end] == "\n":
        raise _ParseError("newline in string")
      end += 1
    if end >= len(self.text):
      raise _ParseError("unterminated string")
    self.pos = end + 1
    return self.text[start:end]

  def _parse_int(self) -> int:
    match = _INT.match(self.text, self.pos)
    if match is None:
      raise _ParseError("bad number")
    self.pos = match.end()
    return int(match.group())

  def _parse_word(self) -> str:
    match = _WORD.match(self.text, self.pos)
    assert match is not None  # the first character is an ASCII letter.
    self.pos = match.end()
    return match.group()


def parse_list(text: str) -> list[Any] | None:
  """The first `[...]` list literal in `text` (bounded scan), or None when there is none."""
  segment = unicodedata.normalize("NFKC", text[:MAX_SEGMENT_CHARS])  # full-width [ ] , -> ASCII
  start = segment.find("[")
  if start < 0:
    return None
  parser = _Parser(segment)
  parser.pos = start
  try:
    return parser.parse_list(depth=1)
  except _ParseError:
    return None


def parse_plan_answer(text: str) -> list[Any] | None:
  """The action list after the last `####` of a plan/single agent reply, or None."""
  if not isinstance(text, str):
    return None
  idx = text.rfind(PLAN_MARKER)
  if idx < 0:
    return None
  return parse_list(text[idx + len(PLAN_MARKER):])


def parse_tool_output(stdout: str) -> list[Any] | None:
  """The list printed after the last `Actions List` marker in a program's output, or None.

  The marker is matched loosely (`**Actions List**:`, `Actions list:`, `actions_list =`) because
  only the list after it carries meaning; the last occurrence wins since programs may print
  intermediate attempts before their final answer.
  """
  if not isinstance(stdout, str):
    return None
  last = None
  for last in _TOOL_MARKER.finditer(stdout):
    pass
  if last is None:
    return None
  return parse_list(stdout[last.end():])


def extract_code(response: str) -> str | None:
  """The program in a tool agent's reply: the last ```python block (else the last ``` block).

  An unterminated final fence runs to the end of the reply (models often stop mid-fence). Only the
  first MAX_REPLY_CHARS characters are read.
  Returns None when the reply has no fenced block, so the caller can skip the sandbox.
  """
  if not isinstance(response, str):
    return None
  response = response[:MAX_REPLY_CHARS]  # a flood of fences would cost seconds of regex work
  blocks = [(m.group(1).lower(), m.group(2)) for m in _CODE_BLOCK.finditer(response)]
  python = [code for lang, code in blocks if lang in ("python", "py", "python3")]
  if python:
    return python[-1]
  return blocks[-1][1] if blocks else None
