"""Trace files: one JSON trace per line, raw content in a sibling content store.

Layout for a trace file ``run/traces.jsonl``:
- ``run/traces.jsonl``: one schema-valid trace per line (nothing else; the schema forbids extra
  top-level keys, so content cannot ride along inside a trace);
- ``run/traces.jsonl.content.jsonl``: one ``{"ref": "sha256:<hex>", "text": "..."}`` per line, the
  raw text behind every ``content_ref`` of the traces, each text stored once per file.

Content is addressed by the SHA-256 of its UTF-8 bytes, so identical prompts are stored once, traces
stay small, a trace can be shared without its content (privacy), and replay detects altered content.
Appending is safe for one writer per file (the trainer writes from process 0 only); content lines
are flushed before the trace that refers to them.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

from marl_jax.errors import UserInputError, json_line
from marl_jax.traces.schema import validate

CONTENT_SUFFIX = ".content.jsonl"
_REF_PREFIX = "sha256:"


class TraceFileError(UserInputError):
  """A trace or content file that cannot be read; the message names the file and line."""


def content_ref(text: str) -> str:
  """Reference of a text in the content store: ``sha256:`` + hex digest of its UTF-8 bytes."""
  return _REF_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def is_content_ref(ref: str) -> bool:
  return ref.startswith(_REF_PREFIX)


def content_path(trace_path: str | os.PathLike) -> pathlib.Path:
  """Where the content store of a trace file lives (beside it, same name plus a suffix)."""
  path = pathlib.Path(trace_path)
  return path.with_name(path.name + CONTENT_SUFFIX)


def trace_file(path: str | os.PathLike) -> pathlib.Path:
  """The trace file a reader was given: `path` itself, or, for a content store
  (``X.content.jsonl``, which sits beside every trace file and shares its name's start), the
  trace file ``X`` it belongs to. TraceFileError when that trace file is missing."""
  path = pathlib.Path(path)
  if not path.name.endswith(CONTENT_SUFFIX) or path.name == CONTENT_SUFFIX:
    return path
  traces = path.with_name(path.name[:-len(CONTENT_SUFFIX)])
  if not traces.is_file():
    raise TraceFileError(f"{path} is the content store of the trace file {traces}, which is "
                         "missing; expected a trace file (FILE, not FILE.content.jsonl)")
  return traces


class TraceWriter:
  """Appends finished traces (and their content) to a JSONL trace file.

  Each trace is validated before it is written, so a file produced by this writer always passes
  ``python -m experiments.traces validate``.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._stored = set(read_content(self.path))  # dedupe against what earlier runs appended
    self._traces = open(self.path, "a", encoding="utf-8")
    self._content = open(content_path(self.path), "a", encoding="utf-8")

  def write(self, trace: Mapping[str, Any], content: Mapping[str, str]) -> None:
    """Validates ``trace`` and appends it with the texts its ``content_ref``s point to."""
    validate(trace)
    for i, event in enumerate(trace["events"]):
      ref = event.get("content_ref")
      if ref is not None and is_content_ref(ref) and ref not in content and ref not in self._stored:
        raise ValueError(f"trace {trace['trace_id']!r} event {i} ({event['id']!r}) refers to "
                         f"{ref} but no text was given for it; expected it in `content`")
    try:
      line = json.dumps(trace, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError as e:  # NaN or infinity: not JSON, and no reward should ever be one
      raise ValueError(f"trace {trace['trace_id']!r} holds a non-finite number: {e}") from e
    for ref, text in content.items():
      if content_ref(text) != ref:
        raise ValueError(f"content for {ref} hashes to {content_ref(text)}; expected a "
                         "matching ref")
      if ref not in self._stored:
        self._content.write(json.dumps({"ref": ref, "text": text}, ensure_ascii=False) + "\n")
        self._stored.add(ref)
    self._content.flush()
    self._traces.write(line + "\n")
    self._traces.flush()

  def close(self) -> None:
    self._content.close()
    self._traces.close()

  def __enter__(self) -> TraceWriter:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()


def iter_traces(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
  """Yields (line number, trace) for each non-blank line; raises TraceFileError on bad JSON."""
  yield from _iter_jsonl(pathlib.Path(path))


def read_content(trace_path: str | os.PathLike) -> dict[str, str]:
  """The content store beside ``trace_path`` as {ref: text}; empty if there is none.

  Hashes are not checked here: replay reports altered content as a mismatch instead of failing.
  """
  path = content_path(trace_path)
  if not path.exists():
    return {}
  store = {}
  for lineno, record in _iter_jsonl(path):
    if not (isinstance(record, dict) and isinstance(record.get("ref"), str)
            and isinstance(record.get("text"), str)):
      raise TraceFileError(f"{path}:{lineno}: expected an object with string 'ref' and 'text'")
    store[record["ref"]] = record["text"]
  return store


def _iter_jsonl(path: pathlib.Path) -> Iterator[tuple[int, Any]]:
  if not path.is_file():
    raise TraceFileError(f"{path}: is a directory; expected a JSONL trace file" if path.is_dir()
                         else f"{path}: no such trace file")
  with open(path, "rb") as f:  # bytes, so a bad UTF-8 sequence is reported with its line
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise TraceFileError(f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte "
                             f"{e.start})") from None
      if not line.strip():
        continue
      yield lineno, json_line(line, f"{path}:{lineno}", TraceFileError)
