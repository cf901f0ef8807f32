"""The math-verify worker: one process that grades answer pairs for `grading.MathVerifyGrader`.

Run as a script (`python -I verify_worker.py MEMORY_MB`), never imported by the trainer: it only
needs the standard library and math-verify, so it starts in about half a second. Its first act is
an address-space limit (RLIMIT_AS), so a reply whose parse would allocate gigabytes fails here
(MemoryError, which math-verify turns into a False verdict, or the process dies), never in the
trainer. math-verify's own SIGALRM timeouts are off (`parsing_timeout=None`,
`timeout_seconds=None`): the parent bounds each request from outside by this process's CPU time
and kills it when the budget is spent, which also stops work stuck in C code, where a signal
handler never runs.

Protocol, one line each way: the parent writes a JSON `[gold, pred]` (LaTeX texts, each already in
the `\\boxed{}` it was extracted from); the worker answers `1` or `0`. It writes `ready` once its
imports are done (or `error: ...` when they fail).
"""

import json
import logging
import resource
import sys

_CLEAR_CACHE_EVERY = 200  # sympy's caches only grow; cleared before they approach the limit


def main() -> None:
  limit = int(sys.argv[1]) * 2**20
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  logging.disable(logging.CRITICAL)  # math-verify logs each failed parse and the disabled timeout
  out = sys.stdout.buffer
  try:
    import sympy
    from math_verify import parse, verify
  except ImportError as e:  # the parent reports this line (stderr is not read: it could fill up)
    out.write(f"error: {e}\n".encode())
    out.flush()
    return
  out.write(b"ready\n")
  out.flush()
  for count, line in enumerate(sys.stdin.buffer, start=1):
    gold, pred = json.loads(line)
    try:
      same = verify(parse(gold, parsing_timeout=None), parse(pred, parsing_timeout=None),
                    timeout_seconds=None)
    except Exception:  # math-verify catches most errors itself; whatever escapes grades False
      same = False
    out.write(b"1\n" if same else b"0\n")
    out.flush()
    if count % _CLEAR_CACHE_EVERY == 0:
      sympy.core.cache.clear_cache()


if __name__ == "__main__":
  main()
