"""Each program's own process and memory budget: one sample cannot change another's reward, and a
program's total memory is bounded however many children it starts.

Two mechanisms are checked where the machine has them: "cgroup" (a cgroup per program) and "uid"
(root without cgroups: a uid per program, forced here by hiding the cgroups).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib

import pytest

from marl_jax.envs.code import harness as code_harness
from marl_jax.envs.code.env import CodeProblem
from marl_jax.sandbox import budgets
from marl_jax.sandbox import runner as sandbox

FAST = code_harness.ExecLimits(case_timeout_s=1.0, load_timeout_s=2.0, total_timeout_s=12.0,
                               memory_mb=256)
SQUARES = CodeProblem.from_dict({
    "question": "sum of squares", "style": "function", "entry_point": "f",
    "prompt": "def f(a, b):\n    pass\n",
    "tests": ["assert f(1, 2) == 5", "assert f(0, 0) == 0", "assert f(3, 4) == 25"]})
BOMB = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
GOOD = "def f(a, b):\n    return a * a + b * b\n"


@pytest.fixture(params=["cgroup", "uid"])
def mechanism(request, monkeypatch) -> str:
  if not sandbox._bwrap_usable():
    pytest.skip("no working bwrap here")
  if request.param == "cgroup" and budgets.cgroup_layout() is None:
    pytest.skip("no cgroup this process may create here (not root, or a read-only cgroupfs)")
  if request.param == "uid":
    if os.geteuid() != 0:
      pytest.skip("per-program uids need root")
    monkeypatch.setattr(budgets, "cgroup_layout", lambda: None)
  return request.param


def test_fork_bomb_neighbour_does_not_change_honest_scores(mechanism):
  jobs = [SQUARES.job(BOMB)] + [SQUARES.job(GOOD)] * 3
  reports = code_harness.run_tests(jobs, FAST, max_workers=2)
  assert reports[0].passed == 0
  assert [r.statuses for r in reports[1:]] == [("pass",) * 3] * 3, reports
  assert budgets.mode("bwrap") == ("uid" if mechanism == "uid" else
                                   f"cgroup v{budgets.cgroup_layout().version}")


_HOARDERS = """
import os, time
kids = []
for _ in range(6):
  pid = os.fork()
  if pid == 0:
    block = b"x" * (100 << 20)  # written, so resident
    time.sleep(4)
    os._exit(0)
  kids.append(pid)
time.sleep(2.5)
print(sum(os.waitpid(pid, os.WNOHANG)[0] == 0 for pid in kids))
"""


def test_program_memory_is_bounded_over_its_children(mechanism):
  if mechanism != "cgroup":
    pytest.skip("without a cgroup each process is bounded alone (max_procs x memory_mb)")
  res = sandbox.run(_HOARDERS, timeout_s=15.0, memory_mb=256)
  assert res.ok, res
  holding = int(res.stdout)
  assert holding <= 2, f"{holding} children hold 100 MB each under a 256 MB program budget"


def test_uids_are_per_program(mechanism):
  if mechanism != "uid":
    pytest.skip("uids are per program only without cgroups")
  code = "import os, time\ntime.sleep(1.0)\nprint(os.getuid(), os.getgid())"
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    results = list(pool.map(lambda _: sandbox.run(code, timeout_s=10.0, memory_mb=128),
                            range(3)))
  ids = [tuple(map(int, r.stdout.split())) for r in results]
  assert all(uid == gid for uid, gid in ids) and len({uid for uid, _ in ids}) == 3, ids
  assert all(budgets.UID_BASE <= uid < budgets.UID_BASE + budgets.UID_SLOTS for uid, _ in ids)


def _own_groups() -> list[pathlib.Path]:
  layout = budgets.cgroup_layout()
  return [g for _, parent in layout.parents
          for g in pathlib.Path(parent).glob(f"marl_sandbox_{os.getpid()}_*")]


@pytest.mark.parametrize("backend", ["bwrap", "rlimit"])
def test_cgroup_limits_are_set_and_removed(backend):
  if budgets.cgroup_layout() is None:
    pytest.skip("no cgroup this process may create here")
  if backend == "bwrap" and not sandbox._bwrap_usable():
    pytest.skip("no working bwrap here")
  layout = budgets.cgroup_layout()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    running = pool.submit(sandbox.run, "import time\ntime.sleep(1.5)", timeout_s=10.0,
                          memory_mb=200, max_procs=9, backend=backend)
    groups = []
    while not running.done() and not (  # joined: the limits were written before
        groups and all((g / "cgroup.procs").read_text().strip() for g in groups)):
      groups = _own_groups()
    limits = {}
    for group in groups:
      for name in ("pids.max", "memory.max", "memory.limit_in_bytes"):
        if (group / name).exists():
          limits[name] = (group / name).read_text().strip()
    assert running.result().ok
  memory = "memory.max" if layout.version == 2 else "memory.limit_in_bytes"
  assert limits == {"pids.max": "9", memory: str(200 << 20)}
  assert not _own_groups()  # removed once the program ended


def test_user_task_count_includes_this_process():
  """RLIMIT_NPROC's count (shared mode) includes this process's own threads."""
  own = len(os.listdir("/proc/self/task"))
  counted = budgets.user_task_count(os.getuid())
  assert counted >= min(own, len(os.listdir("/proc/self/task")))


@pytest.mark.parametrize("spare, says", [(0, "can start none at all"),
                                         (3, "can start at most 3 more")])
def test_shared_counter_warns_with_the_numbers(monkeypatch, caplog, spare, says):
  """Unconfined and not root, RLIMIT_NPROC counts the user's every task, this process's threads
  included: the run says so, and what the limit leaves the program. The count is fixed here, as
  other processes of the user start and end between any two reads of the real one."""
  used = 40
  monkeypatch.setattr(budgets, "mode", lambda backend: "shared")
  monkeypatch.setattr(budgets, "cgroup_layout", lambda: None)
  monkeypatch.setattr(budgets, "user_task_count", lambda uid: used)
  sandbox._warn_shared_nproc_once.cache_clear()
  with caplog.at_level(logging.WARNING):
    sandbox.run("pass", timeout_s=5.0, memory_mb=128, max_procs=used + spare, backend="rlimit")
  sandbox._warn_shared_nproc_once.cache_clear()
  warnings = [r.getMessage() for r in caplog.records if "CANNOT HOLD" in r.getMessage()]
  assert len(warnings) == 1
  assert (f"max_procs={used + spare} is RLIMIT_NPROC, which counts all {used} processes"
          in warnings[0])
  assert f"so a program {says}," in warnings[0]
