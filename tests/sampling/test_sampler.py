"""Sampler tests: log-probs, truncation, seeds, stops, padding invariance, shared prompts, decode
blocks, recompiles, HF parity.

References are independent of the sampler: teacher-forced forwards without cache or padding,
log-softmax / top-k / top-p re-derived in NumPy, and transformers' PyTorch `generate` on the real
SmolLM2 GGUF.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.models import decoder
from marl_jax.models.config import get_preset
from marl_jax.sampling.params import SamplingParams
from marl_jax.sampling.decode import block_spans
from marl_jax.sampling import sampler as sampler_lib
from marl_jax.sampling.sampler import Buckets, Sampler, prompt_layout
from marl_jax.shapes import bucket, fine_bucket, round_bucket, round_up

CONFIG = get_preset("tiny-llama")
TEACHER_WIDTH = 64  # longest prompt + completion the tests teacher-force
PROMPTS = [[5, 17, 42], [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [99], [200, 201, 202, 203, 204]]


@pytest.fixture(scope="module")
def params():
  # Larger-than-default init makes next-token distributions peaked (a few to ~20 likely tokens
  # out of 256), so top-k and top-p actually remove tokens.
  return decoder.init_params(CONFIG, jax.random.key(0), scale=0.5)


@pytest.fixture(scope="module")
def sampler():
  return Sampler(CONFIG)


@functools.partial(jax.jit, static_argnames="n")
def _forward(params, seq, adapters, n):
  return decoder.forward(params, seq, jnp.arange(n)[None], CONFIG, adapters=adapters)[0]


def teacher_forced_logits(params, prompt, completion, adapters=None):
  """Logits [n, V] (NumPy) predicting each completion token: one cache-free forward over the
  unpadded sequence (right-padded to a fixed width so the jitted forward compiles once; causal
  attention keeps the trailing filler from affecting earlier positions)."""
  seq = list(prompt) + [int(t) for t in completion]
  padded = np.zeros((1, TEACHER_WIDTH), np.int32)
  padded[0, :len(seq)] = seq
  logits = _forward(params, jnp.asarray(padded), adapters, TEACHER_WIDTH)
  return np.asarray(logits[0, len(prompt) - 1:len(seq) - 1], np.float64)


def np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_allowed(logits, temperature, top_k, top_p):
  """Set of token ids allowed by temperature -> top-k -> top-p (renormalised), in NumPy."""
  scaled = logits / temperature
  order = np.argsort(-scaled, kind="stable")
  if top_k:
    order = order[:top_k]
  probs = np.exp(scaled[order] - scaled[order].max())
  probs /= probs.sum()
  before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
  return set(order[before < top_p].tolist())


def test_sampling_params_validation():
  for bad in [dict(max_new_tokens=0), dict(temperature=-0.1), dict(temperature=float("nan")),
              dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.5),
              dict(stop_token_ids=[-3]), dict(stop_token_ids="2"), dict(stop_strings=[""]),
              dict(stop_strings="END")]:
    key = next(iter(bad))
    with pytest.raises(ValueError, match=key):
      SamplingParams(**bad)
  sp = SamplingParams(stop_token_ids=[1, 2], stop_strings=["x"])
  assert sp.stop_token_ids == (1, 2) and sp.stop_strings == ("x",)
  assert SamplingParams(temperature=0).greedy
  assert not SamplingParams(temperature=0, top_k=3).truncates  # greedy ignores truncation


def test_bucket_rounds_up_to_powers_of_two():
  assert [bucket(n, 8) for n in (1, 8, 9, 16, 17, 100)] == [8, 8, 16, 16, 32, 128]


def test_round_up_to_block_multiples():
  assert [round_up(n, 64) for n in (0, 1, 64, 65, 270, 512)] == [64, 64, 64, 128, 320, 512]
  assert [round_up(n, 8) for n in (1, 8, 9, 17)] == [8, 8, 16, 24]
  assert [round_bucket(n, 8) for n in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 16, 24]


def test_fine_buckets_are_the_smallest_power_or_three_halves_power():
  """The continuous engine's rows and table widths: the smallest of {2^k, 3 * 2^(k-1)} >= n."""
  sizes = sorted({2**k for k in range(12)} | {3 * 2**k for k in range(11)})
  for n in range(1, 1025):
    assert fine_bucket(n, 1) == min(s for s in sizes if s >= n), n
  assert [fine_bucket(n, 4) for n in (1, 4, 5, 7, 13, 17, 33)] == [4, 4, 6, 8, 16, 24, 48]


def test_prompt_layout_fewest_rows_then_fewest_prefills():
  # Rows as U entries x R: [8, 8] fits 16 rows with R = 1, 2, 4 or 8 (16 / 8 / 4 / 2 entries);
  # the tie goes to R = 8 (2 prefills).
  assert prompt_layout([8, 8], 8) == (2, 8)
  assert prompt_layout([1] * 8, 8) == (8, 1)
  # 15 entries -> 16 rows at R = 1; R = 2 needs 4 + 7 = 11 entries -> 16 x 2 = 32 rows.
  assert prompt_layout([8] + [1] * 7, 8) == (16, 1)
  # R = 1: 9 entries -> 16 rows; R = 2: 3 + 1 + 1 + 1 = 6 -> 8 x 2 = 16 (tie, larger R); R = 4:
  # 5 -> 8 x 4 = 32.
  assert prompt_layout([5, 2, 1, 1], 8) == (8, 2)
  assert prompt_layout([3], 8) == (1, 4)  # 4 rows at R = 1, 2 or 4
  for bad in ([], [2, 0]):
    with pytest.raises(ValueError, match="row counts"):
      prompt_layout(bad, 8)


def test_block_spans():
  assert block_spans(20, 8) == [8, 16, 20]
  assert block_spans(64, 64) == [64] and block_spans(64, 0) == [64] and block_spans(16, 32) == [16]
  assert block_spans(256, 64) == [64, 128, 192, 256]


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20, stop_token_ids=()),
    SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=()),
])
def test_logprobs_equal_teacher_forced_forward(params, sampler, sampling):
  out = sampler.generate(params, PROMPTS, sampling, jax.random.key(3))
  for prompt, c in zip(PROMPTS, out):
    assert len(c.tokens) == 12 and c.finish_reason == "length" and c.prompt_length == len(prompt)
    logp = np_log_softmax(teacher_forced_logits(params, prompt, c.tokens) /
                          sampling.logprob_temperature)
    expected = logp[np.arange(len(c.tokens)), c.tokens]
    np.testing.assert_allclose(c.logprobs, expected, atol=1e-4, rtol=0)
    if sampling.greedy:
      np.testing.assert_array_equal(c.tokens, logp.argmax(-1))


def test_lora_policies_per_row(params, sampler):
  """Each row samples from its own adapter; log-probs match a forward with that adapter."""
  L, D, r = CONFIG.num_hidden_layers, CONFIG.hidden_size, 4
  q_out = CONFIG.num_attention_heads * CONFIG.head_dim
  ka, kb = jax.random.split(jax.random.key(7))
  lora = {"self_attn": {"q_proj": {"a": jax.random.normal(ka, (L, 2, D, r)),
                                   "b": jax.random.normal(kb, (L, 2, r, q_out))}}}
  adapters = decoder.LoraAdapters(params=lora, policy_ids=jnp.array([0, 1, 1, 0]), scale=0.5)
  sampling = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=())
  out = sampler.generate(params, PROMPTS, sampling, jax.random.key(0), adapters=adapters)
  base = sampler.generate(params, PROMPTS, sampling, jax.random.key(0))
  assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(out, base))
  for i, (prompt, c) in enumerate(zip(PROMPTS, out)):
    row = decoder.LoraAdapters(params=lora, policy_ids=adapters.policy_ids[i:i + 1], scale=0.5)
    logp = np_log_softmax(teacher_forced_logits(params, prompt, c.tokens, adapters=row))
    np.testing.assert_allclose(c.logprobs, logp[np.arange(8), c.tokens], atol=1e-4, rtol=0)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (8, 0.8), (1, 1.0)])
def test_truncation_never_emits_disallowed_tokens(params, sampler, top_k, top_p):
  temperature = 1.3
  prompts = PROMPTS + PROMPTS  # same prompts, different row keys
  sampling = SamplingParams(max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p,
                            stop_token_ids=())
  emitted, checked = set(), 0
  for seed in range(4):
    out = sampler.generate(params, prompts, sampling, jax.random.key(seed))
    for prompt, c in zip(prompts, out):
      logits = teacher_forced_logits(params, prompt, c.tokens)
      for t, token in enumerate(c.tokens):
        allowed = np_allowed(logits[t], temperature, top_k, top_p)
        assert int(token) in allowed, (top_k, top_p, t, int(token), sorted(allowed))
        emitted.add((tuple(prompt), len(allowed), int(token)))
        checked += 1
  assert checked == 4 * 8 * 8
  if top_k != 1:  # the test is not vacuous: sampling really varied within allowed sets
    assert len({e[2] for e in emitted}) > 20


def test_top_k_1_is_greedy(params, sampler):
  greedy = sampler.generate(params, PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0),
                            jax.random.key(0))
  top1 = sampler.generate(params, PROMPTS, SamplingParams(max_new_tokens=6, temperature=2.0,
                                                          top_k=1), jax.random.key(5))
  for g, t in zip(greedy, top1):
    np.testing.assert_array_equal(g.tokens, t.tokens)


def test_same_seed_same_samples_different_seed_differs(params, sampler):
  sampling = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95)
  run = lambda seed: np.stack([c.tokens for c in sampler.generate(
      params, PROMPTS, sampling, jax.random.key(seed))])
  np.testing.assert_array_equal(run(11), run(11))
  assert not np.array_equal(run(11), run(12))


def test_left_padding_invariance(params, sampler):
  """A row's output does not depend on the other rows (nor on how much padding it gets)."""
  for sampling in [SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=()),
                   SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=())]:
    alone = sampler.generate(params, PROMPTS[:1], sampling, jax.random.key(4))[0]
    long_neighbour = [PROMPTS[0], list(range(1, 30)), [3]]
    batched = sampler.generate(params, long_neighbour, sampling, jax.random.key(4))[0]
    np.testing.assert_array_equal(alone.tokens, batched.tokens)
    np.testing.assert_allclose(alone.logprobs, batched.logprobs, atol=1e-5, rtol=0)


def test_stop_token_finishes_row_only(params, sampler):
  free = sampler.generate(params, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0,
                                                          stop_token_ids=()), jax.random.key(0))
  stop = int(free[0].tokens[3])
  first = [int(np.argmax(c.tokens == stop)) if stop in c.tokens else None for c in free]
  out = sampler.generate(params, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0,
                                                         stop_token_ids=(stop, 255)),
                         jax.random.key(0))
  for f, c, n in zip(free, out, first):
    if n is None:
      assert c.finish_reason == "length" and len(c.tokens) == 10
      np.testing.assert_array_equal(c.tokens, f.tokens)
    else:
      assert c.finish_reason == "stop_token" and len(c.tokens) == n + 1
      assert c.tokens[-1] == stop  # the stop token is kept, with its log-prob
      np.testing.assert_array_equal(c.tokens, f.tokens[:n + 1])
      np.testing.assert_allclose(c.logprobs, f.logprobs[:n + 1], atol=1e-6)
  assert out[0].finish_reason == "stop_token" and len(out[0].tokens) <= 4


class CharTokenizer:
  """Token id -> a short string; ids 0..25 are letters, 26..51 are two-letter pairs."""

  pad_id = 0

  def __init__(self, stop_token_ids=(255,)):
    self.stop_token_ids = stop_token_ids

  def piece(self, i: int) -> str:
    letter = chr(ord("a") + i % 26)
    return letter if i < 26 else (letter + letter if i < 52 else f"<{i}>")

  def encode(self, text: str) -> list[int]:
    return [ord(ch) - ord("a") for ch in text]

  def decode(self, ids) -> str:
    return "".join(self.piece(int(i)) for i in ids)


@pytest.fixture(scope="module")
def char_sampler():
  return Sampler(CONFIG, CharTokenizer())


def test_stop_strings_truncate_text_and_tokens(params, char_sampler):
  tok, sampler = char_sampler.tokenizer, char_sampler
  base = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=())
  free = sampler.generate(params, ["abc", "hello"], base, jax.random.key(0))
  assert [c.text for c in free] == [tok.decode(c.tokens) for c in free]
  text = free[0].text
  # A stop string that ends in the middle of the 5th token's text (two-letter tokens included).
  cut = len(tok.decode(free[0].tokens[:4]))
  stop = text[cut - 1:cut + 1]
  first = text.find(stop)
  out = sampler.generate(params, ["abc", "hello"], base.replace(stop_strings=("\x00never", stop)),
                         jax.random.key(0))
  c = out[0]
  assert c.finish_reason == "stop_string" and c.text == text[:first]
  n = len(c.tokens)  # tokens end with the one that completes the stop string
  assert stop in tok.decode(c.tokens) and stop not in tok.decode(c.tokens[:n - 1])
  np.testing.assert_array_equal(c.tokens, free[0].tokens[:n])
  np.testing.assert_array_equal(c.logprobs, free[0].logprobs[:n])
  if stop not in free[1].text:
    assert out[1].finish_reason == "length" and out[1].text == free[1].text


def test_tokenizer_stop_ids_are_the_default(params, char_sampler):
  prompts = ["abc", "xyz", "hello", "q"] * 2
  free = char_sampler.generate(params, prompts, SamplingParams(
      max_new_tokens=16, temperature=1.0, stop_token_ids=()), jax.random.key(1))
  stop = int(free[0].tokens[2])  # a token that does come up
  tok = CharTokenizer(stop_token_ids=(stop,))
  out = Sampler(CONFIG, tok).generate(params, prompts, SamplingParams(
      max_new_tokens=16, temperature=1.0), jax.random.key(1))
  for o, f in zip(out, free):
    if stop in f.tokens.tolist():
      n = f.tokens.tolist().index(stop) + 1
      assert o.finish_reason == "stop_token" and o.tokens.tolist() == f.tokens[:n].tolist()
      assert o.text == tok.decode(o.tokens[:-1])
    else:
      assert o.finish_reason == "length" and o.tokens.tolist() == f.tokens.tolist()
  assert out[0].finish_reason == "stop_token"


SHARED = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3],
          PROMPTS[0], PROMPTS[0]]  # 9 rows, 4 distinct prompts (5 copies of the first): 8 x 2
GROUPS = [PROMPTS[1], PROMPTS[2]] * 4  # 2 prompts x 4 samples, interleaved: 2 x 4


@pytest.fixture(scope="module")
def unshared_sampler():
  return Sampler(CONFIG, share_prompts=False)


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=()),
    SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, stop_token_ids=()),
    SamplingParams(max_new_tokens=12, temperature=0.8, stop_token_ids=(7, 11)),
])
@pytest.mark.parametrize("prompts", [SHARED, GROUPS], ids=["mixed", "groups"])
def test_shared_prefill_equals_unshared(params, sampler, unshared_sampler, sampling, prompts):
  """Prefilling each distinct prompt once and decoding its rows against it as one shared prefix
  gives every row what prefilling it alone gives (same keys), and log-probs still equal a
  teacher-forced forward."""
  counts = [prompts.count(p) for p in {tuple(p): p for p in prompts}.values()]
  assert prompt_layout(counts, 8)[1] == (2 if prompts is SHARED else 4)  # rows share prefixes
  shared = sampler.generate(params, prompts, sampling, jax.random.key(2))
  unshared = unshared_sampler.generate(params, prompts, sampling, jax.random.key(2))
  for prompt, s, u in zip(prompts, shared, unshared):
    np.testing.assert_array_equal(s.tokens, u.tokens)
    np.testing.assert_allclose(s.logprobs, u.logprobs, atol=1e-5, rtol=0)
    assert s.finish_reason == u.finish_reason
    logp = np_log_softmax(teacher_forced_logits(params, prompt, s.tokens) /
                          sampling.logprob_temperature)
    np.testing.assert_allclose(s.logprobs, logp[np.arange(len(s.tokens)), s.tokens], atol=1e-4)
  copies = {tuple(c.tokens) for p, c in zip(prompts, shared) if p == prompts[0]}
  assert len(copies) == (1 if sampling.greedy else prompts.count(prompts[0]))  # sampled apart


def test_shared_prefill_keeps_policies_apart(params, sampler, unshared_sampler):
  """The same prompt under two LoRA policies is two prefills, not one, and each prompt entry's
  rows decode under its policy (4 entries x 4 rows here: (P1, 0) x 4, (P1, 1) x 4, (P2, 1))."""
  L, D, r = CONFIG.num_hidden_layers, CONFIG.hidden_size, 4
  ka, kb = jax.random.split(jax.random.key(8))
  lora = {"mlp": {"up_proj": {"a": jax.random.normal(ka, (L, 2, D, r)),
                              "b": jax.random.normal(kb, (L, 2, r, CONFIG.intermediate_size))}}}
  prompts = [PROMPTS[1]] * 8 + [PROMPTS[2]]
  assert prompt_layout([4, 4, 1], 8) == (4, 4)
  adapters = decoder.LoraAdapters(params=lora, policy_ids=jnp.array([0, 1] * 4 + [1]), scale=0.5)
  sampling = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=())
  shared = sampler.generate(params, prompts, sampling, jax.random.key(0), adapters=adapters)
  unshared = unshared_sampler.generate(params, prompts, sampling, jax.random.key(0),
                                       adapters=adapters)
  for s, u in zip(shared, unshared):
    np.testing.assert_array_equal(s.tokens, u.tokens)
    np.testing.assert_allclose(s.logprobs, u.logprobs, atol=1e-5, rtol=0)
  assert not np.array_equal(shared[0].tokens, shared[1].tokens)
  np.testing.assert_array_equal(shared[0].tokens, shared[2].tokens)


def test_decode_blocks_equal_one_span(params):
  """Attending over a growing cache (blocks of 4 steps) changes nothing but the work done."""
  blocked, whole = Sampler(CONFIG, decode_block=4), Sampler(CONFIG, decode_block=0)
  free = SamplingParams(max_new_tokens=19, temperature=1.0, stop_token_ids=())
  first = whole.generate(params, SHARED, free, jax.random.key(6))
  stops = (int(first[0].tokens[6]), int(first[1].tokens[13]))  # rows end in different blocks
  for sampling in [free.replace(temperature=0.0), free.replace(stop_token_ids=stops)]:
    a = blocked.generate(params, SHARED, sampling, jax.random.key(6))
    b = whole.generate(params, SHARED, sampling, jax.random.key(6))
    for prompt, x, y in zip(SHARED, a, b):
      np.testing.assert_array_equal(x.tokens, y.tokens)
      # The two paths reduce attention over different lengths, so their fp32 rounding differs,
      # by an amount that scales with the log-prob: on an AMD EPYC (AVX2) VM 1.2e-5 at -1.47 and
      # 2.1e-5 at -6.89 (atol 1e-5 alone had held on the CPU this was written on). The
      # independent reference below bounds both paths at 1e-4.
      np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=1e-5)
      assert x.finish_reason == y.finish_reason
      logp = np_log_softmax(teacher_forced_logits(params, prompt, x.tokens))
      np.testing.assert_allclose(x.logprobs, logp[np.arange(len(x.tokens)), x.tokens], atol=1e-4)
  assert a[0].finish_reason == "stop_token" and len({len(c.tokens) for c in a}) > 2


def test_bucketing_bounds_recompiles(params, monkeypatch):
  traces = []  # one entry per program jax traces (and compiles) for the sampler
  real = sampler_lib.generate_tokens
  monkeypatch.setattr(sampler_lib, "generate_tokens",
                      lambda *args, **kwargs: traces.append(1) or real(*args, **kwargs))
  sampler = Sampler(CONFIG, buckets=Buckets(row_multiple=4, prompt_block=16,
                                            new_token_multiple=8))
  rng = np.random.default_rng(0)
  other = decoder.init_params(CONFIG, jax.random.key(1), scale=0.5)
  for i in range(12):  # 3..4 rows (3..4 distinct), prompts of 1..16 tokens, 1..8 new tokens
    prompts = [rng.integers(0, 256, rng.integers(1, 17)).tolist() for _ in range(4)]
    prompts = prompts[:3] + [prompts[rng.integers(0, 4)]]
    sampling = SamplingParams(max_new_tokens=int(rng.integers(1, 9)),
                              temperature=float(rng.uniform(0.5, 1.5)),
                              stop_token_ids=tuple(rng.integers(0, 256, rng.integers(0, 4))))
    sampler.generate(params if i % 2 else other, prompts[:3 + i % 2], sampling,
                     jax.random.key(i))
  assert len(traces) == 1
  sampler.generate(params, [[1]] * 5, SamplingParams(max_new_tokens=4), jax.random.key(0))
  assert len(traces) == 2  # 5 rows -> 8, one distinct prompt -> 1
  sampler.generate(params, [[1]] * 7, SamplingParams(max_new_tokens=4), jax.random.key(0))
  assert len(traces) == 2
  sampler.generate(params, [[i] for i in range(5)], SamplingParams(max_new_tokens=4),
                   jax.random.key(0))
  assert len(traces) == 3  # 5 distinct prompts -> 8
  sampler.generate(params, [[i] for i in range(7)] + [[0]], SamplingParams(max_new_tokens=4),
                   jax.random.key(0))
  assert len(traces) == 3
  sampler.generate(params, [[1] * 17] * 5, SamplingParams(max_new_tokens=4), jax.random.key(0))
  assert len(traces) == 4  # width 17 -> 32 (the next multiple of 16)
  sampler.generate(params, [[1] * 32] * 5, SamplingParams(max_new_tokens=4), jax.random.key(0))
  assert len(traces) == 4
  sampler.generate(params, [[1]] * 5, SamplingParams(max_new_tokens=4, top_p=0.9),
                   jax.random.key(0))
  assert len(traces) == 5  # the truncating variant


def test_errors_name_the_bad_value(params, sampler):
  with pytest.raises(ValueError, match="context is 512"):
    sampler.generate(params, [[1] * 500], SamplingParams(max_new_tokens=13), jax.random.key(0))
  with pytest.raises(ValueError, match="no tokenizer"):
    sampler.generate(params, ["text"], SamplingParams(), jax.random.key(0))
  with pytest.raises(ValueError, match=r"\[300\]"):
    sampler.generate(params, [[1, 300]], SamplingParams(), jax.random.key(0))
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    sampler.generate(params, [[1], []], SamplingParams(), jax.random.key(0))
  with pytest.raises(ValueError, match="top_k=20 exceeds the Sampler's top_candidates=8"):
    Sampler(CONFIG, top_candidates=8).generate(params, [[1]], SamplingParams(top_k=20),
                                               jax.random.key(0))
  with pytest.raises(ValueError, match="decode_block=-1"):
    Sampler(CONFIG, decode_block=-1)


CHAT = ["Hi!", "What is the capital of France?",
        "Write a short poem about a cat who learns to play the piano in a small town.",
        "List three prime numbers greater than ten, and explain in one sentence how you would "
        "check that a number is prime without a calculator."]


@pytest.fixture(scope="module")
def smollm2():
  from marl_jax.models.loading import load_model
  return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def torch_smollm2(transformers_smollm2):
  """transformers' own GGUF loader (dequantised to fp32), independent of marl_jax's loader
  (`conftest.py`)."""
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(transformers_smollm2,
                                                           dtype=torch.float32).eval()


def test_greedy_matches_transformers_generate_on_smollm2(smollm2, torch_smollm2):
  import torch
  tok = smollm2.tokenizer
  ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}])) for m in CHAT]
  assert len({len(i) for i in ids}) == len(ids)  # prompts of different lengths...
  assert max(map(len, ids)) <= 64  # ...all in one 64-token bucket
  out = Sampler(smollm2.config, tok, Buckets(row_multiple=4)).generate(  # + a shared prompt
      smollm2.params, ids + [ids[1]],
      SamplingParams(max_new_tokens=32, temperature=0.0, stop_token_ids=()), jax.random.key(0))
  width = max(map(len, ids))  # transformers gets the same left-padded batch
  inputs = torch.tensor([[tok.pad_id] * (width - len(i)) + i for i in ids])
  mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # OpenMP spinning makes torch ~10x slower on a busy 2-core machine
  try:
    with torch.no_grad():
      ref = torch_smollm2.generate(inputs, attention_mask=mask, max_new_tokens=32,
                                   do_sample=False, pad_token_id=tok.pad_id,
                                   eos_token_id=None)[:, width:].numpy()
  finally:
    torch.set_num_threads(threads)
  for i, c in zip(list(range(len(ids))) + [1], out):
    assert c.finish_reason == "length" and c.prompt_length == len(ids[i])
    np.testing.assert_array_equal(c.tokens, ref[i], err_msg=f"prompt {i}: {CHAT[i]!r}")
