r"""Six tiny 2-step trainings, one per shape of the update path, to check that a change to the
code leaves what a run computes unchanged.

    PYTHONPATH=TREE_A:TREE_A/tests python -m experiments.tiny_runs run ROOT_A
    PYTHONPATH=TREE_B:TREE_B/tests python -m experiments.tiny_runs run ROOT_B
    python -m experiments.tiny_runs compare ROOT_A ROOT_B

`run` trains each config for 2 RL steps on a random 2-layer Llama with the embedded tokenizer
(`tests/toy_task.write_tiny_model`), 2 problems per step and 12 new tokens, and writes
ROOT/<name>/metrics.jsonl; `compare` prints, per config, whether every logged value (times
aside) is equal, and the largest relative difference and the keys only one side logged where
not. Run on one CPU device (JAX_PLATFORMS=cpu, no XLA_FLAGS) so both sides compute the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

# name -> (config file, preset, overrides): the shapes the update path takes
CONFIGS = {
    # AT-GRPO tree, lowest-mean filter, PPO mini-batches, recomputed old log-probs, warm-start
    "atgrpo_plan_path": ("configs/atgrpo_plan_path.py", "cpu", {"sft.steps": 1}),
    # MAGRPO: REINFORCE, one update per rollout, magrpo_tree
    "magrpo_tldr": ("configs/magrpo_tldr.py", "magrpo,cpu", {}),
    # Dr. MAS with per-agent LoRA adapters
    "drmas_lora": ("configs/drmas_math.py", "drmas,lora,cpu", {}),
    # MARFT: critic, GAE, target_kl
    "marft": ("configs/marft_math.py", "action,cpu", {}),
    # a stacked team RL trains in part, with a KL reference
    "stop_partial": ("configs/orchestration_stop.py", "full,program,cpu", {"sft.steps": 1}),
    # per-agent models of one architecture each (mapped), DAPO dynamic sampling
    "drmas_hetero_dapo": ("configs/drmas_math.py", "drmas,hetero,cpu",
                          {"algo.filter": "zero_variance", "rollout.max_refills": 1}),
}


def config(path: str, preset: str, overrides: dict, model_dir: str):
  spec = importlib.util.spec_from_file_location("run_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(preset)
  c.model = model_dir
  c.policy.models = tuple(model_dir for _ in c.policy.models)
  c.sampling.max_new_tokens, c.rollout.problems_per_step, c.train.steps = 12, 2, 2
  c.eval.num_problems, c.eval.every, c.eval.at_start = 2, 2, True
  if c.sft.steps:
    c.sft.steps, c.sft.problems_per_step = 1, 2
  if c.train.mini_batch_size is not None:
    c.train.mini_batch_size = 4
  c.logging.wandb_mode, c.logging.console, c.logging.progress = "disabled", False, False
  c.checkpoint.every_steps = 1
  for key, value in overrides.items():
    group, name = key.split(".")
    c[group][name] = value
  return c


def run(root: str, names: list[str]) -> None:
  import toy_task  # tests/toy_task.py (PYTHONPATH)

  from marl_jax.training import trainer
  model_dir = os.path.join(root, "tiny_model")
  if not os.path.isdir(model_dir):
    toy_task.write_tiny_model(model_dir)
  for name in names or list(CONFIGS):
    trainer.train(config(*CONFIGS[name], model_dir), os.path.join(root, name))


def _rows(root: str, name: str) -> list[dict]:
  with open(os.path.join(root, name, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in f]


def compare(a: str, b: str) -> bool:
  equal = True
  for name in CONFIGS:
    ra, rb = _rows(a, name), _rows(b, name)
    worst, differing, only = 0.0, 0, set()
    for x, y in zip(ra, rb):
      only |= set(x) ^ set(y)
      for k in set(x) & set(y):
        if x[k] != y[k]:
          differing += 1
          if isinstance(x[k], (int, float)) and isinstance(y[k], (int, float)):
            worst = max(worst, abs(x[k] - y[k]) / max(abs(x[k]), 1e-12))
    same = ra == rb
    equal &= same
    print(json.dumps({"config": name, "equal": same, "rows": len(ra),
                      "values": sum(len(r) for r in ra), "differing": differing,
                      "max_rel_diff": worst, "keys_on_one_side": sorted(only)}))
  return equal


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  r = sub.add_parser("run")
  r.add_argument("root")
  r.add_argument("names", nargs="*", help=f"configs to run (default: all of {list(CONFIGS)})")
  c = sub.add_parser("compare")
  c.add_argument("a")
  c.add_argument("b")
  args = p.parse_args()
  if args.command == "run":
    unknown = sorted(set(args.names) - set(CONFIGS))
    if unknown:
      p.error(f"unknown configs {unknown}; expected names from {list(CONFIGS)}")
    run(args.root, args.names)
  else:
    raise SystemExit(0 if compare(args.a, args.b) else 1)


if __name__ == "__main__":
  main()
