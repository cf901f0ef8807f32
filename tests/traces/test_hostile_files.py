"""Trace and data files built to crash their readers: a line of 200k `[` (the JSON parser's
recursion) and a 5000-digit number (Python's integer-string limit) are one-line errors naming the
file and line, like any other invalid JSON."""

from __future__ import annotations

import pytest

from marl_jax.envs.data import read_records
from marl_jax.errors import UserInputError
from marl_jax.traces import store

_LINES = {"deep": "[" * 200_000, "long_number": '{"x": ' + "9" * 5000 + "}"}


@pytest.mark.parametrize("kind", sorted(_LINES))
def test_trace_file(tmp_path, kind):
  path = tmp_path / "t.jsonl"
  path.write_text('{"ok": 1}\n' + _LINES[kind] + "\n")
  with pytest.raises(store.TraceFileError) as refused:
    list(store.iter_traces(path))
  assert refused.value.report().startswith(f"error: {path}:2: not valid JSON")
  assert "\n" not in refused.value.report()


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("kind", sorted(_LINES))
def test_data_file(tmp_path, kind, suffix):
  path = tmp_path / f"rows{suffix}"
  path.write_text(_LINES[kind] + "\n")
  with pytest.raises(UserInputError) as refused:
    read_records(path)
  line = refused.value.report()
  assert line.startswith(f"error: {path}") and "not valid JSON" in line and "\n" not in line


def test_replay_of_a_trace_asking_for_a_huge_grid_is_refused_quickly():
  """A trace is untrusted input: one that sets a 3000x3000 Plan-Path grid (42 s and 1.8 GB to
  build before) is a replay mismatch naming the bound, in well under a second."""
  import time

  from marl_jax.traces import replay as trace_replay
  from marl_jax.workflows import registry
  from marl_jax.workflows import rollout as R
  result = R.rollout([R.Problem("plan_path", {"seed": 0, "mode": "single", "max_turns": 1}, 0)],
                     registry.workflow_spec("plan_path", "single", 1),
                     lambda requests, policy_id, params: [R.Generation("#### [\"U\"]")
                                                          for _ in requests],
                     None, R.RolloutConfig(k=1, mode="independent", trace_clock="logical"))
  episode = result.episodes[0]
  assert trace_replay.replay(episode.trace, episode.content) == []
  episode.trace["events"][0]["env_kwargs"].update(height=3000, width=3000)
  start = time.monotonic()
  (mismatch,) = trace_replay.replay(episode.trace, episode.content)
  assert time.monotonic() - start < 1.0
  assert mismatch.what == "replayer" and "height=3000; expected an integer in [1, 50]" in str(
      mismatch)
