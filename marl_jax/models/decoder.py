"""The decoder: a pure function of a params pytree (layout in `config.py`).

`forward(params, tokens, positions, config, ...)` serves four callers with one code path:
training (no cache, full sequences), prefill (writes a KV cache), decode (one token per row,
reads and extends the cache) and the rollout engine's paged forward (`PagedKV`: writes this
call's keys/values into pages of a pool it does not own, then attends over each row's pages). Layers are scanned over their stacked `[L, ...]` weights, so compile
time does not grow with depth and a `layer_hook` can all-gather each layer's FSDP shards inside the
scan. Per-agent LoRA adapters are selected per row by `policy_ids`.

Padding convention: prompts are left-padded; `attn_mask[b, t]` is False on padding, and
`positions` count only real tokens, so a row's logits do not depend on how much padding it got.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from absl import logging

from marl_jax.models.config import ModelConfig

Params = dict[str, Any]
LayerHook = Callable[[Params], Params]
# (q [B, T, Hq, Dh], k_pool, v_pool [Hkv, L * N, page, Dh], block_tables [B, P] (layer-offset
# page ids), positions [B, T]) -> attention output [B, T, Hq * Dh]: `PagedKV.attend`.
PagedAttention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer for S slots. Slot s of all rows is written at the same step.

  Heads before slots, [B, Hkv, S, Dh] per layer: the attention dots then read each head's slots
  as one contiguous matrix (with slots before heads, XLA transposed every layer's cache at every
  decode step).
  """

  k: jax.Array  # [L, B, Hkv, S, Dh]
  v: jax.Array  # [L, B, Hkv, S, Dh]
  mask: jax.Array  # [B, S] bool: slot holds a real (non-padding) token
  index: jax.Array  # [] int32: next slot to write


@flax.struct.dataclass
class LoraAdapters:
  """Per-policy low-rank adapters over a frozen base, chosen per row.

  `params` mirrors `params['layers']` for the adapted projections, each with `a: [L, P, in, r]`
  and `b: [L, P, r, out]`; `policy_ids: [B]` picks the adapter of each row.
  """

  params: Params
  policy_ids: jax.Array  # [B] int32
  scale: float = flax.struct.field(pytree_node=False, default=1.0)  # alpha / rank


@flax.struct.dataclass
class PagedKV:
  """A forward's view of a paged K/V pool, which the rollout engine owns (`sampling/kv_pool.py`
  allocates its pages, `sampling/paged_runner.py` calls the forward).

  Row b's position t lives in page `block_tables[b, t // page]` at offset `t % page`. The pool
  keeps every layer in one array, [Hkv, L * N, page, Dh] with layer l's page p at entry
  l * N + p, so a layer's attention reads its pages through block tables offset by l * N
  instead of a slice of the pool (a slice would copy it; a Pallas kernel takes the whole array).
  Heads lead because the paged attention kernels (`jax.experimental.pallas.ops`) read
  [Hkv, pages, page, Dh]. Page 0 is scratch: writes of tokens that are not `valid` go there and
  no row reads it.
  """

  k: jax.Array  # [Hkv, L * N, page, Dh]
  v: jax.Array  # [Hkv, L * N, page, Dh]
  block_tables: jax.Array  # [B, P] int32 page ids in [0, N); 0 past a row's pages
  lengths: jax.Array  # [B] int32: this call's tokens take positions lengths .. lengths + T - 1
  valid: jax.Array  # [B, T] bool: a real token of this call (False: padding)
  attend: PagedAttention = flax.struct.field(pytree_node=False)


def init_cache(config: ModelConfig, batch: int, max_len: int) -> KVCache:
  shape = (config.num_hidden_layers, batch, config.num_key_value_heads, max_len, config.head_dim)
  dtype = jnp.dtype(config.compute_dtype)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 mask=jnp.zeros((batch, max_len), bool), index=jnp.zeros((), jnp.int32))


def init_params(config: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
  """Random params (normal(0, scale) kernels, unit norms); used for tests and fresh heads."""
  c = config
  L, D, F, V = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size
  q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
  dtype = jnp.dtype(c.param_dtype)
  keys = iter(jax.random.split(key, 16))

  def normal(*shape):
    return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  attn = {"q_proj": {"kernel": normal(L, D, q_out)}, "k_proj": {"kernel": normal(L, D, kv_out)},
          "v_proj": {"kernel": normal(L, D, kv_out)}, "o_proj": {"kernel": normal(L, q_out, D)}}
  if c.attention_bias:
    for name, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
      attn[name]["bias"] = normal(L, out)
  if c.qk_norm:
    attn["q_norm"] = {"scale": jnp.ones((L, c.head_dim), dtype)}
    attn["k_norm"] = {"scale": jnp.ones((L, c.head_dim), dtype)}
  params = {
      "embed_tokens": {"embedding": normal(V, D)},
      "layers": {
          "input_layernorm": {"scale": jnp.ones((L, D), dtype)},
          "self_attn": attn,
          "post_attention_layernorm": {"scale": jnp.ones((L, D), dtype)},
          "mlp": {"gate_proj": {"kernel": normal(L, D, F)}, "up_proj": {"kernel": normal(L, D, F)},
                  "down_proj": {"kernel": normal(L, F, D)}},
      },
      "norm": {"scale": jnp.ones((D,), dtype)},
  }
  if not c.tie_word_embeddings:
    params["lm_head"] = {"kernel": normal(D, V)}
  return params


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in fp32 (as HF does) and cast back to the input dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
  """Inverse RoPE frequencies [Dh/2], with Llama-3 frequency scaling when configured."""
  c = config
  inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, c.head_dim, 2, dtype=jnp.float32) / c.head_dim))
  if c.rope_scaling_factor == 1.0:
    return inv_freq
  wavelen = 2 * math.pi / inv_freq
  low_freq_wavelen = c.rope_original_max_position / c.rope_low_freq_factor
  high_freq_wavelen = c.rope_original_max_position / c.rope_high_freq_factor
  scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / c.rope_scaling_factor, inv_freq)
  smooth = ((c.rope_original_max_position / wavelen - c.rope_low_freq_factor)
            / (c.rope_high_freq_factor - c.rope_low_freq_factor))
  smoothed = (1 - smooth) * scaled / c.rope_scaling_factor + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotates x: [B, T, H, Dh] by positions: [B, T] (HF's rotate-half layout)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _project(x: jax.Array, p: Params, lora: Params | None, adapters: LoraAdapters | None):
  """x: [B, T, in] -> [B, T, out], plus the row's LoRA delta when this projection is adapted."""
  y = x @ p["kernel"].astype(x.dtype)
  if "bias" in p:
    y = y + p["bias"].astype(x.dtype)
  if lora is not None:
    a = lora["a"][adapters.policy_ids].astype(x.dtype)  # [B, in, r]
    b = lora["b"][adapters.policy_ids].astype(x.dtype)  # [B, r, out]
    y = y + adapters.scale * jnp.einsum("btr,bro->bto", jnp.einsum("bti,bir->btr", x, a), b)
  return y


def _by_prompt(x: jax.Array, rows: int) -> jax.Array:
  """[B, Hkv, M, ...] -> [B / rows, Hkv, rows * M, ...]: each group of `rows` consecutive rows
  becomes one matrix of rows * M query rows (rows = 1: a reshape of nothing)."""
  B, H, M = x.shape[:3]
  x = x.reshape(B // rows, rows, H, M, *x.shape[3:]).swapaxes(1, 2)
  return x.reshape(B // rows, H, rows * M, *x.shape[4:])


def _by_row(x: jax.Array, rows: int) -> jax.Array:
  """The inverse of `_by_prompt`: [U, Hkv, rows * M, ...] -> [U * rows, Hkv, M, ...]."""
  U, H, RM = x.shape[:3]
  x = x.reshape(U, H, rows, RM // rows, *x.shape[3:]).swapaxes(1, 2)
  return x.reshape(U * rows, H, RM // rows, *x.shape[4:])


def attention(q, k, v, mask, past=()):
  """q: [B, T, Hq, Dh]; k, v: [B, Hkv, T, Dh], this call's; mask: [B, T, T] -> [B, T, Hq*Dh].

  past: cached slots the queries also attend to, a tuple of (k, v [Bp, Hkv, S, Dh], mask
  [Bp, S]) parts, where Bp divides B and B / Bp consecutive rows read the same entry (a prompt's
  keys/values shared by its samples: `hidden_states`'s prefix; Bp = B for a per-row cache). All parts'
  scores and this call's share one softmax, and the caches are only read: writing this call's
  keys/values into a cache before attending would copy every layer's [B, S] cache at every
  decode step, while the one write after the layers touches only the T new slots (in place
  inside the decode loop).

  The G = Hq / Hkv query heads of a key/value head are the rows of one [G * T, Dh] matrix (and
  for a shared part, the R rows that share it too: [R * G * T, Dh]), so each (entry, kv head) is
  one plain matmul against its keys, and a shared prompt's keys are read once for its R rows.
  Keeping G and T as separate dims of the dots took twice as long at decode (one step's
  attention over 384 slots, SmolLM2-135M, B = 16, 2-core CPU: 61 ms vs 31 ms for the 30 layers).
  """
  B, T, Hq, Dh = q.shape
  Hkv = k.shape[1]
  G = Hq // Hkv
  q = q.reshape(B, T, Hkv, G, Dh).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, Dh)
  parts = [(pk, pv, jnp.repeat(pm, B // pm.shape[0], axis=0)[:, None, None, None],
            B // pm.shape[0]) for pk, pv, pm in past]
  parts.append((k, v, mask[:, None, None], 1))  # (keys, values, visible [B, 1, 1, T, S'], rows)
  scores = [jnp.where(visible, _by_row(jnp.einsum("bkmd,bksd->bkms", _by_prompt(q, rows), keys),
                                       rows).astype(jnp.float32).reshape(B, Hkv, G, T, -1)
                      / math.sqrt(Dh), jnp.finfo(jnp.float32).min)
            for keys, _, visible, rows in parts]
  probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(v.dtype)
  probs = probs.reshape(B, Hkv, G * T, -1)
  out, start = 0.0, 0
  for _, values, _, rows in parts:
    span = values.shape[2]
    part = _by_prompt(probs[..., start:start + span], rows)
    out = out + _by_row(jnp.einsum("bkms,bksd->bkmd", part, values), rows)
    start += span
  return out.reshape(B, Hkv, G, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, Hq * Dh)


def _sdpa(q, k, v, mask, past=()):
  """`attention` through `jax.nn.dot_product_attention` (cuDNN flash attention on GPU in 16-bit
  compute, its XLA path elsewhere); every part of `past` must be per row (Bp = B: the learner's
  shared prompts gather their rows' keys/values, `hidden_states(prefix_rows=...)`).

  The parts and this call's keys are one key axis [S + T] under one mask, so the softmax is the
  same as `attention`'s. A query that sees no key (a left-padding position) is let see itself:
  a fully masked row has no defined softmax (flash kernels may return NaN for it), and a padding
  position's output is read by no real position."""
  B, T, Hq, Dh = q.shape
  # [B, S + T, Hkv, Dh]: every part's keys, then this call's
  keys = jnp.concatenate([pk for pk, _, _ in past] + [k], axis=2).swapaxes(1, 2)
  values = jnp.concatenate([pv for _, pv, _ in past] + [v], axis=2).swapaxes(1, 2)
  own = mask | jnp.eye(T, dtype=bool)[None]
  visible = jnp.concatenate([jnp.broadcast_to(pm[:, None, :], (B, T, pm.shape[1]))
                             for _, _, pm in past] + [own], axis=-1)  # [B, T, S + T]
  cudnn = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
  attend = lambda impl: jax.nn.dot_product_attention(q, keys, values, mask=visible[:, None],
                                                     implementation=impl)
  if cudnn:
    try:  # cuDNN refuses some shapes and versions at trace time; XLA's path takes any
      return attend("cudnn").reshape(B, T, Hq * Dh)
    except (ValueError, NotImplementedError, RuntimeError) as e:
      logging.warning("cuDNN attention unavailable (%s); using XLA's", str(e).splitlines()[0])
  return attend("xla").reshape(B, T, Hq * Dh)


def _layer(config: ModelConfig, x, p, lora, adapters, positions, inv_freq, attend):
  """One pre-norm decoder layer: x and what `attend(q, k, v) -> (attention output, extra)`
  returns beside the output (this call's (k, v) [B, Hkv, T, Dh], or a paged pool)."""
  c = config
  B, T, _ = x.shape
  sub = lambda group, name: None if lora is None else lora.get(group, {}).get(name)
  attn_p = p["self_attn"]
  h = rms_norm(x, p["input_layernorm"]["scale"], c.rms_norm_eps)
  q = _project(h, attn_p["q_proj"], sub("self_attn", "q_proj"), adapters)
  k = _project(h, attn_p["k_proj"], sub("self_attn", "k_proj"), adapters)
  v = _project(h, attn_p["v_proj"], sub("self_attn", "v_proj"), adapters)
  q = q.reshape(B, T, c.num_attention_heads, c.head_dim)
  k = k.reshape(B, T, c.num_key_value_heads, c.head_dim)
  v = v.reshape(B, T, c.num_key_value_heads, c.head_dim)
  if c.qk_norm:
    q = rms_norm(q, attn_p["q_norm"]["scale"], c.rms_norm_eps)
    k = rms_norm(k, attn_p["k_norm"]["scale"], c.rms_norm_eps)
  q = apply_rope(q, positions, inv_freq)
  k = apply_rope(k, positions, inv_freq).swapaxes(1, 2)  # [B, Hkv, T, Dh]
  attn, extra = attend(q, k, v.swapaxes(1, 2))
  x = x + _project(attn, attn_p["o_proj"], sub("self_attn", "o_proj"), adapters)
  mlp_p = p["mlp"]
  h = rms_norm(x, p["post_attention_layernorm"]["scale"], c.rms_norm_eps)
  gate = _project(h, mlp_p["gate_proj"], sub("mlp", "gate_proj"), adapters)
  up = _project(h, mlp_p["up_proj"], sub("mlp", "up_proj"), adapters)
  x = x + _project(jax.nn.silu(gate) * up, mlp_p["down_proj"], sub("mlp", "down_proj"), adapters)
  return x, extra


def _cached_attend(config: ModelConfig, past, mask, decoding):
  """`_layer`'s attention over cached parts and this call's keys/values (returned as extra).

  past: cached parts to attend to, as `attention` takes them. decoding: `past` ends with a
  per-row cache, which only the eager einsums read slot-block by slot-block (`sampling/decode`);
  else the config's attention implementation runs (`ModelConfig.uses_sdpa`)."""
  def attend(q, k, v):
    per_row = all(pk.shape[0] == q.shape[0] for pk, _, _ in past)
    sdpa = config.uses_sdpa and per_row and not decoding
    return (_sdpa if sdpa else attention)(q, k, v, mask, past), (k, v)
  return attend


def _paged_attend(paged: PagedKV, layer: jax.Array, pages: int, positions: jax.Array,
                  pool: tuple[jax.Array, jax.Array]):
  """`_layer`'s attention for a `PagedKV` forward: writes this call's keys/values into the
  layer's pages (in place inside the layer scan: the pool is its carry), then `paged.attend`
  reads them; returns the updated (k, v) pool as extra."""
  def attend(q, k, v):
    k_pool, v_pool = pool
    B, P = paged.block_tables.shape
    page_size = k_pool.shape[2]
    slot = jnp.minimum(positions // page_size, P - 1)  # [B, T]
    page = jnp.where(paged.valid, jnp.take_along_axis(paged.block_tables, slot, axis=1), 0)
    entry, offset = layer * pages + page, positions % page_size
    k_pool = k_pool.at[:, entry, offset].set(k.swapaxes(0, 1).astype(k_pool.dtype))
    v_pool = v_pool.at[:, entry, offset].set(v.swapaxes(0, 1).astype(v_pool.dtype))
    tables = layer * pages + paged.block_tables
    return paged.attend(q, k_pool, v_pool, tables, positions), (k_pool, v_pool)
  return attend


def hidden_states(
    params: Params,
    tokens: jax.Array,  # [B, T] int32
    positions: jax.Array,  # [B, T] int32
    config: ModelConfig,
    *,
    attn_mask: jax.Array | None = None,  # [B, T] bool; False = padding
    cache: KVCache | None = None,
    prefix: KVCache | None = None,
    prefix_rows: jax.Array | None = None,  # [B] int32: the prefix entry each row reads
    fill_cache: bool = False,
    adapters: LoraAdapters | None = None,
    layer_hook: LayerHook | None = None,
    remat: bool = False,
) -> tuple[jax.Array, KVCache | None]:
  """Final-norm hidden states [B, T, D], fp32 (and the extended cache when one is given).

  prefix: a filled cache of U prompts that the rows continue, read-only, row b reading prompt
  b // (B / U) (the G samples of a prompt in consecutive rows read its keys/values once; `cache`
  then holds only the rows' own slots).
  prefix_rows: with `prefix`, row b reads entry prefix_rows[b] instead (rows of a prompt that are
  not consecutive: the learner's batch). Each layer gathers its own [B, Hkv, Tp, Dh] keys/values
  inside the layer scan, so one layer's gather is live at a time and, under remat, the backward
  pass gathers again instead of keeping [L, B, ...] copies (gathering the whole [L, U, ...]
  prefix up front kept ~7 such copies in configs/learning_cpu.py's train step).
  fill_cache: return this call's keys/values as a new cache of exactly T filled slots (a prompt's
  prefill). Prefilling into an empty `init_cache` instead would also score every query against
  the T empty slots: twice the attention work, and inside jit the empty cache is a constant that
  XLA folds at compile time (`experiments.plan` of configs/learning_cpu.py: two folds of a
  [8, 3, 3, 512, 512] softmax max, 52 s each; 128 s in all vs 23 s with fill_cache)."""
  if fill_cache and cache is not None:
    raise ValueError("fill_cache=True builds a new cache; expected cache=None")
  if prefix_rows is not None and prefix is None:
    raise ValueError("prefix_rows picks entries of a prefix; expected prefix= too")
  c = config
  B, T = tokens.shape
  if attn_mask is None:
    attn_mask = jnp.ones((B, T), bool)
  x = jnp.take(params["embed_tokens"]["embedding"], tokens, axis=0).astype(c.compute_dtype)
  inv_freq = rope_inv_freq(c)
  mask = jnp.tril(jnp.ones((T, T), bool))[None] & attn_mask[:, None, :]  # [B, T, T]
  lora_layers = None if adapters is None else adapters.params
  prefix_mask = None if prefix is None else (
      prefix.mask if prefix_rows is None else prefix.mask[prefix_rows])  # [U or B, Tp]

  def body(x, xs):
    layer_p, layer_lora, kv_in, prefix_in = xs
    if layer_hook is not None:
      layer_p = layer_hook(layer_p)
    if prefix_in is not None and prefix_rows is not None:  # [U, ...] -> [B, ...], this layer's
      prefix_in = tuple(kv[prefix_rows] for kv in prefix_in)
    past = () if prefix_in is None else ((*prefix_in, prefix_mask),)
    if kv_in is not None:
      past += ((*kv_in, cache.mask),)  # slots >= index are all False
    x, kv_new = _layer(c, x, layer_p, layer_lora, adapters, positions, inv_freq,
                       _cached_attend(c, past, mask, kv_in is not None))
    return x, (kv_new if kv_in is not None or fill_cache else None)  # training keeps no k/v

  if remat:
    body = jax.checkpoint(body)
  kv_in = None if cache is None else (cache.k, cache.v)
  prefix_in = None if prefix is None else (prefix.k, prefix.v)
  x, kv_out = jax.lax.scan(body, x, (params["layers"], lora_layers, kv_in, prefix_in))
  x = rms_norm(x.astype(jnp.float32), params["norm"]["scale"], c.rms_norm_eps)  # fp32 out
  if fill_cache:  # [L, B, Hkv, T, Dh]
    return x, KVCache(k=kv_out[0], v=kv_out[1], mask=attn_mask, index=jnp.asarray(T, jnp.int32))
  if cache is not None:  # this call's [L, B, Hkv, T, Dh] into slots index .. index + T - 1
    write = lambda old, new, axis: jax.lax.dynamic_update_slice_in_dim(
        old, new.astype(old.dtype), cache.index, axis=axis)
    cache = KVCache(k=write(cache.k, kv_out[0], 3), v=write(cache.v, kv_out[1], 3),
                    mask=write(cache.mask, attn_mask, 1), index=cache.index + T)
  return x, cache


def paged_hidden_states(
    params: Params,
    tokens: jax.Array,  # [B, T] int32
    positions: jax.Array,  # [B, T] int32: paged.lengths[:, None] + arange(T)
    config: ModelConfig,
    paged: PagedKV,
    *,
    adapters: LoraAdapters | None = None,
) -> tuple[jax.Array, PagedKV]:
  """Final-norm hidden states [B, T, D] (fp32) of a forward whose keys/values live in a paged
  pool, and the pool with this call's tokens written.

  Each layer writes its T new keys/values per row into the row's pages, then attends over the
  row's positions up to each query's own (`paged.attend`). The pool is the layer scan's carry,
  updated in place, so a call moves only the pages it reads, never a copy of the pool (the
  caller donates it to the jitted call)."""
  c = config
  pages = paged.k.shape[1] // c.num_hidden_layers
  x = jnp.take(params["embed_tokens"]["embedding"], tokens, axis=0).astype(c.compute_dtype)
  inv_freq = rope_inv_freq(c)
  lora_layers = None if adapters is None else adapters.params

  def body(carry, xs):
    x, pool = carry
    layer_p, layer_lora, layer = xs
    x, pool = _layer(c, x, layer_p, layer_lora, adapters, positions, inv_freq,
                     _paged_attend(paged, layer, pages, positions, pool))
    return (x, pool), None

  layers = jnp.arange(c.num_hidden_layers, dtype=jnp.int32)
  (x, (k, v)), _ = jax.lax.scan(body, (x, (paged.k, paged.v)),
                                (params["layers"], lora_layers, layers))
  x = rms_norm(x.astype(jnp.float32), params["norm"]["scale"], c.rms_norm_eps)  # fp32 out
  return x, paged.replace(k=k, v=v)


def lm_logits(params: Params, hidden: jax.Array, config: ModelConfig) -> jax.Array:
  """Vocabulary logits in fp32: hidden [..., D] -> [..., V].

  The product runs in the precision the head's weights are stored in, accumulating in fp32:
  fp32 for the learner's master weights (its log-probs and losses), bf16 for the sampler's
  compute copy (`models/precision.py`), where a per-step fp32 cast of the [D, V] head would cost
  more than the decode step it serves."""
  if config.tie_word_embeddings:
    kernel = params["embed_tokens"]["embedding"].T
  else:
    kernel = params["lm_head"]["kernel"]
  return jnp.dot(hidden.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)


def forward(params: Params, tokens: jax.Array, positions: jax.Array, config: ModelConfig,
            **kwargs) -> tuple[jax.Array, KVCache | None]:
  """Logits [B, T, V] (fp32) and the extended cache; kwargs as for `hidden_states`."""
  hidden, cache = hidden_states(params, tokens, positions, config, **kwargs)
  return lm_logits(params, hidden, config), cache


def positions_from_mask(attn_mask: jax.Array) -> jax.Array:
  """Positions [B, T] that count only real tokens (left padding gets position 0)."""
  return jnp.maximum(jnp.cumsum(attn_mask.astype(jnp.int32), axis=-1) - 1, 0)
