"""A CPU run that shows learning: MAGRPO TLDR on the embedded SmolLM2-135M, ~33 min on 2 cores.

The game presets cannot show learning at this scale: SmolLM2-135M never writes a parseable move
list, so every sample gets the same format penalty and every group advantage is exactly 0. The
writing reward (docs/papers.md section 3) is graded: the level-gated joint reward (max 3.0) varies
between the G joint actions of a post from the first step, and one behaviour decides most of it:
agent 1 (concise TL;DR) must write clearly shorter than agent 2 (detailed summary) for the length
ratio level to pay, and the two texts must share few content words. So the held-out reward
moves within a few dozen updates.

    python -m experiments.train --config=configs/learning_cpu.py --workdir=runs/learning_cpu

On this project's 2-core CPU machine the held-out mean joint reward went from 0.89 before
training to 1.58 after step 16 (RESULTS.md, "MAGRPO TLDR learns on CPU": every number, the
memory of its train step and how it came down).

`get_config("[full|lora]")`: one full model per agent (MAGRPO's setting, default) or one LoRA
adapter per agent over the frozen model (rank 16, alpha 32, lr 1e-4). Otherwise the MAGRPO
config (configs/common.py: G = 4 aligned joint actions, mean baseline, REINFORCE), shrunk: 2
generated 3-sentence posts per step, 96-token replies at temperature 0.7 (top-p 1: the top-p
sort over the 49k-token vocabulary costs more than the rest of a CPU decode step), lr 2e-5 (4x
the paper's 5e-6: 16 steps instead of 1000), evaluation of 16 held-out posts, greedy, before
training, after step 8 and at the end. Memory: the learner rematerialises each layer, computes
each post's prompt once for its G joint actions (train.share_prompts) and the LM head in
32-position slices, in one micro-batch: the same maths as more micro-batches without
rematerialisation, in less memory (RESULTS.md).
"""

from __future__ import annotations

from configs import common

MODELS = ("full", "lora")


def get_config(preset: str | None = None):
  choice, cpu = common.parse_preset(preset, {"models": MODELS})
  if cpu:
    raise ValueError("configs/learning_cpu.py already is a cpu preset; drop ',cpu'")
  c = common.writing_config("tldr", f"magrpo,{choice['models']},cpu", common.MODELS)
  c.name = f"learning_cpu_tldr_{choice['models']}"
  c.env.kwargs.sentences = 3
  c.rollout.problems_per_step, c.rollout.k = 2, 4
  c.sampling.max_new_tokens, c.sampling.top_p = 96, 1.0
  c.optim.lr = 2e-5 if choice["models"] == "full" else 1e-4
  c.lora.rank, c.lora.alpha = 16, 32.0
  c.train.steps, c.train.remat, c.train.micro_batches = 16, True, 1
  c.train.share_prompts, c.train.logits_chunk = True, 32
  c.eval.every, c.eval.num_problems, c.eval.at_start, c.eval.temperature = 8, 16, True, 0.0
  c.checkpoint.every_steps = 8
  return c
