"""The PyTorch part of `experiments.device_check` (its own process): the same RL step in
transformers with fp32 master weights and bf16 autocast (CUDA), and `generate` on the same prompts.
A reference only: marl_jax never imports torch."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from experiments.device_check import LR, batch_arrays, emit, host_rss_bytes, useful_tokens

CLIP, DUAL_CLIP, MAX_NORM = 0.2, 3.0, 1.0  # marl_jax's LossConfig / OptimConfig defaults


def _model(config: Any, device: str):
  """A randomly initialised transformers model of the preset's architecture, fp32, SDPA."""
  import torch
  import transformers

  from marl_jax.models import hf
  fields = hf.config_to_hf(config)
  hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  with torch.device(device):
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa",
                                                          dtype=torch.float32)
  return model


def _grpo(rewards: np.ndarray, problem_id: np.ndarray) -> np.ndarray:
  adv = np.zeros_like(rewards)
  for g in np.unique(problem_id):
    idx = problem_id == g
    adv[idx] = (rewards[idx] - rewards[idx].mean()) / (rewards[idx].std() + 1e-6)
  return adv


def train_step(args: argparse.Namespace, config: Any, device: str) -> dict[str, Any]:
  import torch
  model = _model(config, device)
  model.gradient_checkpointing_enable()
  model.config.use_cache = False
  opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
  b = batch_arrays(config.vocab_size, args.rows, args.group, args.prompt, args.response)
  t = {k: torch.from_numpy(v).to(device) for k, v in b.items()}
  tp = b["prompt"].shape[1]
  tokens = torch.cat([t["prompt"], t["response"][:, :-1]], 1).long()
  attn = torch.cat([t["prompt_mask"], torch.ones_like(t["response"][:, :-1], dtype=torch.bool)],
                   1)
  positions = (attn.long().cumsum(-1) - 1).clamp(min=0)
  adv = torch.from_numpy(_grpo(b["rewards"], b["problem_id"]))[:, None].to(device)
  autocast = device == "cuda"

  def step() -> float:
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
      hidden = model.model(input_ids=tokens, attention_mask=attn.long(),
                           position_ids=positions).last_hidden_state
      logits = model.lm_head(hidden[:, tp - 1:]).float()  # response positions only
    logp = torch.log_softmax(logits, -1).gather(-1, t["response"].long()[..., None])[..., 0]
    ratio = torch.exp(torch.clamp(logp - t["old_logp"], -20, 20))
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
    per_token = torch.where(adv < 0, torch.minimum(per_token, -DUAL_CLIP * adv), per_token)
    loss = torch.where(t["token_mask"], per_token, 0.0).sum() / t["token_mask"].sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)

  times = []
  for _ in range(args.steps + 1):
    start = time.perf_counter()
    step()
    if device == "cuda":
      torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times[1:])
  return {"precision": "fp32 masters + bf16 autocast" if autocast else "fp32",
          "first_step_s": times[0], "step_s": step_s, "steps_s": times[1:],
          "useful_tokens_per_s": useful_tokens(b, args.group) / step_s,
          "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
          "peak_host_rss_bytes": host_rss_bytes()}


def generate(args: argparse.Namespace, config: Any, device: str) -> dict[str, Any]:
  import torch
  model = _model(config, device).eval()
  if device == "cuda":
    model = model.to(torch.bfloat16)
  b = batch_arrays(config.vocab_size, args.rows, args.group, args.prompt, 2)
  ids = torch.from_numpy(b["prompt"]).long().to(device)
  mask = torch.from_numpy(b["prompt_mask"]).long().to(device)
  times = []
  for i in range(2):  # a warm-up, then the timed call
    torch.manual_seed(i)
    start = time.perf_counter()
    with torch.no_grad():
      out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, do_sample=True, top_p=0.9,
                           temperature=1.0, top_k=0, pad_token_id=0)
    if device == "cuda":
      torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  new = int((out.shape[1] - ids.shape[1]) * ids.shape[0])
  return {"precision": "bf16" if device == "cuda" else "fp32", "call_s": times[-1],
          "new_tokens": new, "new_tokens_per_s": new / times[-1]}


def run(args: argparse.Namespace) -> None:
  import torch
  import transformers

  from marl_jax.models.config import get_preset
  device = "cuda" if torch.cuda.is_available() else "cpu"
  emit("info", {"torch": torch.__version__, "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"})
  config = get_preset(args.model)
  emit("train_step", train_step(args, config, device))
  if device == "cuda":
    torch.cuda.empty_cache()
  emit("generate", generate(args, config, device))
