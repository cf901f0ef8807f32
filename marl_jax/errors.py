"""The project's one exception type for bad user input.

A config value, a flag, a file or a dataset the user named that cannot work raises
`UserInputError` with one line naming the bad value and what was expected; the entry points
(`experiments/cli.py`) print that line and exit with status 1 instead of a traceback. Genuine bugs
keep raising their own types, so their tracebacks are never hidden. It subclasses ValueError so
callers that already catch ValueError for bad values keep working.

This module is the bottom layer: it imports nothing from marl_jax.
"""

from __future__ import annotations


class UserInputError(ValueError):
  """A bad value given by the user; its message is one line naming the value and the fix."""
