r"""Tokens/s of one full training step (forward, backward, AdamW update) vs a PyTorch reference.

    python -m experiments.bench_train_step [--batch 8 --prompt 128 --response 128 --steps 3]
    taskset -c 1 python -m experiments.bench_train_step --rounds 2   # one core, alternating
    # RL-shaped: one group of G = 8 samples of a 320-token prompt, each distinct prompt computed
    # once by the JAX learner (train.share_prompts) and the LM head in 64-token slices
    python -m experiments.bench_train_step --batch 8 --group 8 --prompt 320 --response 64 \
        --share_prompts --logits_chunk 64

The model is SmolLM2-135M-Instruct (the embedded GGUF; random params of the same preset with
--random). Four configurations each run in a fresh subprocess, so peak RSS (`ru_maxrss`) is per
configuration and the two frameworks never share threads:
  jax_full / jax_lora:     marl_jax's train step (shared policy; per-agent LoRA rank 16 on every
                           projection, two adapters), one device, GRPO advantages on device.
  torch_full / torch_lora: the same step in PyTorch: transformers' LlamaForCausalLM (SDPA
                           attention) with the same weights, response-position logits only,
                           the same PPO dual-clip token-mean loss, grad-norm clip 1.0, torch AdamW;
                           LoRA as the same per-row two-adapter sum.
  jax_full_remat / jax_lora_remat (opt-in): the JAX step with per-layer rematerialisation.
Both frameworks see the same batch (left-padded prompts) and report their first loss, which must
agree (same step, same numbers). tokens/s counts every prompt and response token a step
processes: batch * (prompt + response) / median step time over all rounds; useful tokens/s
counts only real ones (each row's own prompt without its left padding, and its response up to its
length), the figure for RL batches, whose rows share prompts (--group G: consecutive rows of G
hold one prompt, padding included; --share_prompts: the JAX learner computes it once, PyTorch
pads and recomputes it per row as a standard step does). On a shared machine,
pin to one core (`taskset`) and use `--rounds` so both frameworks see the same conditions: both
use every core they are allowed. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

MODES = ("jax_full", "jax_lora", "torch_full", "torch_lora")
EXTRA_MODES = ("jax_full_remat", "jax_lora_remat")  # per-layer remat: less memory
LORA_RANK, LORA_ALPHA, NUM_ADAPTERS = 16, 32.0, 2
LR, CLIP, DUAL_CLIP, MAX_NORM = 1e-6, 0.2, 3.0, 1.0


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--prompt", type=int, default=128, help="prompt tokens (left-padded)")
  p.add_argument("--response", type=int, default=128, help="response tokens")
  p.add_argument("--steps", type=int, default=3, help="timed steps after the first (compile)")
  p.add_argument("--modes", default=",".join(MODES),
                 help=f"comma-separated subset of {MODES + EXTRA_MODES}")
  p.add_argument("--rounds", type=int, default=1,
                 help="run the modes this many times, alternating (for a noisy machine)")
  p.add_argument("--random", action="store_true", help="random params instead of the GGUF")
  p.add_argument("--logits_chunk", type=int, default=None,
                 help="JAX modes: response positions per LM-head slice (TrainConfig)")
  p.add_argument("--group", type=int, default=1, help="rows per prompt (G); divides --batch")
  p.add_argument("--share_prompts", action="store_true",
                 help="JAX modes: compute each distinct prompt once (TrainBatch.num_prompts)")
  p.add_argument("--worker", choices=MODES + EXTRA_MODES, help=argparse.SUPPRESS)
  p.add_argument("--data", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def peak_rss_mib() -> float:
  return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


# ----------------------------------------------------------------------------- data (parent)


def write_data(args: argparse.Namespace, path: str) -> dict:
  """Model config, params (JAX layout, NumPy) and one batch, shared by every worker."""
  import jax

  from marl_jax.models import decoder
  from marl_jax.models.config import get_preset
  if args.random:
    config = get_preset("smollm2-135m-instruct")
    params = decoder.init_params(config, jax.random.key(0))
  else:
    from marl_jax.models.loading import load_model
    loaded = load_model("smollm2-135m-instruct")
    config, params = loaded.config, loaded.params
  rng = np.random.default_rng(0)
  n, tp, r, g = args.batch, args.prompt, args.response, args.group
  if n % g:
    raise SystemExit(f"--group={g} does not divide --batch={n}")
  pad = rng.integers(0, tp // 8 + 1, n // g).repeat(g)  # some left padding, as prompts have
  prompt_mask = np.arange(tp)[None] >= pad[:, None]
  prompt = np.where(prompt_mask, rng.integers(1, config.vocab_size, (n // g, tp)).repeat(g, 0), 0)
  lengths = rng.integers(r // 2, r + 1, n)
  arrays = dict(
      prompt=prompt.astype(np.int32), prompt_mask=prompt_mask,
      response=rng.integers(1, config.vocab_size, (n, r)).astype(np.int32),
      token_mask=np.arange(r)[None] < lengths[:, None],
      old_logp=(-np.log(config.vocab_size) + rng.normal(0, 0.5, (n, r))).astype(np.float32),
      rewards=rng.integers(0, 2, n).astype(np.float32),
      problem_id=(np.arange(n) // (g if g > 1 else 4)).astype(np.int32),
      agent_id=(np.arange(n) % 2).astype(
          np.int32))
  flat = {"/".join(str(getattr(k, "key", k)) for k in path_): np.asarray(v) for path_, v in
          jax.tree_util.tree_flatten_with_path(params)[0]}
  np.savez(os.path.join(path, "params.npz"), **flat)
  np.savez(os.path.join(path, "batch.npz"), **arrays)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({k: getattr(config, k) for k in config.__dataclass_fields__}, f)
  return {"model": "random smollm2-135m" if args.random else "smollm2-135m-instruct (GGUF)",
          "useful_tokens_per_step": int(prompt_mask.sum() + arrays["token_mask"].sum())}


def read_data(path: str):
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  params = dict(np.load(os.path.join(path, "params.npz")))
  batch = dict(np.load(os.path.join(path, "batch.npz")))
  return config, params, batch


def grpo_advantages(rewards, problem_id):
  adv = np.zeros_like(rewards)
  for g in np.unique(problem_id):
    idx = problem_id == g
    adv[idx] = (rewards[idx] - rewards[idx].mean()) / (rewards[idx].std() + 1e-6)
  return adv


# ----------------------------------------------------------------------------- JAX worker


def jax_worker(mode: str, args: argparse.Namespace) -> dict:
  import jax

  from marl_jax.parallel import policies
  from marl_jax.algos.advantage_config import AdvantageConfig
  from marl_jax.algos.batch import GroupSpace, make_batch
  from marl_jax.algos.losses import LossConfig
  from marl_jax.algos.optim import OptimConfig
  from marl_jax.models.config import ModelConfig
  from marl_jax.models.lora import LoraConfig
  from marl_jax.parallel.mesh import make_mesh
  from marl_jax.algos.batch import TrainBatch
  from marl_jax.parallel import update
  from marl_jax.parallel.train_config import TrainConfig, TrainSettings
  from marl_jax.parallel.train_step import make_train_step

  config_d, flat, b = read_data(args.data)
  config = ModelConfig(**config_d)
  params: dict = {}
  for key, value in flat.items():
    node = params
    *parents, leaf = key.split("/")
    for k in parents:
      node = node.setdefault(k, {})
    node[leaf] = value
  lora = mode.startswith("jax_lora")
  optim = OptimConfig(lr=LR, max_grad_norm=MAX_NORM, weight_decay=0.01)
  pcfg = policies.PolicyConfig(
      kind="lora" if lora else "shared", models=(config,),
      num_policies=NUM_ADAPTERS if lora else 1, optim=(optim,),
      lora=LoraConfig(LORA_RANK, LORA_ALPHA) if lora else None)
  n = len(b["rewards"])
  space = GroupSpace(num_problems=int(b["problem_id"].max()) + 1, num_agents=2)
  cfg = TrainConfig(policy=pcfg, advantage=AdvantageConfig("grpo"), space=space,
                    loss=LossConfig(clip_low=CLIP, clip_high=CLIP, dual_clip=DUAL_CLIP),
                    with_entropy=False,
                    train=TrainSettings(remat=mode.endswith("_remat"),
                                        logits_chunk=args.logits_chunk))
  fns = make_train_step(cfg, make_mesh(devices=jax.devices()[:1]))
  trainable, frozen = policies.init_params(pcfg, jax.random.key(0), base=params)
  trainable, frozen = fns.shard_params(trainable, frozen)
  state = fns.init(trainable)
  samples = make_batch(b["rewards"], problem_id=b["problem_id"], agent_id=b["agent_id"],
                       policy_id=b["agent_id"] if lora else np.zeros(n, np.int32),
                       token_mask=b["token_mask"])
  keys = b["agent_id"] if lora else np.zeros(n, np.int32)  # adapters change a prompt's k/v
  distinct = len({(b["prompt"][i].tobytes(), b["prompt_mask"][i].tobytes(), int(keys[i]))
                  for i in range(n)})
  batch = fns.shard_batch(TrainBatch(prompt=b["prompt"], prompt_mask=b["prompt_mask"],
                                     response=b["response"], old_logp=b["old_logp"],
                                     samples=samples,
                                     num_prompts=distinct if args.share_prompts else None))
  del params, flat
  rss_setup = peak_rss_mib()
  times, cpu, losses = [], [], []
  for _ in range(args.steps + 1):
    start, start_cpu = time.perf_counter(), time.process_time()
    state, metrics = update.run(fns, cfg, state, frozen, batch, np.random.default_rng(0))
    losses.append(float(metrics["loss"]))
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return {"first_step_s": times[0], "step_s": times[1:], "step_cpu_s": cpu[1:],
          "loss": losses[0], "rss_after_setup_mib": rss_setup}


# ----------------------------------------------------------------------------- PyTorch worker


def torch_worker(mode: str, args: argparse.Namespace) -> dict:
  import torch
  import transformers

  torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores this process may use
  config_d, flat, b = read_data(args.data)
  hf_config = transformers.LlamaConfig(
      vocab_size=config_d["vocab_size"], hidden_size=config_d["hidden_size"],
      intermediate_size=config_d["intermediate_size"],
      num_hidden_layers=config_d["num_hidden_layers"],
      num_attention_heads=config_d["num_attention_heads"],
      num_key_value_heads=config_d["num_key_value_heads"], head_dim=config_d["head_dim"],
      rope_theta=config_d["rope_theta"], rms_norm_eps=config_d["rms_norm_eps"],
      max_position_embeddings=config_d["max_position_embeddings"], tie_word_embeddings=True,
      attention_bias=False, mlp_bias=False)
  model = transformers.LlamaForCausalLM(hf_config)
  model.config._attn_implementation = "sdpa"
  state = {"model.embed_tokens.weight": flat["embed_tokens/embedding"],
           "model.norm.weight": flat["norm/scale"]}
  for l in range(config_d["num_hidden_layers"]):
    for group in ("self_attn", "mlp"):
      for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        key = f"layers/{group}/{name}/kernel"
        if key in flat:
          state[f"model.layers.{l}.{group}.{name}.weight"] = flat[key][l].T
    state[f"model.layers.{l}.input_layernorm.weight"] = flat["layers/input_layernorm/scale"][l]
    state[f"model.layers.{l}.post_attention_layernorm.weight"] = flat[
        "layers/post_attention_layernorm/scale"][l]
  model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()},
                        strict=False)
  model.tie_weights()
  del flat, state
  class TorchLora(torch.nn.Module):
    """y = base(x) + scale * (x A[p]) B[p], adapter p chosen per row (as marl_jax's decoder)."""

    def __init__(self, base, policy_ids):
      super().__init__()
      self.base, self.policy_ids = base, policy_ids
      d_in, d_out = base.in_features, base.out_features
      bound = 1 / np.sqrt(d_in)
      self.a = torch.nn.Parameter(
          torch.empty(NUM_ADAPTERS, d_in, LORA_RANK).uniform_(-bound, bound))
      self.b = torch.nn.Parameter(torch.zeros(NUM_ADAPTERS, LORA_RANK, d_out))

    def forward(self, x):
      a, b = self.a[self.policy_ids], self.b[self.policy_ids]
      return self.base(x) + (LORA_ALPHA / LORA_RANK) * torch.einsum(
          "btr,bro->bto", torch.einsum("bti,bir->btr", x, a), b)

  lora = mode == "torch_lora"
  policy_ids = torch.from_numpy(b["agent_id"].astype(np.int64))
  if lora:
    for p in model.parameters():
      p.requires_grad_(False)
    trainable = []
    for layer in model.model.layers:
      for group in (layer.self_attn, layer.mlp):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
          if hasattr(group, name):
            wrapped = TorchLora(getattr(group, name), policy_ids)
            setattr(group, name, wrapped)
            trainable += [wrapped.a, wrapped.b]
  else:
    trainable = list(model.parameters())
  opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.01)
  t = {k: torch.from_numpy(v) for k, v in b.items()}
  tp = t["prompt"].shape[1]
  tokens = torch.cat([t["prompt"], t["response"][:, :-1]], 1).long()
  attn = torch.cat([t["prompt_mask"], torch.ones_like(t["response"][:, :-1], dtype=torch.bool)], 1)
  positions = (attn.long().cumsum(-1) - 1).clamp(min=0)
  mask = t["token_mask"]
  rss_setup = peak_rss_mib()

  def step():
    adv = torch.from_numpy(grpo_advantages(b["rewards"], b["problem_id"]))[:, None]
    hidden = model.model(input_ids=tokens, attention_mask=attn.long(),
                         position_ids=positions).last_hidden_state
    logits = model.lm_head(hidden[:, tp - 1:]).float()
    logp = torch.log_softmax(logits, -1).gather(-1, t["response"].long()[..., None])[..., 0]
    ratio = torch.exp(torch.clamp(logp - t["old_logp"], -20, 20))
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
    per_token = torch.where(adv < 0, torch.minimum(per_token, -DUAL_CLIP * adv), per_token)
    per_token = torch.where(mask, per_token, 0.0)
    if lora:  # marl_jax normalises each policy's loss over its own tokens
      loss = sum(per_token[policy_ids == p].sum() / mask[policy_ids == p].sum()
                 for p in range(NUM_ADAPTERS))
    else:
      loss = per_token.sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)

  times, cpu, losses = [], [], []
  for _ in range(args.steps + 1):
    start, start_cpu = time.perf_counter(), time.process_time()
    losses.append(step())
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return {"first_step_s": times[0], "step_s": times[1:], "step_cpu_s": cpu[1:],
          "loss": losses[0], "rss_after_setup_mib": rss_setup}


# ----------------------------------------------------------------------------- driver


def worker_main(args: argparse.Namespace) -> None:
  run = jax_worker if args.worker.startswith("jax") else torch_worker
  out = run(args.worker, args)
  out["peak_rss_mib"] = peak_rss_mib()
  print("RESULT " + json.dumps(out))


def main() -> None:
  args = parse_args()
  if args.worker:
    worker_main(args)
    return
  modes = [m for m in args.modes.split(",") if m]
  unknown = sorted(set(modes) - set(MODES + EXTRA_MODES))
  if unknown:
    raise SystemExit(f"unknown modes {unknown}; expected a subset of {list(MODES + EXTRA_MODES)}")
  tokens = args.batch * (args.prompt + args.response)
  out = {"batch": args.batch, "prompt": args.prompt, "response": args.response,
         "tokens_per_step": tokens, "timed_steps": args.steps, "rounds": args.rounds,
         "logits_chunk": args.logits_chunk, "group": args.group,
         "share_prompts": args.share_prompts,
         "cpus": len(os.sched_getaffinity(0)),
         "load_avg_before": [round(x, 2) for x in os.getloadavg()]}
  runs: dict[str, list[dict]] = {m: [] for m in modes}
  with tempfile.TemporaryDirectory() as tmp:
    out.update(write_data(args, tmp))
    for _ in range(args.rounds):
      for mode in modes:
        cmd = [sys.executable, "-m", "experiments.bench_train_step", "--worker", mode, "--data",
               tmp, "--steps", str(args.steps)]
        if args.logits_chunk is not None:
          cmd += ["--logits_chunk", str(args.logits_chunk)]
        cmd += ["--group", str(args.group)] + ["--share_prompts"] * args.share_prompts
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not lines:
          raise SystemExit(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        runs[mode].append(json.loads(lines[-1][len("RESULT "):]))
  for mode, results in runs.items():
    steps = [t for r in results for t in r["step_s"]]
    cpu = [t for r in results for t in r["step_cpu_s"]]
    median = float(np.median(steps))
    out[mode] = {
        "median_step_s": round(median, 3), "tokens_per_s": round(tokens / median, 1),
        "useful_tokens_per_s": round(out["useful_tokens_per_step"] / median, 1),
        # CPU seconds the process used per step (all its threads): robust to other processes
        # taking the cores, so comparable across frameworks on a busy machine.
        "median_step_cpu_s": round(float(np.median(cpu)), 3),
        "step_s": [round(t, 3) for t in steps], "step_cpu_s": [round(t, 3) for t in cpu],
        "first_step_s": [round(r["first_step_s"], 2) for r in results],
        "loss": results[0]["loss"],
        "rss_after_setup_mib": max(r["rss_after_setup_mib"] for r in results),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in results)}
  for kind in ("full", "lora"):
    j, t = out.get(f"jax_{kind}"), out.get(f"torch_{kind}")
    if j and t:
      out[f"{kind}_speed_ratio_jax_over_torch"] = round(j["tokens_per_s"] / t["tokens_per_s"], 3)
      out[f"{kind}_cpu_time_ratio_torch_over_jax"] = round(
          t["median_step_cpu_s"] / j["median_step_cpu_s"], 3)
      out[f"{kind}_loss_abs_diff"] = float(f"{abs(j['loss'] - t['loss']):.3g}")
  out["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
  print(json.dumps(out))


if __name__ == "__main__":
  main()
