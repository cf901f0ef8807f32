"""End to end: every registered estimator makes a tiny model learn a synthetic two-agent task.

Task: the prompt names the agent (and a problem); agent a earns reward 1 when its one-token
response is its target token. Responses are sampled with `jax.random.categorical` from the
model's logits, exactly the behaviour policy the learner's log-probs describe. Each estimator gets
the ids it needs (problem groups; MAGRPO joint-action nodes with a joint reward; MARFT
trajectories and critic values, with per-agent LoRA over a frozen base and a value head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.algos.advantage_config import ESTIMATORS, AdvantageConfig
from marl_jax.algos.batch import GroupSpace, TrainBatch, make_batch
from marl_jax.algos.losses import LossConfig
from marl_jax.algos.optim import OptimConfig
from marl_jax.models import decoder, lora
from marl_jax.models.config import get_preset
from marl_jax.parallel import policies, update
from marl_jax.parallel.mesh import make_mesh
from marl_jax.parallel.train_config import TrainConfig
from marl_jax.parallel.train_step import make_train_step
from host import FAST_COMPILE, cpu_devices

MODEL = get_preset("tiny-llama").replace(vocab_size=16)  # chance of a target token: 1/16
TARGETS = np.array([3, 11])  # agent a's rewarded token
A, PROBLEMS, K = 2, 4, 8  # agents, problems per step, samples per (problem, agent)
STEPS, GOAL = 20, 0.5  # mean reward must reach GOAL within STEPS updates


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def sample(pcfg, trainable, frozen, prompt, policy_ids, key):
  """One response token per row, its log-prob and critic values [N, 1]."""
  positions = jnp.broadcast_to(jnp.arange(prompt.shape[1]), prompt.shape)
  if pcfg.kind == "lora":
    adapters = lora.adapters(trainable["policy"], policy_ids, pcfg.lora)
    logits, _ = decoder.forward(frozen["base"], prompt, positions, MODEL, adapters=adapters)
  else:
    logits, _ = decoder.forward(trainable["policy"], prompt, positions, MODEL)
  logits = logits[:, -1]
  tokens = jax.random.categorical(key, logits)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, None], axis=-1)
  values = jnp.zeros(logp.shape)
  if pcfg.critic is not None:
    specs = policies.param_specs(pcfg, trainable, frozen, fsdp_size=1)
    response = tokens[:, None].astype(jnp.int32)
    values = policies.critic_values(pcfg, trainable, frozen, specs, TrainBatch(
        prompt=prompt, prompt_mask=jnp.ones(prompt.shape, bool), response=response,
        old_logp=logp, samples=None))
  return tokens.astype(jnp.int32), logp, values


def rollout(estimator, pcfg, trainable, frozen, key):
  """A batch of PROBLEMS x K x A samples."""
  problem, g, agent = (x.ravel() for x in np.meshgrid(
      np.arange(PROBLEMS), np.arange(K), np.arange(A), indexing="ij"))
  prompt = np.stack([1 + agent, 5 + problem], axis=1).astype(np.int32)  # [N, 2]
  policy_id = agent if pcfg.num_policies == A else np.zeros_like(agent)
  tokens, logp, values = jax.device_get(sample(pcfg, trainable, frozen, prompt, policy_id, key))
  hit = (tokens == TARGETS[agent]).astype(np.float32)
  fields = dict(problem_id=problem, agent_id=agent, policy_id=policy_id,
                token_mask=np.ones((len(hit), 1), bool))
  rewards = hit
  if estimator == "magrpo":  # joint action = the g-th sample of every agent; joint reward
    node = problem * K + g
    rewards = np.bincount(node, hit)[node] / A
    fields.update(node_id=node, parent_node=np.full(len(hit), -1))
  if estimator.startswith("gae") or estimator == "traj_grpo":
    fields.update(traj_id=problem * K + g)  # one trajectory per (problem, g): agent 0, agent 1
  if estimator.startswith("gae"):
    fields.update(values=values[:, 0], token_values=values)
  samples = make_batch(rewards, **fields)
  batch = TrainBatch(prompt=prompt, prompt_mask=np.ones(prompt.shape, bool),
                     response=tokens[:, None], old_logp=logp, samples=samples)
  return batch, hit.mean()


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_every_estimator_learns(estimator):
  critic = estimator.startswith("gae")
  space = GroupSpace(num_problems=PROBLEMS, num_agents=A, num_trajs=PROBLEMS * K,
                     num_nodes=PROBLEMS * K)
  optim = OptimConfig(lr=2e-2, weight_decay=0.0, max_grad_norm=1.0)
  if critic:  # MARFT: per-agent LoRA on a frozen base, centralised value head
    pcfg = policies.PolicyConfig(kind="lora", models=(MODEL,), num_policies=A,
                                 lora=lora.LoraConfig(rank=4, alpha=8.0), optim=(optim,),
                                 critic=(32,), critic_optim=OptimConfig(lr=1e-2))
  else:
    pcfg = policies.PolicyConfig(models=(MODEL,), optim=(optim,))
  cfg = TrainConfig(policy=pcfg, advantage=AdvantageConfig(estimator), space=space,
                    loss=LossConfig(policy_loss="reinforce" if estimator == "magrpo" else "ppo"),
                    with_entropy=False)
  fns = make_train_step(cfg, make_mesh(devices=cpu_devices(1)), compiler_options=FAST_COMPILE)
  # A frozen base needs embeddings large enough for a confident target token: with tied
  # embeddings of scale 0.02, |logit| <= |h| |e| ~ 1.3 and LoRA alone cannot exceed p ~ 0.2.
  init = jax.jit(lambda key: policies.init_params(pcfg, key, decoder.init_params(
      MODEL, jax.random.fold_in(key, 1), scale=0.1 if critic else 0.02)),
                 compiler_options=FAST_COMPILE)
  trainable, frozen = init(jax.random.key(0))
  state = fns.init(trainable)
  rewards = []
  for step in range(STEPS):
    batch, reward = rollout(estimator, pcfg, state.params, frozen, jax.random.key(100 + step))
    rewards.append(reward)
    if reward >= GOAL:
      break
    state, metrics = update.run(fns, cfg, state, frozen, batch, np.random.default_rng(step))
    assert metrics["finite"], (estimator, step)
  assert rewards[0] < 0.2, rewards  # starts near chance (1/16)
  assert rewards[-1] >= GOAL, f"{estimator}: mean reward {np.round(rewards, 2)}"
