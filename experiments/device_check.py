r"""One command for a machine with an accelerator: what marl_jax does on it, as JSON and a table.

    python -m experiments.device_check [--model=qwen3-1.7b --rows=8 --group=8 --prompt=512 \
        --response=512 --new_tokens=256]
    python -m experiments.device_check --tiny   # any machine: tiny shapes (the suite runs this)

Random weights of a real preset (nothing is downloaded). Each part runs in its own subprocess
under its own --timeout_s and prints its results as it finishes them, so a part that fails or
runs out of time is reported as such and the others still count:

  jax    versions and devices; the RL train step of `--rows` prompts x `--group` samples of
         `--prompt` + `--response` tokens under the default precision (fp32 params and AdamW
         moments, compute "auto": bf16 on GPU/TPU, fp32 on CPU), shared prompts, remat, the LM
         head in 128-token slices: step time, useful tokens/s (each distinct prompt's real tokens
         once, each response's real tokens), model FLOP/s and MFU against the device's dense
         bf16 peak, executed matmul FLOP/s (remat's recompute included), peak device memory
         beside XLA's memory analysis of the compiled step (`experiments.plan`'s estimate);
         RL-shaped sampling (top-p 0.9, no stop token); numerics on a small batch: bf16-compute
         loss and gradient norm vs fp32, the fraction of weights one AdamW step at lr 1e-6
         changes with fp32 masters vs bf16 storage, and the sampler's log-probs (bf16 compute
         copy) vs the learner's (`models/precision.py`).
  torch  the same step in PyTorch on the same device (transformers, fp32 master weights with bf16
         autocast on CUDA, SDPA attention, gradient checkpointing, logits of the response
         positions only), and transformers `generate` on the same prompts (bf16 on CUDA).
  engine the continuous rollout engine (`marl_jax/sampling/continuous.py`): at each of
         --engine_slots slots, that many requests of --prompt tokens and --new_tokens each:
         decode tokens/s over the decode calls and the % of the HBM-read bound (weights plus the
         live rows' keys/values per step at the device's bandwidth), programs compiled.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np

# Dense bf16 peak FLOP/s and HBM bytes/s by device kind (vendor data sheets; SXM parts).
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "A100": (312e12, 2.0e12),
         "L4": (121e12, 0.3e12), "TPU v4": (275e12, 1.2e12), "TPU v5 lite": (197e12, 0.82e12),
         "TPU v5p": (459e12, 2.76e12), "TPU v6": (918e12, 1.64e12)}
TINY = dict(model="tiny-qwen3", rows=2, group=2, prompt=24, response=16, new_tokens=8, steps=1,
            numerics_prompt=16, numerics_response=8, engine_slots="4,8")
PARTS = ("jax", "torch", "engine")
LR = 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="qwen3-1.7b", help="an architecture preset (random weights)")
  p.add_argument("--rows", type=int, default=8, help="prompts per step")
  p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
  p.add_argument("--prompt", type=int, default=512, help="prompt tokens (some rows left-padded)")
  p.add_argument("--response", type=int, default=512, help="response tokens")
  p.add_argument("--new_tokens", type=int, default=256, help="sampled tokens per row")
  p.add_argument("--steps", type=int, default=3, help="timed train steps after the first")
  p.add_argument("--numerics_prompt", type=int, default=128)
  p.add_argument("--numerics_response", type=int, default=64)
  p.add_argument("--engine_slots", default="64,256",
                 help="the engine part's slot counts, comma-separated")
  p.add_argument("--tiny", action="store_true", help="tiny shapes for any machine: " + str(TINY))
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
  p.add_argument("--timeout_s", type=float, default=200.0, help="per part")
  p.add_argument("--part", help=argparse.SUPPRESS)  # a worker
  args = p.parse_args(argv)
  if args.tiny:
    for k, v in TINY.items():
      setattr(args, k, v)
  for name in ("rows", "group", "prompt", "response", "new_tokens", "numerics_prompt",
               "numerics_response"):
    if getattr(args, name) < 2:
      p.error(f"--{name}={getattr(args, name)}; expected an integer >= 2")
  unknown = sorted(set(args.parts.split(",")) - set(PARTS))
  if unknown:
    p.error(f"--parts={args.parts!r} names {unknown}; expected a subset of {','.join(PARTS)}")
  bad = [n for n in args.engine_slots.split(",") if not n.isdigit() or int(n) < 1]
  if bad:
    p.error(f"--engine_slots={args.engine_slots!r}; expected comma-separated integers >= 1")
  return args


def batch_arrays(vocab: int, rows: int, group: int, prompt: int, response: int, seed: int = 0
                 ) -> dict[str, np.ndarray]:
  """One RL-shaped batch, the same for both frameworks: `rows` prompts (some left padding),
  each repeated for its `group` samples, ragged responses, 0/1 rewards, old log-probs near a
  uniform policy's."""
  rng = np.random.default_rng(seed)
  n = rows * group
  pad = rng.integers(0, prompt // 8 + 1, rows).repeat(group)
  prompt_mask = np.arange(prompt)[None] >= pad[:, None]
  ids = rng.integers(1, vocab, (rows, prompt)).repeat(group, 0)
  lengths = rng.integers(response // 2, response + 1, n)
  return dict(prompt=np.where(prompt_mask, ids, 0).astype(np.int32), prompt_mask=prompt_mask,
              response=rng.integers(1, vocab, (n, response)).astype(np.int32),
              token_mask=np.arange(response)[None] < lengths[:, None],
              old_logp=(-math.log(vocab) + rng.normal(0, 0.5, (n, response))).astype(np.float32),
              rewards=rng.integers(0, 2, n).astype(np.float32),
              problem_id=(np.arange(n) // group).astype(np.int32))


def useful_tokens(b: dict[str, np.ndarray], group: int) -> int:
  """Each distinct prompt's real tokens once, and every response's real tokens."""
  return int(b["prompt_mask"][::group].sum() + b["token_mask"].sum())


def model_flops(config: Any, b: dict[str, np.ndarray], group: int) -> float:
  """Forward + backward FLOPs of the useful tokens: 6 x (matmul params) per token, plus the
  attention's 12 x layers x q heads x head dim x (keys each query sees)."""
  c = config
  q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
  per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
  matmul = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size  # + the LM head
  prompt_real = b["prompt_mask"][::group].sum(1)  # [rows]
  response_real = b["token_mask"].sum(1)  # [n]
  keys = float(np.sum(prompt_real * (prompt_real + 1) / 2))  # causal over each prompt once
  keys += float(np.sum(np.repeat(prompt_real, group) * response_real
                       + response_real * (response_real + 1) / 2))
  return 6.0 * matmul * useful_tokens(b, group) + 12.0 * c.num_hidden_layers * q * keys


def peaks(kind: str) -> tuple[float | None, float | None]:
  """(dense bf16 FLOP/s, HBM bytes/s) of a device kind, or Nones when unknown (e.g. a CPU)."""
  for name, values in PEAKS.items():
    if name.lower() in kind.lower():
      return values
  return None, None


def emit(name: str, value: Any) -> None:
  print("RESULT " + json.dumps({name: value}, default=float), flush=True)


def host_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------- parts


def run_part(part: str, args: argparse.Namespace) -> dict[str, Any]:
  """Runs one part in a subprocess under --timeout_s; what it finished, and its status."""
  cmd = [sys.executable, "-m", "experiments.device_check", f"--part={part}",
         *[f"--{k}={getattr(args, k)}" for k in (
             "model", "rows", "group", "prompt", "response", "new_tokens", "steps",
             "numerics_prompt", "numerics_response", "engine_slots")]]
  start = time.monotonic()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out, err, status = proc.stdout, proc.stderr, "ok" if proc.returncode == 0 else "failed"
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    status = f"timed out after {args.timeout_s:.0f} s"
  result: dict[str, Any] = {}
  for line in out.splitlines():
    if line.startswith("RESULT "):
      result.update(json.loads(line[len("RESULT "):]))
  result["status"] = status
  result["wall_s"] = round(time.monotonic() - start, 1)
  if status != "ok":
    result["error"] = [line for line in err.strip().splitlines() if line.strip()][-1:] or [""]
  return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  if args.part == "jax":
    from experiments import device_check_jax
    device_check_jax.run(args)
    return {}
  if args.part == "torch":
    from experiments import device_check_torch
    device_check_torch.run(args)
    return {}
  if args.part == "engine":
    from experiments import device_check_jax
    device_check_jax.run_engine(args)
    return {}
  report: dict[str, Any] = {
      "shape": {k: getattr(args, k) for k in ("model", "rows", "group", "prompt", "response",
                                               "new_tokens")},
      "host": {"machine": platform.machine(), "cpu": platform.processor(),
               "cores": os.cpu_count()}}
  for part in args.parts.split(","):
    report[part] = run_part(part, args)
  print(json.dumps(report, indent=1, default=float))
  print(table(report), file=sys.stderr)
  return report


def table(report: dict[str, Any]) -> str:
  """The report's headline figures, one line each."""
  j, t, e = report.get("jax", {}), report.get("torch", {}), report.get("engine", {})
  step, tstep, num = j.get("train_step", {}), t.get("train_step", {}), j.get("numerics", {})
  samp, gen = j.get("sampling", {}), t.get("generate", {})
  fmt = lambda x, spec: "-" if x is None else format(x, spec)
  gib = lambda x: None if x is None else x / 2**30
  lines = [f"device_check: {report['shape']}",
           f"jax part: {j.get('status')} ({j.get('wall_s')} s); torch part: {t.get('status')} "
           f"({t.get('wall_s')} s)",
           f"devices: {j.get('info', {}).get('devices')}",
           f"train step  jax {fmt(step.get('step_s'), '.3f')} s ({step.get('compute_dtype')}), "
           f"{fmt(step.get('useful_tokens_per_s'), '.0f')} useful tok/s, MFU "
           f"{fmt(step.get('mfu'), '.3f')}, peak {fmt(gib(step.get('peak_bytes')), '.2f')} GiB "
           f"(estimate {fmt(gib(step.get('estimated_peak_bytes')), '.2f')} GiB); torch "
           f"{fmt(tstep.get('step_s'), '.3f')} s, peak {fmt(gib(tstep.get('peak_bytes')), '.2f')}"
           " GiB",
           f"sampling    jax {fmt(samp.get('new_tokens_per_s'), '.0f')} new tok/s; torch generate "
           f"{fmt(gen.get('new_tokens_per_s'), '.0f')} new tok/s",
           "engine      " + ("; ".join(
               f"{n} slots {fmt(x.get('decode_tokens_per_s'), '.0f')} decode tok/s, "
               f"{fmt(x.get('fraction_of_hbm_bound'), '.0%')} of the HBM bound"
               for n, x in e.get("engine", {}).items()) or f"{e.get('status')}"),
           f"numerics    bf16 vs fp32 loss {fmt(num.get('loss_rel_diff'), '.2e')}, grad norm "
           f"{fmt(num.get('grad_norm_rel_diff'), '.2e')}; lr 1e-6 step moves "
           f"{fmt(num.get('moved_fp32_masters'), '.1%')} (fp32 masters) vs "
           f"{fmt(num.get('moved_bf16_storage'), '.1%')} (bf16 storage); sampler vs learner "
           f"|dlogp| mean {fmt(num.get('sampler_learner_abs_logp_mean'), '.2e')}"]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
