"""A team's policies: params, optimizers, partition specs and learner log-probs.

`PolicyConfig.kind` (`parallel/policy_config.py`) names a policy layout (`parallel/layouts.py`:
"shared", "lora", "stacked", "mapped"); every function here does the kind-independent work and
asks the layout object (`layouts.of(cfg)`) for the rest. Every sample's `policy_id` names its
policy (for "mapped", the index into `names`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from marl_jax.algos import critic as critic_lib
from marl_jax.algos import logprobs
from marl_jax.algos import optim as optim_lib
from marl_jax.models import decoder
from marl_jax.models import precision
from marl_jax.parallel import sharding
from marl_jax.parallel.layouts import of
from marl_jax.parallel.policy_config import PolicyConfig

Params = dict[str, Any]


def init_params(cfg: PolicyConfig, key: jax.Array, base: Params | dict[str, Params] | None = None
                ) -> tuple[Params, Params]:
  """(trainable, frozen) params. `base`: pretrained weights (a dict name -> params for "mapped");
  None draws random ones. Stacked and mapped policies all start from `base`."""
  layout = of(cfg)
  k_model, k_lora, k_critic = jax.random.split(key, 3)
  if base is None:
    inits = [decoder.init_params(m, k) for m, k in
             zip(cfg.models, jax.random.split(k_model, len(cfg.models)))]
    base = dict(zip(cfg.names, inits)) if layout.per_policy_models else inits[0]
  elif layout.per_policy_models and sorted(base) != sorted(cfg.names):
    raise ValueError(f"{cfg.kind} base params have keys {sorted(base)}; expected "
                     f"{sorted(cfg.names)}")
  policy, frozen = layout.init_policy(cfg, k_lora, base)
  # Frozen weights are only ever read in compute precision: store them so (a LoRA base in bf16).
  frozen = precision.compute_copy(frozen, cfg.compute_dtype, head=False)
  trainable = {"policy": policy}
  if cfg.critic is not None:
    trainable["critic"] = critic_lib.init_value_head(k_critic, cfg.models[0].hidden_size,
                                                     cfg.critic)
  return trainable, frozen


def sampler_copy(cfg: PolicyConfig, params: Params) -> Params:
  """The weights the sampler reads, made once per rollout: every kernel, the embedding and the
  LM head in the team's compute dtype (`models/precision.py`); the params themselves when that
  is their storage dtype (fp32 on CPU)."""
  return precision.compute_copy(params, cfg.compute_dtype, head=True)


def make_optimizers(cfg: PolicyConfig) -> dict[str, optax.GradientTransformation]:
  """Optimizers of trainable['policy'] (one per policy: per-agent settings, or P models) and
  trainable['critic']."""
  txs = [optim_lib.make_optimizer(cfg.optim_of(p)) for p in range(cfg.num_policies)]
  parts = {"policy": of(cfg).policy_optimizer(cfg, txs)}
  if cfg.critic is not None:
    parts["critic"] = optim_lib.make_optimizer(cfg.critic_optim)
  return parts


def make_optimizer(cfg: PolicyConfig) -> optax.GradientTransformation:
  """The optimizer of all trainable params, state keyed like them ({'policy', 'critic'})."""
  return optim_lib.by_key(make_optimizers(cfg))


def trainable_specs(cfg: PolicyConfig, trainable: Params, fsdp_size: int) -> Any:
  """FSDP PartitionSpecs of the trainable params; adapters and the value head stay replicated."""
  specs = {"policy": of(cfg).policy_specs(cfg, trainable["policy"], fsdp_size)}
  if "critic" in trainable:
    specs["critic"] = sharding.replicated(trainable["critic"])
  return specs


def param_specs(cfg: PolicyConfig, trainable: Params, frozen: Params,
                fsdp_size: int) -> tuple[Any, Any]:
  """FSDP PartitionSpecs of (trainable, frozen) params."""
  return trainable_specs(cfg, trainable, fsdp_size), frozen_specs(frozen, fsdp_size)


def frozen_specs(frozen: Params, fsdp_size: int) -> Any:
  """FSDP PartitionSpecs of the frozen params (a LoRA team's base model; {} for none)."""
  return {"base": sharding.model_specs(frozen["base"], fsdp_size)} if frozen else {}


def _one_model(params, model_specs, config, batch, adapters, remat: bool):
  """Gathered non-layer params and response hidden states of one model (inside shard_map)."""
  params = sharding.gather_outside_layers(params, model_specs)
  hidden = logprobs.response_hidden(params, config, batch.prompt, batch.prompt_mask,
                                    batch.response, adapters=adapters,
                                    layer_hook=sharding.layer_hook(model_specs), remat=remat,
                                    num_prompts=batch.num_prompts)
  return params, hidden


def row_temperature(temperature: float | tuple[float, ...], agent_id: jax.Array
                    ) -> float | jax.Array:
  """The learner temperature of each row: `temperature` itself when one number (or every agent's
  is the same: no gather, the program of a single temperature), else agent `agent_id`'s [n]."""
  if not isinstance(temperature, tuple):
    return temperature
  if len(set(temperature)) == 1:
    return temperature[0]
  return jnp.asarray(temperature, jnp.float32)[agent_id]


def token_logprobs(cfg: PolicyConfig, trainable: Params, frozen: Params, specs: tuple[Any, Any],
                   batch: Any, *, temperature: float | tuple[float, ...],
                   with_entropy: bool = False,
                   remat: bool = False, logits_chunk: int | None = None) -> tuple[Any, Any]:
  """Log-probs (and entropies) of every policy's response tokens, in the batch's own layout.

  Runs inside shard_map on local shards (or outside it with unsharded specs): leaves outside the
  layer stack are all-gathered here and each layer inside the scan. `batch` has `prompt`,
  `prompt_mask`, `response` and `samples.policy_id` (a dict of such for "mapped").
  `logits_chunk`: response positions per LM-head slice (`logprobs.token_logprobs_from_hidden`).
  `temperature`: one, or one per agent (each row at its `samples.agent_id`'s, `row_temperature`).
  """

  def run(params, model_specs, config, b, adapters):
    params, hidden = _one_model(params, model_specs, config, b, adapters, remat)
    return logprobs.token_logprobs_from_hidden(
        params, config, hidden, b.response, row_temperature(temperature, b.samples.agent_id),
        with_entropy, logits_chunk)

  return of(cfg).token_logprobs(cfg, run, trainable["policy"], frozen,
                                (specs[0]["policy"], specs[1]), batch)


def reference_logprobs(cfg: PolicyConfig, reference: Any, frozen: Params, specs: tuple[Any, Any],
                       batch: Any, *, temperature: float | tuple[float, ...],
                       logits_chunk: int | None = None) -> Any:
  """Log-probs of the response tokens under the frozen KL reference, in the batch's layout.

  LoRA: the base without adapters (no extra params). Full models: `reference['policy']`, a frozen
  copy of the initial trainable['policy'] (sharded like it, specs[0]['policy']). Inside
  shard_map."""
  if of(cfg).adapters:
    base, hidden = _one_model(frozen["base"], specs[1]["base"], cfg.models[0], batch, None, False)
    logp, _ = logprobs.token_logprobs_from_hidden(
        base, cfg.models[0], hidden, batch.response,
        row_temperature(temperature, batch.samples.agent_id), False, logits_chunk)
    return logp
  logp, _ = token_logprobs(cfg, reference, frozen, specs, batch, temperature=temperature,
                           logits_chunk=logits_chunk)
  return logp


def critic_values(cfg: PolicyConfig, trainable: Params, frozen: Params, specs: tuple[Any, Any],
                  batch: Any, *, remat: bool = False) -> jax.Array:
  """MARFT critic values [n, R]: value of the state before each response token, from the frozen
  base (no adapters). Column 0 is the value of the prompt, i.e. of the agent's action."""
  _, hidden = _one_model(frozen["base"], specs[1]["base"], cfg.models[0], batch, None, remat)
  return critic_lib.value_head(trainable["critic"], hidden)


