"""The exceptions the entry points report as one line instead of a traceback.

A config value, a flag, a file or a dataset the user named that cannot work raises
`UserInputError` with one line naming the bad value and what was expected. Other failures whose
message alone tells the user what happened and what to do (a checkpoint that cannot be written or
is damaged) derive from `ReportedError` too. The entry points (`experiments/cli.py`) print the
message and exit with status 1; every other exception is a bug and keeps its traceback.

This module is the bottom layer: it imports nothing from marl_jax.
"""

from __future__ import annotations


class ReportedError(Exception):
  """An error whose one-line message is the whole report for the user."""

  def report(self) -> str:
    """`error: <message>` on one line (whitespace runs, newlines included, folded)."""
    return "error: " + " ".join(str(self).split())


class UserInputError(ReportedError, ValueError):
  """A bad value given by the user; its message is one line naming the value and the fix.

  A ValueError too, so callers that catch ValueError for bad values keep working.
  """
