"""Inspect orchestration trace files: validate them, summarise them, replay their rewards.

  python -m experiments.traces validate runs/x/traces.jsonl
  python -m experiments.traces stats runs/x/traces.jsonl [--json]
  python -m experiments.traces replay runs/x/traces.jsonl [--module marl_jax.workflows.replay]
  python -m experiments.traces show runs/x/traces.jsonl [--episode=N] [--prompt_chars=400]

`show` prints one episode (the N-th trace of the file, from 0) per agent and turn: the tail of the
prompt the agent was shown, its reply, what the env parsed from it and its reward. Prompts, parses
and rewards come from re-stepping the env with the stored replies (the replay path), so they are
exactly what the episode's agents saw and got. (Traces hold no advantages: they are written for
evaluation episodes, which are not trained on.)

Every command also takes a trace file's content store (`FILE.content.jsonl`, beside it) and
reads the trace file it belongs to. Exit status 0 when everything is fine, 1 on an invalid trace,
a replay mismatch or an unreadable file (with a one-line `error: ...` on stderr, no traceback), 2
on bad command-line usage.
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
    # a content store names its trace file (`store.trace_file`)
    if hasattr(args, "files"):
      args.files = [_trace_file(p) for p in args.files]
    if hasattr(args, "file"):
      args.file = _trace_file(args.file)
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
  show = commands.add_parser("show", help="print one episode per agent and turn")
  show.add_argument("file", metavar="FILE", help="JSONL trace file")
  show.add_argument("--episode", type=int, default=0, help="which trace of the file, from 0")
  show.add_argument("--prompt_chars", type=int, default=400,
                    help="characters of each prompt's end to print (0: none)")
  show.add_argument("--module", action="append", default=None, metavar="MODULE",
                    help="module to import that registers the trace's environment (repeatable)")
  show.set_defaults(run=_show)
  return parser


def _trace_file(path: str) -> str:
  traces = str(store.trace_file(path))
  if traces != path:
    print(f"{path} is a content store: reading its trace file {traces}", file=sys.stderr)
  return traces


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


def _import(modules: Sequence[str]) -> None:
  for module in modules:
    try:
      importlib.import_module(module)
    except ImportError as e:
      raise UserInputError(f"cannot import replayer module {module!r}: {e}; expected a module "
                           "that registers replayers") from e


def _replay(args: argparse.Namespace) -> int:
  _import(args.module or ["marl_jax.workflows.replay"])
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


def _show(args: argparse.Namespace) -> int:
  _import(args.module or [])
  from marl_jax.workflows import replay as workflow_replay  # the env registry, only for `show`
  traces = _valid_traces(args.file)
  if not 0 <= args.episode < len(traces):
    raise UserInputError(f"--episode={args.episode}: {args.file} holds {len(traces)} traces; "
                         f"expected 0 <= N < {len(traces)}")
  if args.prompt_chars < 0:
    raise UserInputError(f"--prompt_chars={args.prompt_chars}; expected an integer >= 0")
  trace = traces[args.episode]
  try:
    _, steps = workflow_replay.replay_steps(trace, store.read_content(args.file))
  except (ValueError, TypeError, KeyError) as e:
    raise UserInputError(f"{args.file}: episode {args.episode} cannot be re-stepped ({e}); "
                         "expected its content store beside the file and its environment "
                         "registered (--module)") from e
  print(f"episode {args.episode} of {args.file}: trace {trace['trace_id']}, task "
        f"{trace['task_id']}")
  print("rewards: " + ", ".join(f"{k}={v:g}" for k, v in sorted(trace["rewards"].items())))
  for step in steps:
    event, result = step.event, step.result
    print(f"\n--- turn {event.get('turn', '?')}, {event['agent']} ({event.get('tokens', 0)} "
          "tokens)")
    if args.prompt_chars:
      tail = step.observation.user[-args.prompt_chars:]
      cut = "..." if len(tail) < len(step.observation.user) else ""
      print(_block("prompt", cut + tail))
    print(_block("reply", step.reply))
    if step.tool_output is not None:
      print(_block("program output", step.tool_output))
    parsed = {k: v for k, v in result.info.items() if not isinstance(v, str) or len(v) < 200}
    print(f"parsed: {json.dumps(parsed, default=str)}")
    print(f"reward: {result.rewards.get(event['agent'], 0.0):g}"
          + "".join(f", to {k}: {v:g}" for k, v in result.rewards.items() if k != event["agent"]))
  return 0


def _block(label: str, text: str) -> str:
  """`label:` then the text indented, so multi-line prompts and replies stay readable."""
  body = "\n".join("    " + line for line in (text or "").splitlines()) or "    (empty)"
  return f"{label}:\n{body}"


if __name__ == "__main__":
  sys.exit(main())
