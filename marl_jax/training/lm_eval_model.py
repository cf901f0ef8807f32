"""A marl_jax model for EleutherAI's lm-evaluation-harness (`lm_eval --model marl_jax`).

    python -m experiments.harness run --model marl_jax \
        --model_args checkpoint=RUN_DIR[,step=N][,policy=solver] --tasks gsm8k
    python -m experiments.harness run --model marl_jax --model_args model=DIR_OR_NAME ...

`checkpoint=` is a run's workdir: its policy `policy` (a name `experiments.export` would give,
e.g. `solver` or `tool+reasoner`; needed when the team has several) at checkpoint `step` (default
the latest), LoRA merged into its base (`training/export.py`). `model=` is anything
`load_model` reads: the embedded model's name, a GGUF file or an HF directory (e.g. an export).
Other arguments: `max_length` (context, default the model's), `seed` (sampling); lm-eval's
`--batch_size N` sets the rows per forward / sampler call ('auto' is refused), and its `--device`
is not used (JAX places the model on its default backend: set JAX_PLATFORMS).

lm-eval's three requests run on the project's own code: `loglikelihood` and
`loglikelihood_rolling` on a teacher-forced forward (`algos/logprobs.response_hidden`, the
learner's), scored in LM-head slices so no [rows, T, vocab] logits are held whole;
`generate_until` on the sampler (`sampling/sampler.py`, stop strings included). Tokenisation of
(context, continuation) pairs and the rolling windows are lm-eval's own (`TemplateLM`,
`get_rolling_token_windows`), so scores are comparable with its `hf` model's.

lm-eval is an optional dependency (requirements-eval.txt); this module imports it and registers the
model on import, which `experiments/harness.py` does before handing over to lm-eval's CLI. A bad
model argument (or a request that cannot fit them) raises UserInputError: one line from the
harness.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from marl_jax.algos import logprobs
from marl_jax.errors import UserInputError
from marl_jax.models import decoder
from marl_jax.models.config import ModelConfig
from marl_jax.models.loading import load_model
from marl_jax.models.tokenizer import Tokenizer
from marl_jax.sampling.params import SamplingParams
from marl_jax.sampling.sampler import Sampler
from marl_jax.training import export

_SLICE = 64  # response positions per LM-head slice
_GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("config",))
def _continuation_scores(params: Any, config: ModelConfig, prompt: jax.Array,
                         prompt_mask: jax.Array, response: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
  """log p(response token) [n, R] and whether each is the argmax [n, R], teacher-forced after
  the left-padded prompt [n, Tp] (fp32 logits, one [n, _SLICE, V] slice at a time)."""
  hidden = logprobs.response_hidden(params, config, prompt, prompt_mask, response)
  n, R, D = hidden.shape
  h = hidden.reshape(n, R // _SLICE, _SLICE, D).swapaxes(0, 1)
  tok = response.reshape(n, R // _SLICE, _SLICE).swapaxes(0, 1)

  def one(xs):
    h_c, tok_c = xs
    logits = decoder.lm_logits(params, h_c, config)  # [n, slice, V]
    target = jnp.take_along_axis(logits, tok_c[..., None], axis=-1)[..., 0]
    return target - jax.nn.logsumexp(logits, axis=-1), target >= jnp.max(logits, axis=-1)

  logp, greedy = jax.lax.map(one, (h, tok))
  return logp.swapaxes(0, 1).reshape(n, R), greedy.swapaxes(0, 1).reshape(n, R)


def _int(name: str, value: Any, low: int) -> int:
  try:
    number = int(value)
  except (TypeError, ValueError):
    number = None
  if number is None or number < low or str(value).strip() != str(number):
    raise UserInputError(f"marl_jax model argument {name}={value!r}; expected an integer >= {low}")
  return number


@register_model("marl_jax")
class MarlJaxLM(TemplateLM):
  """lm-eval's LM over a marl_jax model (module doc)."""

  def __init__(self, checkpoint: str | None = None, model: str | None = None,
               step: int | str | None = None, policy: str | None = None,
               batch_size: int | str = 8, max_length: int | str | None = None,
               seed: int | str = 0, device: str | None = None,
               max_batch_size: int | None = None):
    super().__init__()
    if (checkpoint is None) == (model is None):
      raise UserInputError("marl_jax model arguments: give exactly one of checkpoint=RUN_DIR (a "
                           "trained run) and model=NAME_OR_DIR (a model load_model reads)")
    del device  # lm-eval's CLI always passes one ('cuda:0' by default); JAX places arrays on
    # its default backend (JAX_PLATFORMS chooses), so there is nothing to pick here
    if max_batch_size is not None:
      raise UserInputError(f"marl_jax model: max_batch_size={max_batch_size!r}; expected none "
                           "(batch sizes are fixed: --batch_size N, not 'auto')")
    if model is not None and (step is not None or policy is not None):
      raise UserInputError("marl_jax model arguments step= and policy= pick a checkpoint's policy; "
                           "they need checkpoint=, not model=")
    self.batch_size = _int("batch_size", batch_size, 1)
    self.seed = _int("seed", seed, 0)
    if checkpoint is not None:
      self.config, self.params, self.tokenizer, self.name = _checkpoint_policy(
          checkpoint, None if step is None else _int("step", step, 0), policy)
    else:
      loaded = load_model(model)
      self.config, self.params, self.tokenizer, self.name = (
          loaded.config, loaded.params, loaded.tokenizer, model)
    context = self.config.max_position_embeddings
    self.max_length = context if max_length is None else _int("max_length", max_length, 2)
    if self.max_length > context:
      raise UserInputError(f"marl_jax model argument max_length={self.max_length}; expected at "
                           f"most the model's context, {context}")
    self.sampler = Sampler(self.config, self.tokenizer)
    self._key = jax.random.key(self.seed)

  # ------------------------------------------------------------------ tokenizer
  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.end_of_reply_id

  @property
  def prefix_token_id(self) -> int:
    """What an empty context is conditioned on: BOS when the tokenizer has one (as lm-eval's
    `hf` model), else the end-of-text token."""
    bos = self.tokenizer.hf.bos_token_id
    return self.eot_token_id if bos is None else bos

  @property
  def tokenizer_name(self) -> str:
    return self.name

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    del kwargs
    return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    return self.tokenizer.hf.chat_template if chat_template else None

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt)

  # ------------------------------------------------------------------ scoring
  def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                            disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    """(sum of log p(continuation tokens), all of them greedy) per (context, continuation)
    token pair; the context is cut from the left to fit `max_length` (as lm-eval's `hf`). A bar
    counts the pairs scored unless lm-eval passes `disable_tqdm`."""
    del kwargs
    pairs = []
    for _, context, continuation in requests:
      if not continuation:
        raise UserInputError("lm-eval sent an empty continuation; expected at least one token")
      if len(continuation) > self.max_length:
        raise UserInputError(f"a continuation of {len(continuation)} tokens does not fit "
                             f"max_length={self.max_length}")
      whole = (list(context) + list(continuation))[-(self.max_length + 1):]
      pairs.append((whole[:-len(continuation)], list(continuation)))
    out: list[tuple[float, bool] | None] = [None] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    with tqdm(total=len(pairs), desc="loglikelihood", disable=disable_tqdm) as bar:
      for start in range(0, len(order), self.batch_size):
        rows = order[start:start + self.batch_size]
        for i, scored in zip(rows, self._score([pairs[i] for i in rows])):
          out[i] = scored
        bar.update(len(rows))
    return out

  def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """One batch, padded to bucketed shapes (rows to `batch_size`, prompts to 32, responses to
    the LM-head slice) so the forward compiles for few shapes."""
    Tp = _round_up(max(len(p) for p, _ in pairs), 32)
    R = _round_up(max(len(r) for _, r in pairs), _SLICE)
    n = self.batch_size
    prompt = np.full((n, Tp), self.tokenizer.pad_id, np.int32)
    mask = np.zeros((n, Tp), bool)
    response = np.zeros((n, R), np.int32)
    for i, (p, r) in enumerate(pairs + [pairs[0]] * (n - len(pairs))):
      prompt[i, Tp - len(p):], mask[i, Tp - len(p):], response[i, :len(r)] = p, True, r
    logp, greedy = jax.device_get(_continuation_scores(
        self.params, self.config, jnp.asarray(prompt), jnp.asarray(mask), jnp.asarray(response)))
    return [(float(np.sum(logp[i, :len(r)], dtype=np.float64)), bool(np.all(greedy[i, :len(r)])))
            for i, (_, r) in enumerate(pairs)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each string's total log-likelihood over lm-eval's disjoint rolling windows of
    `max_length` tokens, the first conditioned on the end-of-text token; a bar counts the
    strings."""
    out = []
    for request in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
      windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
          token_list=self.tok_encode(request.args[0]), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)]
      scored = self._loglikelihood_tokens([(("", ""), c, r) for c, r in windows], True)
      out.append(sum(lp for lp, _ in scored))
    return out

  # ------------------------------------------------------------------ generation
  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Continuations from the sampler, cut at the request's `until` strings; `do_sample=False`
    (lm-eval's default) or temperature 0 decodes greedily; a bar counts the requests answered."""
    out: list[str | None] = [None] * len(requests)
    groups: dict[SamplingParams, list[int]] = {}
    for i, request in enumerate(requests):
      groups.setdefault(self._sampling(request.args[1]), []).append(i)
    with tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm) as bar:
      for sampling, members in groups.items():
        limit = self.max_length - sampling.max_new_tokens
        if limit < 1:
          raise UserInputError(f"max_gen_toks={sampling.max_new_tokens} leaves no room for a "
                               f"prompt in max_length={self.max_length}")
        for start in range(0, len(members), self.batch_size):
          rows = members[start:start + self.batch_size]
          prompts = [self.tok_encode(requests[i].args[0])[-limit:] or [self.prefix_token_id]
                     for i in rows]
          self._key, key = jax.random.split(self._key)
          for i, completion in zip(rows, self.sampler.generate(self.params, prompts, sampling,
                                                               key)):
            out[i] = completion.text
          bar.update(len(rows))
    return out

  def _sampling(self, gen_kwargs: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(gen_kwargs) - set(_GEN_KWARGS))
    if unknown:
      raise UserInputError(f"marl_jax model: generation options {unknown} are not supported; "
                           f"expected a subset of {list(_GEN_KWARGS)}")
    until = gen_kwargs.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    greedy = not gen_kwargs.get("do_sample", False) or not gen_kwargs.get("temperature", 1.0)
    return SamplingParams(
        max_new_tokens=_int("max_gen_toks", gen_kwargs.get("max_gen_toks", 256), 1),
        temperature=0.0 if greedy else float(gen_kwargs.get("temperature", 1.0)),
        top_p=float(gen_kwargs.get("top_p", 1.0)), top_k=int(gen_kwargs.get("top_k", 0)),
        stop_strings=until)


def _checkpoint_policy(workdir: str, step: int | None, policy: str | None
                       ) -> tuple[ModelConfig, Any, Tokenizer, str]:
  """(config, params, tokenizer, name) of one policy of a run's checkpoint."""
  team = export.restore_team(workdir, step)
  if policy is None and len(team.names) > 1:
    raise UserInputError(f"checkpoint={workdir!r} holds {len(team.names)} policies; add "
                         f"policy=NAME, one of {list(team.names)}")
  name = team.names[0] if policy is None else policy
  if name not in team.names:
    raise UserInputError(f"marl_jax model argument policy={policy!r}; expected one of "
                         f"{list(team.names)}")
  config, params, tokenizer = export.policy_model(team, team.names.index(name))
  return config, params, tokenizer, f"{workdir}:{team.step}:{name}"
