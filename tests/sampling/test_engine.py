"""The rollout engines: the contract, the continuous engine against the static reference, prefix
reuse, back-pressure and the paged attention kernels.

The static engine is today's `Sampler` (tested against transformers and teacher-forced forwards
in test_sampler.py); the continuous engine must give every request the same tokens and, to fp32
rounding, the same log-probs, whatever the slot count, decode steps per call, admission order or
pool size. Log-probs of both are also checked against an independent teacher-forced forward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.models import decoder
from marl_jax.models.config import get_preset
from host import FAST_COMPILE
from marl_jax.sampling import continuous, paged_attention, registry
from marl_jax.sampling.continuous import ContinuousEngine
from marl_jax.sampling.engine import EngineOptions, EngineRequest, request_key, run_all
from marl_jax.sampling.params import SamplingParams
from marl_jax.sampling.static import StaticEngine

CONFIG = get_preset("tiny-llama")
WIDTH = 96  # longest prompt + completion the teacher-forced reference reads
# One engine shape for most tests, so they share compiled programs: 4-token pages, 4 decode
# steps per call, prefill calls of 64 tokens (one 64-token chunk or four 16-token ones).
OPTIONS = EngineOptions(page_size=4, pool_tokens=1024, decode_steps=4, prefill_chunk=64)


@pytest.fixture(autouse=True)
def fast_compiles(monkeypatch):
  """The engine's programs compiled with the suite's fast CPU options (host.FAST_COMPILE)."""
  real = continuous._programs
  monkeypatch.setattr(continuous, "_programs",
                      lambda config: real(config, tuple(sorted(FAST_COMPILE.items()))))


class CharTokenizer:
  """Token id -> a short string (ids 0..25 letters, 26..51 letter pairs), for stop strings."""

  pad_id = 0
  stop_token_ids = (255,)

  def encode(self, text: str) -> list[int]:
    return [ord(ch) - ord("a") for ch in text]

  def decode(self, ids) -> str:
    piece = lambda i: chr(97 + i % 26) * (1 if i < 26 else 2) if i < 52 else f"<{i}>"
    return "".join(piece(int(i)) for i in ids)


@pytest.fixture(scope="module")
def params():
  return decoder.init_params(CONFIG, jax.random.key(0), scale=0.5)


@pytest.fixture(scope="module")
def adapters():
  """Two LoRA adapter rows on the MLP's up projection and the attention's value projection."""
  L, D, r = CONFIG.num_hidden_layers, CONFIG.hidden_size, 4
  ks = jax.random.split(jax.random.key(8), 4)
  kv = CONFIG.num_key_value_heads * CONFIG.head_dim
  lora = {"mlp": {"up_proj": {"a": jax.random.normal(ks[0], (L, 2, D, r)),
                              "b": jax.random.normal(ks[1], (L, 2, r, CONFIG.intermediate_size))}},
          "self_attn": {"v_proj": {"a": jax.random.normal(ks[2], (L, 2, D, r)),
                                   "b": jax.random.normal(ks[3], (L, 2, r, kv))}}}
  return decoder.LoraAdapters(params=lora, policy_ids=jnp.zeros((1,), jnp.int32), scale=0.5)


def mixed_requests(n: int, seed: int, *, adapters: int = 1) -> list[EngineRequest]:
  """Requests as a team's rollout makes them: groups of identical prompts (G samples), prompts
  that extend others (a later turn), greedy / sampled / top-p agents, stop tokens, stop strings
  and budgets from 1 to 24 tokens, over `adapters` LoRA rows."""
  rng = np.random.default_rng(seed)
  base = jax.random.key(seed)
  settings = [SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(7,)),
              SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(),
                             stop_strings=("kk", "qq")),
              SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=20,
                             stop_token_ids=(3, 9)),
              SamplingParams(max_new_tokens=1, temperature=1.0)]
  out, prompts = [], []
  for i in range(n):
    if prompts and i % 4 == 1:
      prompt = prompts[-1]  # a group: the same prompt again
    elif prompts and i % 4 == 2:
      prompt = prompts[-1] + tuple(int(t) for t in rng.integers(0, 256, 9))  # a later turn
    else:
      prompt = tuple(int(t) for t in rng.integers(0, 256, rng.integers(2, 40)))
    prompts.append(prompt)
    out.append(EngineRequest(("req", i), prompt, settings[i % len(settings)],
                             request_key(base, i, 3), adapter=i % adapters))
  return out


def short_requests() -> list[EngineRequest]:
  """Two sampled requests of 6 tokens (a group of one prompt), one greedy request of 5."""
  sampled = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, stop_token_ids=())
  prompt = tuple(range(40, 57))
  return [EngineRequest(0, prompt, sampled, jax.random.key(0)),
          EngineRequest(1, prompt, sampled, jax.random.key(1)),
          EngineRequest(2, (3, 1, 4, 1, 5), SamplingParams(max_new_tokens=5, temperature=0.0,
                                                           stop_token_ids=()), jax.random.key(2))]


@functools.partial(jax.jit, static_argnames="n")
def _forward(params, seq, adapters, n):
  return decoder.forward(params, seq, jnp.arange(n)[None], CONFIG, adapters=adapters)[0]


def teacher_forced(params, request, completion, adapters=None):
  """log_softmax(logits / T) at each completion token, from one cache-free forward (NumPy)."""
  seq = list(request.prompt) + [int(t) for t in completion.tokens]
  padded = np.zeros((1, WIDTH), np.int32)
  padded[0, :len(seq)] = seq
  ad = None if adapters is None else adapters.replace(
      policy_ids=jnp.full((1,), request.adapter, jnp.int32))
  logits = np.asarray(_forward(params, jnp.asarray(padded), ad, WIDTH)[0], np.float64)
  logits = logits[len(request.prompt) - 1:len(seq) - 1] / request.sampling.logprob_temperature
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return logp[np.arange(len(completion.tokens)), completion.tokens]


def assert_same(reference, got):
  """Same tokens, texts and endings; log-probs within 1e-4, the bound the sampler tests hold
  against a teacher-forced forward (paths that compute a key/value in different matmul shapes,
  a prefill chunk or a decode step, round differently: up to ~5e-5 here)."""
  for r, g in zip(reference, got):
    assert g.request_id == r.request_id
    np.testing.assert_array_equal(g.tokens, r.tokens, err_msg=str(r.request_id))
    np.testing.assert_allclose(g.logprobs, r.logprobs, atol=1e-4, rtol=0)
    assert (g.finish_reason, g.text) == (r.finish_reason, r.text)


@pytest.fixture(scope="module")
def lora_case(params, adapters):
  """24 mixed requests over two LoRA rows, with stop strings, and the static engine's replies."""
  requests = mixed_requests(24, seed=1, adapters=2)
  static = StaticEngine(CONFIG, CharTokenizer())
  static.load(params, adapters, version=3)
  return requests, run_all(static, requests)


def test_static_reference_matches_a_teacher_forced_forward(params, adapters, lora_case):
  requests, reference = lora_case
  reasons = {c.finish_reason for c in reference}
  assert reasons == {"length", "stop_token", "stop_string"}  # the case covers every ending
  for r, c in zip(requests, reference):
    assert c.policy_version == 3 and len(c.tokens) <= r.sampling.max_new_tokens
    np.testing.assert_allclose(c.logprobs, teacher_forced(params, r, c, adapters), atol=1e-4)


@pytest.mark.parametrize("slots,steps,order", [(3, 2, "reversed"), (16, 4, "shuffled")])
def test_continuous_engine_returns_the_static_engines_replies(params, adapters, lora_case, slots,
                                                             steps, order):
  """Same tokens, texts and endings, log-probs to fp32 rounding, whatever the slot count, the
  decode steps per call and the order requests are submitted (so admitted) in; with the prefix
  cache on, groups and later turns reuse pages."""
  requests, reference = lora_case
  index = list(range(len(requests)))
  index = index[::-1] if order == "reversed" else list(np.random.default_rng(0).permutation(index))
  engine = ContinuousEngine(CONFIG, CharTokenizer(), dataclasses.replace(
      OPTIONS, slots=slots, decode_steps=steps))
  engine.load(params, adapters, version=3)
  got = run_all(engine, [requests[i] for i in index])
  assert_same([reference[i] for i in index], got)
  assert all(c.policy_version == 3 for c in got)
  stats = engine.stats()
  assert stats["prefix_hit_tokens"] > 0 and stats["prefilled_tokens"] < stats["prompt_tokens"]
  assert stats["requests"] == len(requests) and not engine.pending


def test_a_pool_too_small_for_all_requests_preempts_and_still_agrees(params, adapters, lora_case):
  """Back-pressure: 12 slots over a pool that holds ~3 requests. Requests wait for pages, and a
  running one is preempted (its pages freed, re-prefilled later) when decode runs out: every
  reply is still the reference's (a request's draws depend only on its key and step)."""
  requests, reference = lora_case
  engine = ContinuousEngine(CONFIG, CharTokenizer(), dataclasses.replace(
      OPTIONS, slots=12, pool_tokens=72))
  engine.load(params, adapters, version=3)
  assert_same(reference, run_all(engine, requests))
  stats = engine.stats()
  assert stats["preemptions"] > 0 and stats["peak_kv_bytes"] <= stats["pool_bytes"]


def test_a_request_larger_than_the_pool_is_refused_in_one_line(params):
  engine = ContinuousEngine(CONFIG, options=EngineOptions(page_size=4, pool_tokens=16))
  engine.load(params)
  big = EngineRequest("big", tuple(range(10)), SamplingParams(max_new_tokens=10), jax.random.key(0))
  with pytest.raises(ValueError, match=r"request 'big' needs 5 pages .* pool holds 4; raise "
                                       r"engine.pool_tokens") as e:
    engine.submit([big])
  assert "\n" not in str(e.value) and not engine.pending


def test_prefix_hits_give_the_logits_of_a_prefill(params):
  """A request whose first blocks are cached (a group sibling, and a later turn that extends a
  prompt + its reply, whose reply blocks decode wrote) computes only its tail, and gets what an
  engine without the cache computes: same tokens, log-probs to fp32 rounding."""
  sampling = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=())
  first = EngineRequest(0, tuple(range(30, 61)), sampling, jax.random.key(1))
  sibling = dataclasses.replace(first, request_id=1, key=jax.random.key(2))
  options = OPTIONS
  cached, plain = ContinuousEngine(CONFIG, options=options), ContinuousEngine(
      CONFIG, options=dataclasses.replace(options, prefix_cache=False))
  for engine in (cached, plain):
    engine.load(params)
  a = run_all(cached, [first, sibling])
  assert cached.stats()["prefix_hit_tokens"] == 28  # 7 of the 31-token prompt's 4-token blocks
  later = EngineRequest(2, first.prompt + tuple(int(t) for t in a[0].tokens) + (5, 6),
                        sampling, jax.random.key(3))
  a += run_all(cached, [later])
  # 31 + 10 - 1 = 40 tokens were in the pool when the first request ended: 10 blocks.
  assert cached.stats()["prefix_hit_tokens"] == 28 + 40
  b = run_all(plain, [first, sibling, later])
  assert plain.stats()["prefix_hit_tokens"] == 0
  for x, y, r in zip(a, b, (first, sibling, later)):
    np.testing.assert_array_equal(x.tokens, y.tokens)
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4, rtol=0)
    np.testing.assert_allclose(x.logprobs, teacher_forced(params, r, x), atol=1e-4)


def test_new_weights_drop_the_cached_prefixes(params):
  sampling = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=())
  request = EngineRequest(0, tuple(range(20)), sampling, jax.random.key(0))
  engine = ContinuousEngine(CONFIG, options=OPTIONS)
  engine.load(params, version=0)
  run_all(engine, [request])
  other = decoder.init_params(CONFIG, jax.random.key(5), scale=0.5)
  engine.load(other, version=1)
  got = run_all(engine, [dataclasses.replace(request, request_id=1)])[0]
  assert engine.stats()["prefix_hit_tokens"] == 0 and got.policy_version == 1
  np.testing.assert_allclose(got.logprobs, teacher_forced(other, request, got), atol=1e-4)


def test_the_contract_refuses_bad_use_in_one_line(params):
  request = EngineRequest(0, (1, 2), SamplingParams(max_new_tokens=2), jax.random.key(0))
  for name in registry.ENGINES:
    engine = registry.make_engine(name, CONFIG)
    with pytest.raises(ValueError, match="no weights; call load"):
      engine.submit([request])
  with pytest.raises(ValueError, match=r"rollout.engine='vllm'; expected one of \['continuous', "
                                       r"'static'\]"):
    registry.make_engine("vllm", CONFIG)
  engine = registry.make_engine("continuous", CONFIG)
  engine.load(params)
  for bad, message in [(dict(prompt=()), "empty prompt"),
                       (dict(prompt=(1, 999)), r"token ids \[999\] outside \[0, 256\)"),
                       (dict(adapter=1), r"adapter 1; the engine's adapters have rows \[0, 1\)"),
                       (dict(sampling=SamplingParams(max_new_tokens=600)), "context is 512")]:
    with pytest.raises(ValueError, match=message):
      engine.submit([dataclasses.replace(request, **bad)])
  for field, value in [("slots", 0), ("page_size", 1.5), ("pool_gib", -1.0),
                       ("attention", "flash"), ("prefix_cache", "yes")]:
    with pytest.raises(ValueError, match=f"^{field}={value!r}; expected"):
      EngineOptions(**{field: value})


def test_pallas_kernel_matches_the_gather_path_in_interpret_mode():
  """jax's Pallas GPU paged-attention kernel, run by the Pallas interpreter on CPU, against the
  portable gather path over the same pool, block tables (offset into a stacked pool) and
  positions."""
  rng = np.random.default_rng(0)
  Hkv, N, page, Dh, Hq, B, P = 2, 48, 4, 16, 4, 3, 16
  k, v = (jnp.asarray(rng.normal(size=(Hkv, N, page, Dh)), jnp.float32) for _ in range(2))
  tables = jnp.asarray(rng.integers(1, N, size=(B, P)), jnp.int32)
  q = jnp.asarray(rng.normal(size=(B, 1, Hq, Dh)), jnp.float32)
  positions = jnp.asarray([[0], [17], [P * page - 1]], jnp.int32)
  got = paged_attention.pallas_decode(q, k, v, tables, positions, interpret=True)
  want = paged_attention.gather(q, k, v, tables, positions)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  assert paged_attention.choose("auto", decode=True, q_shape=(B, 1, Hq, Dh),
                                pool_shape=k.shape, pages=P, dtype=k.dtype) is (
      paged_attention.gather)  # off GPU, "auto" decodes with the portable path


def test_engine_decodes_through_the_pallas_kernel(params):
  """attention="pallas" (interpret mode on CPU): the engine's replies are the gather path's."""
  requests = short_requests()
  replies = []
  for attention in ("gather", "pallas"):
    engine = ContinuousEngine(CONFIG, options=dataclasses.replace(OPTIONS, slots=4,
                                                                  attention=attention))
    engine.load(params)
    replies.append(run_all(engine, requests))
  assert_same(*replies)


def test_fsdp_sharded_params_decode_as_one_device_does(params):
  """The trainer hands the engine FSDP-sharded params on its mesh (8 fake CPU devices here): the
  pool follows them onto the mesh and every reply is the single-device engine's."""
  from marl_jax.parallel import mesh as mesh_lib
  from marl_jax.parallel import sharding

  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip(f"needs 8 devices, found {len(devices)}")
  mesh = mesh_lib.make_mesh(1, 8, 1)
  specs = sharding.model_specs(params, 8, min_elements=1)
  sharded = jax.device_put(params, jax.tree.map(
      lambda s: jax.sharding.NamedSharding(mesh, s), specs,
      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
  assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(sharded))
  requests = short_requests()
  replies = []
  for p in (params, sharded):
    engine = ContinuousEngine(CONFIG, CharTokenizer(), dataclasses.replace(OPTIONS, slots=4))
    engine.load(p)
    replies.append(run_all(engine, requests))
  assert_same(*replies)
