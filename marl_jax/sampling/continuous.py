"""The continuous-batching engine: slots over a paged K/V pool, admission as slots free up,
prefix reuse, several decode steps per device call (vLLM's scheduler, in JAX, for teams).

Each `step`:
  1. admit waiting requests (first come, first served) while a slot and pages are free: look up
     the longest cached prefix of the request's page-aligned blocks (`kv_pool`), share those
     pages, allocate the rest of its prompt; a request whose next block is being prefilled by
     another waits for it; when pages run out, admission stops (back-pressure) until some free;
  2. prefill admitted prompts, up to `prefill_chunk` tokens per call (rows x a chunk width
     fitted to the first waiting prompt: one 256-token chunk, or up to 4 of 64, or up to 16 of
     16 tails of prompts whose first blocks were cached), up to `prefill_tokens` tokens this
     step (a long prompt is spread over steps while the others keep decoding); a prompt's last
     chunk draws its first token;
  3. one decode call of up to `decode_steps` steps over every decoding request, packed into the
     smallest batch of `shapes.fine_bucket` size that holds them (4, 6, 8, 12, 16, 24, ...:
     finished rows never ride along for more than one call) with a block table as wide as the
     rows' pages (the gather path reads every slot of it); pages for the call's tokens are
     allocated before it, and if none are left the latest-admitted request is preempted (its
     pages freed, its tokens kept, re-prefilled later: its draws do not change, since a
     request's key and step fix them);
  4. finished requests (stop token, budget, or a stop string found in their text after the
     call) return their pages (cached when they hold a registered block) and are returned.

K = decode_steps = 8 by default: the host sees finished rows and admits waiting ones every K
steps. On the 2-core CPU (`experiments.bench_engine` heavy-tail workload, SmolLM2-135M) a decode
step over 12-64 rows took 0.2-0.45 s and the host's work between calls about 5 ms, so at K = 8
the host costs well under 1 %, while a finished row waits at most K - 1 steps for its slot to
refill. On an H200 a step of Qwen3-1.7B over 64 rows is ~7.4 ms (docs/design.md, accelerator
facts): K = 8 spreads the host's few milliseconds per call over ~60 ms of device work.

Compiled programs: decode per (rows bucket, table-width bucket, stop-id bucket, draw modes); prefill
per (rows bucket, chunk width, table-width bucket, draw modes). Rows and table widths take two sizes
per doubling, chunk widths are powers of 4 times 16, and the draw modes are those of every request
in the engine, so a run sees tens at most (`stats()["programs"]`; the heavy-tail workload: 25).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models import decoder
from marl_jax.models.config import ModelConfig
from marl_jax.sampling import paged_attention, paged_runner, stops
from marl_jax.sampling.engine import Completion, EngineOptions, EngineRequest, Tokenizer
from marl_jax.sampling.kv_pool import KVPool, root
from marl_jax.sampling.logits import knobs_of
from marl_jax.shapes import bucket, fine_bucket

MIN_CHUNK = 16  # smallest prefill chunk width; widths grow by 4x (16, 64, 256, ...)
MIN_ROWS = 4  # smallest decode batch: fewer programs (on 2 CPU cores a 4-row step of SmolLM2-135M,
# 0.13 s, is mostly the fixed cost of reading the weights)


def _chunk_bucket(n: int) -> int:
  """The prefill chunk width for n tokens: MIN_CHUNK * 4^k >= n (few widths, at most 4x
  padding)."""
  width = MIN_CHUNK
  while width < n:
    width *= 4
  return width


@functools.cache
def _programs(config: ModelConfig, compiler_options: tuple[tuple[str, Any], ...] = ()):
  """(prefill, decode) jitted for `config`, the pools donated (updated in place); shared by
  every engine of that architecture (a team's per-policy engines compile once).
  `compiler_options`: XLA options as (name, value) pairs (none by default)."""
  jit = functools.partial(jax.jit, donate_argnums=(1, 2),
                          compiler_options=dict(compiler_options) or None)
  statics = ("attend", "modes", "candidates")
  prefill = jit(functools.partial(paged_runner.prefill, config=config), static_argnames=statics)
  decode = jit(functools.partial(paged_runner.decode, config=config),
               static_argnames=statics + ("steps",))
  return prefill, decode


@dataclasses.dataclass
class _Seq:
  """A request's state on the host."""

  request: EngineRequest
  tokens: list[int]  # prompt, then generated tokens
  stop_ids: tuple[int, ...]
  logprobs: list[float] = dataclasses.field(default_factory=list)
  pages: list[int] = dataclasses.field(default_factory=list)
  serials: list[int] = dataclasses.field(default_factory=list)  # its registered full blocks
  cached: int = 0  # tokens whose keys/values are in its pages
  admitted: int = -1  # admission order (preemption takes the latest)
  stopped: bool = False  # ended by a stop token

  @property
  def prompt_length(self) -> int:
    return len(self.request.prompt)

  @property
  def generated(self) -> int:
    return len(self.tokens) - self.prompt_length

  @property
  def target(self) -> int:
    """Tokens to have cached before decoding: the whole prompt (its last position's logits draw
    token 0), or after a preemption every token but the last (decode feeds that one)."""
    return len(self.tokens) - (1 if self.generated else 0)

  @property
  def decoding(self) -> bool:
    return self.generated > 0 and self.cached == len(self.tokens) - 1


class ContinuousEngine:
  """`RolloutEngine` with continuous batching over a paged pool (see the module docstring)."""

  def __init__(self, config: ModelConfig, tokenizer: Tokenizer | None = None,
               options: EngineOptions = EngineOptions()):
    self.config, self.tokenizer, self.options = config, tokenizer, options
    o = options
    per_token = paged_runner.bytes_per_token(config)
    tokens = o.pool_tokens if o.pool_gib == 0 else int(o.pool_gib * 2**30) // per_token
    num_pages = tokens // o.page_size + 1  # + the scratch page
    if num_pages < 2:
      raise ValueError(f"engine.pool_gib={o.pool_gib} holds {tokens} tokens, less than one "
                       f"page of {o.page_size}; expected a larger pool")
    self.kv = KVPool(num_pages, o.page_size, prefix_cache=o.prefix_cache)
    self.page_bytes = per_token * o.page_size
    self._k, self._v = paged_runner.init_pool(config, num_pages, o.page_size)
    self._prefill, self._decode = _programs(config)
    self._params = self._adapters = None
    self._version = 0
    self._waiting: collections.deque[_Seq] = collections.deque()
    self._running: list[_Seq] = []
    self._admissions = 0
    self._finished: list[Completion] = []
    self._signatures: set[tuple] = set()
    self._stats = collections.Counter()
    self._peak_pages = 0

  # ------------------------------------------------------------------ the contract
  def load(self, params: decoder.Params, adapters: decoder.LoraAdapters | None = None,
           version: int = 0) -> None:
    self._params, self._adapters, self._version = params, adapters, version
    self.kv.clear()
    self._place_pool(jax.tree.leaves(params)[0].sharding)

  def _place_pool(self, params_sharding: jax.sharding.Sharding) -> None:
    """The pool on the params' devices: replicated over their mesh when they are sharded (FSDP
    params gather per layer inside the programs; sharding the pool is left for later), else on
    their device."""
    if isinstance(params_sharding, jax.sharding.NamedSharding):
      target = jax.sharding.NamedSharding(params_sharding.mesh, jax.sharding.PartitionSpec())
    else:
      target = jax.sharding.SingleDeviceSharding(next(iter(params_sharding.device_set)))
    if self._k.sharding != target:
      self._k, self._v = jax.device_put((self._k, self._v), target)

  def submit(self, requests: Sequence[EngineRequest]) -> None:
    if self._params is None:
      raise ValueError("the engine has no weights; call load(params) before submit")
    for r in requests:
      self._check(r)
    for r in requests:
      stop_ids = r.sampling.stop_token_ids
      if stop_ids is None:
        stop_ids = () if self.tokenizer is None else tuple(self.tokenizer.stop_token_ids)
      self._waiting.append(_Seq(r, list(r.prompt), tuple(stop_ids)))
      self._stats["requests"] += 1
      self._stats["prompt_tokens"] += len(r.prompt)

  @property
  def pending(self) -> int:
    return len(self._waiting) + len(self._running) + len(self._finished)

  def step(self) -> list[Completion]:
    self._admit()
    self._prefill_round()
    if any(s.decoding for s in self._running):
      self._decode_call()
    done, self._finished = self._finished, []
    return done

  def stats(self) -> dict[str, float]:
    s = dict(self._stats)
    s["programs"] = float(len(self._signatures))
    s["pool_bytes"] = float(self.kv.usable_pages * self.page_bytes)
    s["peak_kv_bytes"] = float(self._peak_pages * self.page_bytes)
    s["evictions"] = float(self.kv.evictions)
    return {k: float(v) for k, v in s.items()}

  # ------------------------------------------------------------------ admission
  def _check(self, r: EngineRequest) -> None:
    c, o = self.config, self.options
    n, budget = len(r.prompt), r.sampling.max_new_tokens
    if not n:
      raise ValueError(f"request {r.request_id!r} has an empty prompt; expected token ids")
    bad = [t for t in r.prompt if not 0 <= t < c.vocab_size]
    if bad:
      raise ValueError(f"request {r.request_id!r} has token ids {bad[:5]} outside "
                       f"[0, {c.vocab_size})")
    if n + budget > c.max_position_embeddings:
      raise ValueError(f"request {r.request_id!r} has {n} prompt tokens; with max_new_tokens="
                       f"{budget} it needs {n + budget} positions but the model's context is "
                       f"{c.max_position_embeddings}")
    need = math.ceil((n + budget - 1) / o.page_size)
    if need > self.kv.usable_pages:
      raise ValueError(f"request {r.request_id!r} needs {need} pages ({n} prompt + {budget} "
                       f"new tokens at {o.page_size} per page) but the pool holds "
                       f"{self.kv.usable_pages}; raise engine.pool_tokens (or engine.pool_gib)")
    if r.sampling.truncates and r.sampling.top_k > o.top_candidates:
      raise ValueError(f"request {r.request_id!r}: top_k={r.sampling.top_k} exceeds engine."
                       f"top_candidates={o.top_candidates}; expected top_k <= top_candidates")
    rows = 1 if self._adapters is None else jax.tree.leaves(self._adapters.params)[0].shape[1]
    if not 0 <= r.adapter < rows:
      raise ValueError(f"request {r.request_id!r} has adapter {r.adapter}; the engine's "
                       f"adapters have rows [0, {rows})")

  def _admit(self) -> None:
    """Admits waiting requests in order while slots and pages last (see the module doc)."""
    deferred = []
    while self._waiting and len(self._running) < self.options.slots:
      seq = self._waiting.popleft()
      admitted = self._try_admit(seq)
      if admitted is None:  # no pages: back-pressure, keep the order
        self._waiting.appendleft(seq)
        break
      if not admitted:  # waits for a block another request is prefilling
        deferred.append(seq)
    self._waiting.extendleft(reversed(deferred))

  def _try_admit(self, seq: _Seq) -> bool | None:
    """True: admitted; False: its next prompt block is being prefilled (retry later); None: not
    enough pages."""
    size, target = self.options.page_size, seq.target
    most = (target - 1) // size if seq.generated == 0 else target // size
    hits, serials, wait = self.kv.lookup(seq.tokens, seq.request.adapter, most)
    if wait:
      return False
    self.kv.acquire(hits)  # before allocating, which could otherwise evict them
    fresh = self.kv.allocate(math.ceil(target / size) - len(hits))
    if fresh is None:
      self.kv.release(hits)
      return None
    seq.pages, seq.serials, seq.cached = hits + fresh, serials, len(hits) * size
    self._register(seq, upto=target)
    seq.admitted, self._admissions = self._admissions, self._admissions + 1
    self._running.append(seq)
    self._stats["prefix_hit_tokens"] += seq.cached
    self._note_pages()
    return True

  def _register(self, seq: _Seq, upto: int) -> None:
    """Registers seq's full blocks below position `upto` that are not registered yet."""
    size = self.options.page_size
    for j in range(len(seq.serials), upto // size):
      parent = seq.serials[-1] if seq.serials else root(seq.request.adapter)
      seq.serials.append(self.kv.register(seq.pages[j], parent,
                                          seq.tokens[j * size:(j + 1) * size]))

  def _note_pages(self) -> None:
    self._peak_pages = max(self._peak_pages, self.kv.in_use)

  # ------------------------------------------------------------------ prefill
  def _prefill_round(self) -> None:
    """Prefill calls until no admitted prompt is left or this step's token budget is spent
    while some request is decoding."""
    o, spent = self.options, 0
    while True:
      rows = [s for s in self._running if s.cached < s.target]
      if not rows or (spent >= o.prefill_tokens and any(s.decoding for s in self._running)):
        return
      spent += self._prefill_call(rows)

  def _prefill_call(self, waiting: list[_Seq]) -> int:
    """One prefill call of at most `prefill_chunk` tokens: the chunk width fits the first
    waiting prompt's remainder (a power-of-4 multiple of MIN_CHUNK), the rows are the first
    prefill_chunk / width waiting prompts, in a `fine_bucket` batch (a few prompts arriving
    between decode calls, as episodes' turns do, are not padded to a full chunk); returns the
    real tokens computed."""
    o, size = self.options, self.options.page_size
    C = min(_chunk_bucket(waiting[0].target - waiting[0].cached), o.prefill_chunk)
    rows = waiting[:o.prefill_chunk // C]
    B = min(fine_bucket(len(rows), 1), o.prefill_chunk // C)
    chunks = [min(C, s.target - s.cached) for s in rows]
    P = self._table_width([math.ceil((s.cached + n) / size) for s, n in zip(rows, chunks)])
    tokens = np.zeros((B, C), np.int32)
    starts, counts = np.zeros(B, np.int32), np.zeros(B, np.int32)
    tables = np.zeros((B, P), np.int32)
    for i, (s, n) in enumerate(zip(rows, chunks)):
      tokens[i, :n] = s.tokens[s.cached:s.cached + n]
      starts[i], counts[i] = s.cached, n
      pages = s.pages[:P]  # those past the chunk are not read
      tables[i, :len(pages)] = pages
    knobs, keys, ids, modes = self._row_inputs(rows, B)
    attend = paged_attention.choose(o.attention, decode=False, q_shape=(B, C),
                                    pool_shape=self._k.shape, pages=P, dtype=self._k.dtype)
    self._signatures.add(("prefill", B, C, P, modes))
    start = time.perf_counter()
    self._k, self._v, first, logp = self._prefill(
        self._params, self._k, self._v, tokens, starts, counts, tables, keys, knobs, ids,
        self._adapters, attend=attend, modes=modes, candidates=o.top_candidates)
    first, logp = jax.device_get((first, logp))
    self._stats["prefill_s"] += time.perf_counter() - start
    for i, (s, n) in enumerate(zip(rows, chunks)):
      s.cached += n
      self.kv.mark_ready(s.pages[:s.cached // size])
      if s.cached == s.target and s.generated == 0:
        s.tokens.append(int(first[i]))
        s.logprobs.append(float(logp[i]))
        s.stopped = int(first[i]) in s.stop_ids
        self._finish_if_done(s)
    self._stats["prefill_calls"] += 1
    self._stats["prefilled_tokens"] += sum(chunks)
    return sum(chunks)

  # ------------------------------------------------------------------ decode
  def _decode_call(self) -> None:
    o, size = self.options, self.options.page_size
    rows = self._reserve([s for s in self._running if s.decoding], o.decode_steps)
    B = min(fine_bucket(len(rows), MIN_ROWS), fine_bucket(o.slots, 1))
    P = self._table_width([len(s.pages) for s in rows])  # they cover this call's writes
    K = bucket(max(len(s.stop_ids) for s in rows), 4)
    tokens, lengths = np.zeros(B, np.int32), np.zeros(B, np.int32)
    produced, max_new = np.zeros(B, np.int32), np.zeros(B, np.int32)
    stop_ids, live = np.full((B, K), -1, np.int32), np.zeros(B, bool)
    tables = np.zeros((B, P), np.int32)
    for i, s in enumerate(rows):
      tokens[i], lengths[i], produced[i] = s.tokens[-1], s.cached, s.generated
      max_new[i], live[i] = s.request.sampling.max_new_tokens, True
      stop_ids[i, :len(s.stop_ids)] = s.stop_ids
      tables[i, :len(s.pages)] = s.pages
    knobs, keys, ids, modes = self._row_inputs(rows, B)
    attend = paged_attention.choose(o.attention, decode=True,
                                    q_shape=(B, 1, self.config.num_attention_heads,
                                             self.config.head_dim),
                                    pool_shape=self._k.shape, pages=P, dtype=self._k.dtype)
    self._signatures.add(("decode", B, P, K, modes))
    start = time.perf_counter()
    self._k, self._v, out_tokens, out_logp, after, stopped = self._decode(
        self._params, self._k, self._v, tokens, lengths, produced, max_new, stop_ids, live,
        tables, keys, knobs, ids, self._adapters, attend=attend, steps=o.decode_steps,
        modes=modes, candidates=o.top_candidates)
    out_tokens, out_logp, after, stopped = jax.device_get((out_tokens, out_logp, after, stopped))
    self._stats["decode_s"] += time.perf_counter() - start
    for i, s in enumerate(rows):
      n = int(after[i]) - s.generated
      s.cached += n
      s.tokens += out_tokens[i, :n].tolist()
      s.logprobs += out_logp[i, :n].tolist()
      s.stopped = bool(stopped[i])
      self._register(s, upto=s.cached)  # the blocks this call filled (before any release)
      self.kv.mark_ready(s.pages[:s.cached // size])
      self._finish_if_done(s)
    new = after[:len(rows)] - produced[:len(rows)]
    self._stats["decode_calls"] += 1
    self._stats["decode_tokens"] += int(new.sum())
    self._stats["decode_row_steps"] += B * int(new.max())  # rows computed x steps run

  def _reserve(self, rows: list[_Seq], steps: int) -> list[_Seq]:
    """Pages for every position the next call may write, preempting the latest-admitted
    requests while the pool is short; returns the rows still decoding."""
    size = self.options.page_size
    for s in sorted(rows, key=lambda s: s.admitted):
      if s not in self._running:
        continue  # preempted below for an earlier row
      limit = min(s.cached + steps, s.prompt_length + s.request.sampling.max_new_tokens - 1)
      need = math.ceil(limit / size) - len(s.pages)
      while need > 0:
        fresh = self.kv.allocate(need)
        if fresh is not None:
          s.pages += fresh
          break
        victim = max((r for r in self._running if r is not s), key=lambda r: r.admitted,
                     default=None)
        if victim is None:  # cannot happen: `_check` sized every request to the pool
          raise RuntimeError(f"request {s.request.request_id!r} cannot get {need} pages")
        self._preempt(victim)
    self._note_pages()
    return [s for s in rows if s in self._running]

  def _preempt(self, seq: _Seq) -> None:
    """Frees seq's pages and puts it first in line; it keeps its tokens and is re-prefilled."""
    self._running.remove(seq)
    self.kv.release(seq.pages)
    seq.pages, seq.serials, seq.cached = [], [], 0
    self._waiting.appendleft(seq)
    self._stats["preemptions"] += 1

  # ------------------------------------------------------------------ rows in, rows out
  @staticmethod
  def _table_width(pages: list[int]) -> int:
    """Block-table width P of a call whose rows read `pages` pages each: the longest, bucketed
    (`fine_bucket`). The gather path reads all P pages of every row at every step, so P follows
    the rows' lengths as they grow (on a 2-core CPU a SmolLM2-135M decode step over 16 rows took
    0.42 s with a 512-slot table); the Pallas kernel reads only the pages below each row's
    length, whatever P is."""
    return fine_bucket(max(pages), 1)

  def _row_inputs(self, rows: list[_Seq], B: int):
    """Knobs, keys and adapter ids of `rows`, padded to B (padding repeats row 0), and the
    static set of draw modes: those of every request in the engine, not only these rows, so a
    rollout whose agents mix settings compiles one variant, not one per mix of a call's rows."""
    padded = rows + [rows[0]] * (B - len(rows))
    settings = [s.request.sampling for s in padded]
    keys = jnp.stack([s.request.key for s in padded])
    ids = np.asarray([s.request.adapter for s in padded], np.int32)
    modes = frozenset(s.request.sampling.mode for s in self._running + list(self._waiting))
    return knobs_of(settings), keys, ids, modes

  def _finish_if_done(self, seq: _Seq) -> None:
    """Finishes seq at a stop token, its budget or a stop string in its text."""
    sampling = seq.request.sampling
    done = seq.stopped or seq.generated >= sampling.max_new_tokens
    if not done and sampling.stop_strings and self.tokenizer is not None:
      text = self.tokenizer.decode(seq.tokens[seq.prompt_length:])
      done = stops.find(text, sampling.stop_strings) >= 0
    if done:
      self._finish(seq)

  def _finish(self, seq: _Seq) -> None:
    self._running.remove(seq)
    self.kv.release(seq.pages)
    r = seq.request
    self._finished.append(stops.completion(
        self.tokenizer, np.asarray(seq.tokens[seq.prompt_length:], np.int32),
        np.asarray(seq.logprobs, np.float32), seq.stopped, seq.prompt_length,
        r.sampling.stop_strings, request_id=r.request_id, policy_version=self._version))
