"""What every entry point does with bad input: one `error: ...` line on stderr, exit status 1.

    cli.run(main)  # instead of absl's app.run(main)

Flag parsing (a missing config file or preset, a `--config.FIELD` that does not exist, a value of
the wrong type) and the project's reported errors (`marl_jax.errors`: bad config values, workdir,
datasets, trace files; checkpoint write failures and damaged checkpoints) end in one line naming
the bad value and what was expected. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags

from marl_jax.errors import ReportedError


def run(main: Callable[[list[str]], Any]) -> None:
  """`app.run(main)` with one-line user errors."""
  app.run(guarded(main), flags_parser=parse_flags)


def guarded(main: Callable[..., Any]) -> Callable[..., Any]:
  """`main` with its user errors turned into `error: ...` and exit status 1."""

  def checked(*args: Any) -> Any:
    try:
      return main(*args)
    except ReportedError as e:
      sys.exit(e.report())

  return checked


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing, with each failure as one line (config_flags reports some of them as a
  traceback or only when the config is first read)."""
  _check_config_file(argv)
  check_flagfiles(argv)
  try:
    return flags.FLAGS(list(argv))
  except flags.Error as e:
    sys.exit(f"error: {_flag_error(str(e))}")
  except (AttributeError, KeyError) as e:  # config_flags: `--config.X=...` names no field
    line = _unknown_field(argv, e)
    if line is None:  # not about an override: a bug (e.g. in a config file) keeps its traceback
      raise
    sys.exit(f"error: {line}")


def _check_config_file(argv: Sequence[str]) -> None:
  """config_flags defers a missing config file to the first read of the config: check it now."""
  for i, arg in enumerate(argv[1:], start=1):
    value = None
    if arg.startswith("--config="):
      value = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(argv):
      value = argv[i + 1]
    if value is not None:
      path = value.split(":", 1)[0]
      if not os.path.isfile(path):
        sys.exit(f"error: --config={value}: no config file {path!r}; expected "
                 "configs/NAME.py[:PRESET]")


def check_flagfiles(argv: Sequence[str]) -> None:
  """Exits with one line when a `--flagfile` is not UTF-8 text: absl reads it as text and raises
  UnicodeDecodeError, and `config_flags.DEFINE_config_file` reads the flag files already when the
  flag is defined, so an entry point with a config flag calls this before defining it. (A
  flagfile that names another flagfile is read by absl, which then reports a decode error.)"""
  for i, arg in enumerate(argv[1:], start=1):
    path = arg.split("=", 1)[1] if arg.startswith("--flagfile=") else (
        argv[i + 1] if arg == "--flagfile" and i + 1 < len(argv) else None)
    if path is None:
      continue
    try:
      with open(path, encoding="utf-8") as f:
        f.read()
    except UnicodeDecodeError as e:
      sys.exit(f"error: --flagfile={path}: not UTF-8 text ({e.reason} at byte {e.start}); "
               "expected a text file of --flag=value lines")
    except OSError:
      continue  # absl reports a missing file in one line itself


def _flag_error(message: str) -> str:
  """One line from absl's message; a config file's error arrives with its traceback inside."""
  lines = [line.strip() for line in message.splitlines() if line.strip()]
  if any(line.startswith("Traceback") for line in lines):
    return f"{lines[0].split(': Error whilst parsing config file')[0]}: {lines[-1]}"
  return " ".join(lines)


def _unknown_field(argv: Sequence[str], error: BaseException) -> str | None:
  """`--config.a.b: no config field 'b'. Did you mean ...?` from ml_collections' KeyError, or
  None when no `--config.` override names the missing field."""
  detail: Any = error
  while isinstance(detail, BaseException) and detail.args:
    detail = detail.args[0]
  lines = str(detail).splitlines()
  field = lines[0].strip("'\"") if lines else ""
  hint = " " + " ".join(lines[1:]) if len(lines) > 1 else ""
  named = [flag for flag in (a.split("=", 1)[0] for a in argv if a.startswith("--config."))
           if field in flag.split(".")]
  if not named:
    return None
  from marl_jax.training.config_checks import RENAMED_FIELDS  # here: --help stays fast
  if field in RENAMED_FIELDS:
    return f"{named[0]}: {RENAMED_FIELDS[field]}"
  return f"{named[0]}: no config field {field!r}; expected an existing field.{hint}"
