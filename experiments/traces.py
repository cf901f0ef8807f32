"""Inspect orchestration trace files: validate them, summarise them, replay their rewards.

  python -m experiments.traces validate runs/x/traces.jsonl
  python -m experiments.traces stats runs/x/traces.jsonl [--json]
  python -m experiments.traces replay runs/x/traces.jsonl [--module marl_jax.workflows.replay]

Exit status 0 when everything is fine, 1 on an invalid trace, a replay mismatch or an unreadable
file (with a one-line `error: ...` on stderr, no traceback), 2 on bad command-line usage.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from marl_jax.errors import ReportedError, UserInputError
from marl_jax.traces import replay as replay_lib
from marl_jax.traces import schema, stats, store


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    return args.run(args)
  except ReportedError as e:  # trace files, traces and replay setup: one line
    print(e.report(), file=sys.stderr)
    return 1


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m experiments.traces",
                                   description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  validate = commands.add_parser("validate", help="check every trace against the JSON schema")
  validate.add_argument("files", nargs="+", metavar="FILE", help="JSONL trace file(s)")
  validate.set_defaults(run=_validate)
  summary = commands.add_parser("stats", help="summary statistics of a trace file")
  summary.add_argument("files", nargs="+", metavar="FILE", help="JSONL trace file(s)")
  summary.add_argument("--json", action="store_true", help="print the summary as JSON")
  summary.set_defaults(run=_stats)
  rerun = commands.add_parser("replay", help="recompute every reward from the stored content")
  rerun.add_argument("files", nargs="+", metavar="FILE", help="JSONL trace file(s)")
  rerun.add_argument("--module", action="append", default=None, metavar="MODULE",
                     help="module to import that registers replayers (repeatable; default: "
                     "marl_jax.workflows.replay)")
  rerun.add_argument("--atol", type=float, default=0.0,
                     help="absolute tolerance on rewards (default 0: exact)")
  rerun.set_defaults(run=_replay)
  return parser


def _valid_traces(path: str) -> list[dict[str, Any]]:
  traces = []
  for lineno, trace in store.iter_traces(path):
    try:
      schema.validate(trace)
    except schema.TraceValidationError as e:
      raise UserInputError(f"{path}:{lineno}: {e}") from e
    traces.append(trace)
  return traces


def _validate(args: argparse.Namespace) -> int:
  for path in args.files:
    print(f"{path}: {len(_valid_traces(path))} traces valid")
  return 0


def _stats(args: argparse.Namespace) -> int:
  traces = [trace for path in args.files for trace in _valid_traces(path)]
  summary = stats.summarize(traces)
  print(json.dumps(summary, indent=2) if args.json else stats.format_summary(summary))
  return 0


def _replay(args: argparse.Namespace) -> int:
  for module in args.module or ["marl_jax.workflows.replay"]:
    try:
      importlib.import_module(module)
    except ImportError as e:
      raise UserInputError(f"cannot import replayer module {module!r}: {e}; expected a module "
                           "that registers replayers") from e
  failed = 0
  for path in args.files:
    content = store.read_content(path)
    traces = _valid_traces(path)
    if not store.content_path(path).is_file() and any(
        "content_ref" in event for trace in traces for event in trace["events"]):
      raise UserInputError(f"{path}: its content store {store.content_path(path)} is missing; "
                           "replay recomputes rewards from the stored texts, expected beside the "
                           "trace file")
    mismatches = []
    for trace in traces:
      try:
        mismatches += replay_lib.replay(trace, content, atol=args.atol)
      except ValueError as e:
        raise UserInputError(f"{path}: {e}") from e
    for mismatch in mismatches:
      print(f"{path}: MISMATCH {mismatch}")
    print(f"{path}: {len(traces)} traces replayed, {len(mismatches)} mismatches")
    failed += len(mismatches)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
