"""Host-side sampler: tokenise, group identical prompts, bucket, run the jitted core, stop strings.

    sampler = Sampler(config, tokenizer)
    completions = sampler.generate(params, prompts, SamplingParams(...), key, adapters=None)

Params are an argument of every call (they change every training step) and never baked into the
compiled program.

Keys. `key` is one typed key, row b then drawing with `fold_in(key, b)` (b its index in
`prompts`), or one key per row ([len(prompts)]: the rollout engine's per-request keys,
`sampling/engine.py`); a row's tokens depend only on its prompt, key and settings.

Shared prompts. RL asks for G samples of a prompt (tree branches, independent trajectories at
their first turn), and the rollout passes them as G equal entries of `prompts`. `generate` finds
the distinct (prompt, LoRA policy) pairs on the host and lays the rows out as U prompt entries x
R rows (`prompt_layout`); the core prefills each entry once and its R rows read its keys/values
as one shared prefix at every decode step (`decode.py`). Outputs are the same as prefilling every
row.

Shapes and compiles. Prompt entries U round up to a power of two below `Buckets.row_multiple` and to
a multiple of it above (`round_bucket`: a lone prompt is not prefilled 8 times), rows per entry R to
a power of two, the prompt width to a multiple of `Buckets.prompt_block` (not a power of two: a
270-token prompt pads to 320, not 512), new-token slots to a multiple of
`Buckets.new_token_multiple`, stop ids to a power of two. The sampler compiles at most one program
per distinct (U bucket, R, width bucket, new-slot bucket, stop bucket, variant), the variant being
greedy / sampling / truncated sampling (`SamplingParams.mode`). With at most n row buckets (n =
log2(row_multiple) + ceil(rows / row_multiple)) and R <= the largest group, a run with prompts of at
most P tokens and one `max_new_tokens` compiles at most n * (log2(largest group) + 1) * ceil(P /
prompt_block) * 3 programs, times the stop-bucket count (one in practice); knobs and params never
recompile.

What a `Completion` holds:
  * `tokens` / `logprobs`: the generated tokens and, for each, log_softmax(logits / T) at the token,
    over the FULL vocabulary before top-k/top-p truncation, with T the sampling temperature (1 for
    greedy). A teacher-forced forward over prompt + tokens, divided by T, gives the same values;
    that is what PPO ratios need.
  * A row ended by a stop token keeps that token (and its log-prob): the policy must learn to emit
    it. Its `text` excludes it.
  * Stop strings are searched on the host in the decoded text after generation (the device loop
    only knows token ids). At the first occurrence, `text` is cut just before the stop string and
    `tokens`/`logprobs` are cut after the token that completes it (that token may carry a few
    characters beyond the stop string; they appear in the tokens, not in `text`). Rows keep
    generating on device until a stop token or the length limit, so a stop string does not save
    compute.
  * `finish_reason` is "stop_string", "stop_token" or "length" (the budget ran out).

Truncated sampling (top-k / top-p) searches the `top_candidates` most likely tokens instead of
sorting the vocabulary; `logits.truncated_candidates` says when that is exact.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models import decoder
from marl_jax.models.config import ModelConfig
from marl_jax.sampling import stops
from marl_jax.sampling.decode import generate_tokens
from marl_jax.sampling.engine import Completion, Tokenizer
from marl_jax.sampling.logits import knobs_of
from marl_jax.sampling.params import SamplingParams
from marl_jax.shapes import bucket, round_bucket, round_up


def prompt_layout(counts: Sequence[int], multiple: int) -> tuple[int, int]:
  """(U, R): decode rows as U prompt entries x R rows each, for distinct prompts with `counts`
  rows. A prompt with c rows takes ceil(c / R) entries (prefilled once each); U rounds with
  `round_bucket`. R is the power of two (up to the largest count) giving the fewest decode rows
  U * R, the largest on ties (fewer prefills): 2 prompts x 8 samples -> (2, 8); 8 distinct
  prompts -> (8, 1); one prompt of 8 rows beside 7 single ones -> (16, 1), not (8, 8)."""
  if not counts or min(counts) < 1:
    raise ValueError(f"row counts {list(counts)}; expected at least one prompt, each with a row")
  best = None
  for r in (1 << i for i in range(bucket(max(counts), 1).bit_length())):
    u = round_bucket(sum(-(-c // r) for c in counts), multiple)
    if best is None or u * r <= best[0] * best[1]:
      best = (u, r)
  return best


@dataclasses.dataclass(frozen=True)
class Buckets:
  """Padded sizes: each axis rounds up to a multiple (stop ids: a power of two)."""

  row_multiple: int = 8  # rows B and distinct prompts U (powers of two below it)
  prompt_block: int = 64  # prompt width
  new_token_multiple: int = 16  # new-token slots
  min_stop_ids: int = 4

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"Buckets.{field.name}={value!r}; expected an integer >= 1")


class Sampler:
  """Batched generation for one model architecture (any params with that config).

  Args:
    buckets: padded shapes (see the module docstring).
    decode_block: decode steps per attention-span block (`decode.generate_tokens`); 0 = every
      step attends over the whole prompt + new-token cache.
    top_candidates: tokens searched by top-k / top-p (`logits.truncated_candidates`); sampling
      with top_k above it is refused.
    share_prompts: prefill each distinct prompt once (False prefills every row; same outputs).
  """

  def __init__(self, config: ModelConfig, tokenizer: Tokenizer | None = None,
               buckets: Buckets = Buckets(), *, decode_block: int = 64,
               top_candidates: int = 256, share_prompts: bool = True):
    if not isinstance(decode_block, int) or decode_block < 0:
      raise ValueError(f"decode_block={decode_block!r}; expected an integer >= 0 (0 = off)")
    if not isinstance(top_candidates, int) or top_candidates < 1:
      raise ValueError(f"top_candidates={top_candidates!r}; expected an integer >= 1")
    self.config = config
    self.tokenizer = tokenizer
    self.buckets = buckets
    self.decode_block = decode_block
    self.top_candidates = top_candidates
    self.share_prompts = share_prompts
    self.last_call: dict[str, int] = {}  # the last `generate` call's work (`StaticEngine.stats`)
    self.pad_id = 0 if tokenizer is None else int(tokenizer.pad_id)
    self._generate = jax.jit(
        functools.partial(_generate_tokens, config=config, pad_id=self.pad_id,
                          block=decode_block, candidates=top_candidates),
        static_argnames=("new_slots", "modes"))

  def encode(self, prompts: Sequence[Sequence[int] | str]) -> list[list[int]]:
    """Token ids of each prompt; strings need a tokenizer (no chat template is applied here)."""
    out = []
    for i, prompt in enumerate(prompts):
      if isinstance(prompt, str):
        if self.tokenizer is None:
          raise ValueError(f"prompt {i} is a string but the Sampler has no tokenizer; "
                           "pass token ids or construct Sampler(config, tokenizer)")
        prompt = self.tokenizer.encode(prompt)
      ids = [int(t) for t in prompt]
      if not ids:
        raise ValueError(f"prompt {i} is empty; expected at least one token")
      bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
      if bad:
        raise ValueError(f"prompt {i} has token ids {bad[:5]} outside [0, "
                         f"{self.config.vocab_size})")
      out.append(ids)
    return out

  def generate(self, params: decoder.Params, prompts: Sequence[Sequence[int] | str],
               sampling: SamplingParams, key: jax.Array,
               adapters: decoder.LoraAdapters | None = None) -> list[Completion]:
    """Continues every prompt; `adapters.policy_ids` ([len(prompts)]) picks each row's LoRA;
    `key`: one typed key, or one per prompt (see the module docstring)."""
    if not prompts:
      raise ValueError("prompts is empty; expected at least one prompt")
    ids = self.encode(prompts)
    keys = row_keys(key, len(ids))
    if sampling.top_k >= self.config.vocab_size:  # keeps every token: no truncation
      sampling = sampling.replace(top_k=0)
    self._check(ids, sampling)
    n_rows = len(ids)
    policy_ids = None
    if adapters is not None:
      policy_ids = np.asarray(adapters.policy_ids, np.int32)
      if policy_ids.shape != (n_rows,):
        raise ValueError(f"adapters.policy_ids has shape {policy_ids.shape}; expected "
                         f"({n_rows},), one policy per prompt")
    tokens, mask, rows, prompt_policy = self._pack(ids, policy_ids)
    if adapters is not None:
      adapters = adapters.replace(policy_ids=prompt_policy)
    b = self.buckets
    stop = self._stop_token_ids(sampling)
    stop_ids = np.full((bucket(len(stop), b.min_stop_ids),), -1, np.int32)
    stop_ids[:len(stop)] = stop
    # Keys and knobs padded to the layout's U * R rows, so their shapes are bucketed too.
    keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (rows.size - n_rows,))])
    out = self._generate(params, tokens, mask, rows, keys, knobs_of([sampling] * rows.size),
                         stop_ids, jnp.int32(sampling.max_new_tokens), adapters,
                         new_slots=round_up(sampling.max_new_tokens, b.new_token_multiple),
                         modes=frozenset({sampling.mode}))
    out = jax.device_get(out)
    U, width = tokens.shape
    new_slots = round_up(sampling.max_new_tokens, b.new_token_multiple)
    # What the call computed and held: the rows' decode row-steps (every row rides along until
    # the longest ends), the distinct prompts prefilled, and the dense cache's token slots.
    self.last_call = {"row_steps": rows.size * int(out.lengths.max()),
                      "prefilled_tokens": int(mask.sum()),
                      "cache_tokens": U * width + rows.size * new_slots}
    at = np.zeros((n_rows,), np.int64)  # row i's place in the [U * R] output
    flat = rows.reshape(-1)
    at[flat[flat >= 0]] = np.nonzero(flat >= 0)[0]
    return [stops.completion(self.tokenizer, out.tokens[j, :out.lengths[j]],
                             out.logprobs[j, :out.lengths[j]], bool(out.stopped[j]), len(ids[i]),
                             sampling.stop_strings)
            for i, j in enumerate(at)]

  def _check(self, ids: list[list[int]], sampling: SamplingParams) -> None:
    context = self.config.max_position_embeddings
    for i, row in enumerate(ids):
      if len(row) + sampling.max_new_tokens > context:
        raise ValueError(
            f"prompt {i} has {len(row)} tokens; with max_new_tokens={sampling.max_new_tokens} "
            f"it needs {len(row) + sampling.max_new_tokens} positions but the model's context "
            f"is {context}")
    if sampling.truncates and sampling.top_k > self.top_candidates:
      raise ValueError(f"top_k={sampling.top_k} exceeds the Sampler's top_candidates="
                       f"{self.top_candidates}; expected top_k <= top_candidates (or raise it)")

  def _pack(self, ids: list[list[int]], policy_ids: np.ndarray | None):
    """Distinct prompts, left-padded: tokens / mask [U, Tp], the caller's row index of each of
    their R rows [U, R] (-1 = padding; `prompt_layout`), and each prompt's policy id [U] (None
    without adapters)."""
    index: dict[tuple, int] = {}  # (prompt, policy) -> distinct prompt
    members: list[list[int]] = []  # each distinct prompt's rows
    for i, row in enumerate(ids):
      policy = None if policy_ids is None else int(policy_ids[i])
      identity = (tuple(row), policy) if self.share_prompts else (i,)
      u = index.setdefault(identity, len(members))
      if u == len(members):
        members.append([])
      members[u].append(i)
    b = self.buckets
    n_prompts, per_prompt = prompt_layout([len(m) for m in members], b.row_multiple)
    entries = [m[j:j + per_prompt] for m in members for j in range(0, len(m), per_prompt)]
    width = round_up(max(len(row) for row in ids), b.prompt_block)
    tokens = np.full((n_prompts, width), self.pad_id, np.int32)
    mask = np.zeros((n_prompts, width), bool)
    rows = np.full((n_prompts, per_prompt), -1, np.int32)
    for u, entry in enumerate(entries):
      first = ids[entry[0]]
      tokens[u, width - len(first):] = first
      mask[u, width - len(first):] = True
      rows[u, :len(entry)] = entry
    prompt_policy = None
    if policy_ids is not None:
      prompt_policy = np.zeros((n_prompts,), np.int32)
      prompt_policy[:len(entries)] = policy_ids[[entry[0] for entry in entries]]
    return tokens, mask, rows, prompt_policy

  def _stop_token_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
    if sampling.stop_token_ids is not None:
      return sampling.stop_token_ids
    return () if self.tokenizer is None else tuple(self.tokenizer.stop_token_ids)


def row_keys(key: jax.Array, n: int) -> jax.Array:
  """[n] typed keys: `key` itself when it already holds n keys, else fold_in(key, b) for row b."""
  if key.shape == (n,):
    return key
  if key.shape != ():
    raise ValueError(f"key has shape {key.shape}; expected one key () or one per prompt ({n},)")
  return jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(n))


def _generate_tokens(*args, **kwargs):
  """`decode.generate_tokens`, looked up at trace time (a test counts the programs it traces)."""
  return generate_tokens(*args, **kwargs)
