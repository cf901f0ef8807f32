"""A small slice of the env fuzzer: every target survives its replies; the fuzzer itself reports
what a broken target does (so a clean report means something)."""

from __future__ import annotations

import time

from experiments import fuzz_envs


def test_fuzzer_reports_exceptions_and_hangs():
  def broken(reply: str) -> None:
    if len(reply) % 2:
      raise RecursionError("deep")
    time.sleep(0.02)

  report = fuzz_envs.fuzz("broken", broken, 40, seed=0, hang_s=0.01)
  odd = sum(len(fuzz_envs.replies(r)) % 2 for r in [fuzz_envs.random.Random("broken/0")]
            for _ in range(40))
  assert report["exceptions"] == report["by_type"]["RecursionError"] == odd
  assert report["hangs"] == 40 - odd and report["calls"] == 40


def test_every_target_survives_a_slice():
  report = fuzz_envs.main(["--replies=25", "--sandboxed=2", "--seed=1"])
  assert set(report) == set(fuzz_envs.targets())
  failures = {name: r["examples"] for name, r in report.items() if r["exceptions"] or r["hangs"]}
  assert not failures
