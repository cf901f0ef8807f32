"""The exceptions the entry points report as one line instead of a traceback.

A config value, a flag, a file or a dataset the user named that cannot work raises
`UserInputError` with one line naming the bad value and what was expected. Other failures whose
message alone tells the user what happened and what to do (a checkpoint that cannot be written or
is damaged) derive from `ReportedError` too. The entry points (`experiments/cli.py`) print the
message and exit with status 1; every other exception is a bug and keeps its traceback.

This module is the bottom layer: it imports nothing from marl_jax.
"""

from __future__ import annotations

import json
from typing import Any


class ReportedError(Exception):
  """An error whose one-line message is the whole report for the user."""

  def report(self) -> str:
    """`error: <message>` on one line (whitespace runs, newlines included, folded)."""
    return "error: " + " ".join(str(self).split())


class UserInputError(ReportedError, ValueError):
  """A bad value given by the user; its message is one line naming the value and the fix.

  A ValueError too, so callers that catch ValueError for bad values keep working.
  """


def json_line(text: str, where: str, error: type[UserInputError] = UserInputError) -> Any:
  """`json.loads(text)`, every failure raised as `error` with one line at `where` ("path:line").

  Not only JSONDecodeError: a line of 200k `[` exhausts the parser's recursion (RecursionError)
  and a 5000-digit number exceeds Python's integer-string limit (a plain ValueError); both came
  out of the data and trace readers as tracebacks."""
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    at = f"{where}:{e.lineno}" if "\n" in text.rstrip() else where  # a whole file: its line
    raise error(f"{at}: not valid JSON ({e.msg} at column {e.colno})") from None
  except RecursionError:
    raise error(f"{where}: not valid JSON here (nested deeper than the parser's recursion "
                "limit)") from None
  except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
    raise error(f"{where}: not valid JSON here ({' '.join(str(e).split())[:160]})") from None
