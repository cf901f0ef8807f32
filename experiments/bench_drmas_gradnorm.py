"""Dr. MAS's gradient-norm effect: two agents whose rewards differ in scale by 10x.

A tiny shared policy learns a synthetic two-agent task (agent a earns `scale_a` when its
one-token answer is its target token; scales 1 and 10). With GRPO's single baseline and std over
the problem's samples of *both* agents, the std is set by the large-scale agent: its advantages
stay O(1) while the small-scale agent's shrink, so the two agents' gradient norms drift apart.
Dr. MAS normalises each agent with its own (problem, agent) statistics and keeps them comparable.
Both runs start from the same params and see the same random keys; per-agent gradient norms are
the train step's `agent/grad_norm` (each agent's own loss share, normalised by its own tokens).

    python experiments/bench_drmas_gradnorm.py --steps 20
prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.algos.advantage_config import AdvantageConfig
from marl_jax.algos.batch import GroupSpace, make_batch
from marl_jax.algos.batch import TrainBatch
from marl_jax.algos.losses import LossConfig
from marl_jax.algos.optim import OptimConfig
from marl_jax.models import decoder
from marl_jax.models.config import get_preset
from marl_jax.parallel import policies, update
from marl_jax.parallel.mesh import make_mesh
from marl_jax.parallel.train_config import TrainConfig, TrainSettings
from marl_jax.parallel.train_step import make_train_step

MODEL = get_preset("tiny-llama").replace(vocab_size=16)
TARGETS = np.array([3, 11])


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=20, help="training steps per estimator")
  p.add_argument("--problems", type=int, default=4, help="problems per step")
  p.add_argument("--k", type=int, default=8, help="samples per (problem, agent)")
  p.add_argument("--scales", type=float, nargs=2, default=(1.0, 10.0),
                 help="reward of a correct answer for agent 0 and agent 1")
  p.add_argument("--lr", type=float, default=1e-2)
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args()


@jax.jit
def _sample(params, prompt, key):
  positions = jnp.broadcast_to(jnp.arange(prompt.shape[1]), prompt.shape)
  logits, _ = decoder.forward(params, prompt, positions, MODEL)
  tokens = jax.random.categorical(key, logits[:, -1])
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, -1]), tokens[:, None], axis=-1)
  return tokens.astype(jnp.int32), logp


def rollout(params, key, problems: int, k: int, scales: np.ndarray):
  problem, _, agent = (x.ravel() for x in np.meshgrid(
      np.arange(problems), np.arange(k), np.arange(2), indexing="ij"))
  prompt = np.stack([1 + agent, 5 + problem], axis=1).astype(np.int32)
  tokens, logp = jax.device_get(_sample(params, prompt, key))
  hit = tokens == TARGETS[agent]
  samples = make_batch(scales[agent] * hit, problem_id=problem, agent_id=agent,
                       token_mask=np.ones((len(hit), 1), bool))
  batch = TrainBatch(prompt=prompt, prompt_mask=np.ones(prompt.shape, bool),
                     response=tokens[:, None], old_logp=logp, samples=samples)
  return batch, [float(hit[agent == a].mean()) for a in range(2)]


def run(estimator: str, args: argparse.Namespace) -> dict:
  pcfg = policies.PolicyConfig(models=(MODEL,), optim=(OptimConfig(
      lr=args.lr, weight_decay=0.0, max_grad_norm=1.0),))
  cfg = TrainConfig(policy=pcfg, advantage=AdvantageConfig(estimator), loss=LossConfig(),
                    space=GroupSpace(num_problems=args.problems, num_agents=2),
                    with_entropy=False, train=TrainSettings(agent_grad_norms=True))
  fns = make_train_step(cfg, make_mesh(devices=jax.devices()[:1]))
  trainable, _ = policies.init_params(pcfg, jax.random.key(args.seed))
  state = fns.init(trainable)
  norms, hits, adv_mean = [], [], []
  for step in range(args.steps):
    key = jax.random.fold_in(jax.random.key(args.seed + 1), step)
    batch, hit = rollout(state.params["policy"], key, args.problems, args.k,
                         np.asarray(args.scales))
    state, metrics = update.run(fns, cfg, state, {}, batch, np.random.default_rng(step))
    norms.append(np.asarray(metrics["agent/grad_norm"]).tolist())
    adv_mean.append(np.asarray(metrics["agent/adv_mean"]).tolist())
    hits.append(hit)
  n = np.asarray(norms)
  return {
      "grad_norm_mean": n.mean(0).round(4).tolist(),  # per agent, over steps
      "grad_norm_max": n.max(0).round(4).tolist(),
      # The baseline's offset from each agent's own rewards: mean advantage per agent and step.
      "abs_adv_mean": np.abs(np.asarray(adv_mean)).mean(0).round(3).tolist(),
      "hit_rate_first": np.round(hits[0], 3).tolist(),
      "hit_rate_last": np.round(hits[-1], 3).tolist(),
      "per_step_grad_norm": n.round(4).tolist(),
  }


def main():
  args = parse_args()
  start = time.time()
  out = {"config": {"model": "tiny-llama (vocab 16)", "reward_scales": list(args.scales),
                    "steps": args.steps, "problems": args.problems, "k": args.k,
                    "lr": args.lr, "seed": args.seed}}
  for estimator in ("grpo", "drmas"):
    out[estimator] = run(estimator, args)
  out["wall_s"] = round(time.time() - start, 1)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
