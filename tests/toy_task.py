"""A one-agent task whose reward any random policy can move, and a tiny model that plays it.

Used by the trainer tests (in-process and in the SIGKILL worker): reward = the fraction of the
reply's characters that are vowels, so advantages are non-zero and params change every step.
"""

from __future__ import annotations

import functools
import html
import os
import re
import signal
import subprocess
import sys
import time

import jax

from marl_jax.envs import base as envs_base
from marl_jax.models import config as model_config
from marl_jax.models import decoder, hf
from marl_jax.models.loading import embedded_gguf_path
from marl_jax.models.tokenizer import Tokenizer
from marl_jax.training import samples
from marl_jax.workflows import registry

NAME = "toy_vowels"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_worker.py")


class VowelEnv:
  agents = ("writer",)

  def __init__(self, seed: int, turn: int = 0, reward: float = 0.0):
    self.seed, self.turn, self.reward = seed, turn, reward

  done = property(lambda self: self.turn >= 1)
  solved = property(lambda self: self.reward > 0.5)

  def clone(self):
    return VowelEnv(self.seed, self.turn, self.reward)

  def observe(self, agent):
    return envs_base.Observation(agent, self.turn, "Answer briefly.", f"Say vowels ({self.seed}).")

  def step(self, agent, response):
    text = response or ""
    self.reward = sum(ch in "aeiouAEIOU" for ch in text) / max(len(text), 1)
    self.turn += 1
    return envs_base.StepResult(agent, None, {agent: self.reward}, True, {})


def make_env(*, seed: int) -> VowelEnv:
  return VowelEnv(seed)


PAIR = "toy_vowel_pair"


class PairEnv:
  """Two agents, one turn each, rewarded with their reply's vowel fraction: a team whose
  agents' rewards move, for per-role layouts (one policy per agent)."""
  agents = ("first", "second")

  def __init__(self, seed: int, turn: int = 0):
    self.seed, self.turn = seed, turn

  done = property(lambda self: self.turn >= 2)
  solved = property(lambda self: False)

  def clone(self):
    return PairEnv(self.seed, self.turn)

  def observe(self, agent):
    return envs_base.Observation(agent, 0, f"You are {agent}.", f"Vowels ({self.seed}).")

  def step(self, agent, response):
    text = response or ""
    self.turn += 1
    reward = sum(ch in "aeiouAEIOU" for ch in text) / max(len(text), 1)
    return envs_base.StepResult(agent, None, {agent: reward}, self.done, {})


def register_pair() -> None:
  """Registers the pair env and its one-turn workflow 'mas' (replacing an earlier call's)."""
  registry.register(PAIR, envs_base.Task(
      lambda *, seed: PairEnv(seed),
      {"mas": envs_base.Workflow(("first", "second"), max_turns=1, fixed_turns=True)},
      lambda v, t, seed: dict(seed=seed)), replace=True)


def register() -> None:
  """Registers the toy env, its one-turn workflow and its replayer (replacing an earlier call's)."""
  registry.register(NAME, envs_base.Task(
      make_env, {"single": envs_base.Workflow(("writer",), max_turns=1, fixed_turns=True)},
      lambda v, t, seed: dict(seed=seed)), replace=True)


@functools.lru_cache(maxsize=None)
def _tiny_model():
  """The tiny model's config, params and tokenizer, built once per process: the random init
  compiles and the GGUF tokenizer parses the embedded file, seconds each, while writing them out
  takes milliseconds. Nothing mutates them (jax arrays; `export_hf_dir` only reads the tokenizer)."""
  config = model_config.get_preset("tiny-llama").replace(vocab_size=49152)
  params = decoder.init_params(config, jax.random.key(0), scale=0.5)
  return config, params, Tokenizer.from_gguf(embedded_gguf_path())


def embedded_tokenizer() -> Tokenizer:
  """The embedded SmolLM2 tokenizer (`Tokenizer.from_gguf`), the one the tiny model is written
  with; shared within the process, so callers must not change it."""
  return _tiny_model()[2]


def write_tiny_model(path: str) -> None:
  """A random 2-layer Llama with the embedded SmolLM2 tokenizer, as an HF directory (the same
  files on every call: seeded init, one fresh directory per caller)."""
  config, params, tokenizer = _tiny_model()
  hf.export_hf_dir(params, config, path, tokenizer=tokenizer)


def toy_config(model_dir: str, steps: int):
  from marl_jax.training.config import base_config
  c = base_config()
  c.model = model_dir
  c.env.name, c.env.workflow, c.env.max_turns = NAME, "single", 1
  c.rollout.mode, c.rollout.k, c.rollout.problems_per_step = "independent", 4, 2
  c.algo.estimator, c.algo.filter = "grpo", "none"
  c.sampling.max_new_tokens = 8
  c.optim.lr = 1e-2
  c.train.steps = steps
  c.eval.every, c.eval.num_problems, c.eval.at_start = 2, 2, False
  c.checkpoint.every_steps = 1
  quiet_logging(c)
  return c


def quiet_logging(c) -> None:
  """A test run's logging: metrics.jsonl only; no wandb, console lines, progress bar or
  learning-curve PNG (~2 s a run; test_trainer's end-to-end test turns it back on)."""
  c.logging.wandb_mode, c.logging.console, c.logging.progress = "disabled", False, False
  c.logging.learning_curve = False


def read_samples_page(path: str | os.PathLike[str]) -> list[dict[str, str]]:
  """The rows of a trainer's samples page (`training/samples.py`) as {column: text}
  (`samples.COLUMNS`; cells unescaped, numbers and yes/no as written)."""
  rows, episode = [], None
  for line in open(path, encoding="utf-8").read().splitlines():
    if line.startswith("## problem "):
      problem, traj = line.removeprefix("## problem ").split(", trajectory ")
      episode = {"problem": problem, "trajectory": traj}
    elif line.startswith("| ") and episode is not None and not line.startswith("| turn |"):
      cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
      values = [html.unescape(c[1:-1].replace("<br>", "\n").replace("\\|", "|"))
                for c in cells]  # each cell is written as " text "
      rows.append(dict(episode, **dict(zip(samples.COLUMNS[2:], values))))
  return rows


def start_worker(model_dir: str, workdir, steps: int, *options: str, env: dict
                 ) -> subprocess.Popen:
  """The toy training run in its own process (`resume_worker.py`, `options` such as
  "--engine=continuous"), stderr kept for the test's failure message."""
  return subprocess.Popen(
      [sys.executable, WORKER, *options, model_dir, str(workdir), str(steps)], env=env,
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kill_after_checkpoint(process: subprocess.Popen, workdir, step: int) -> None:
  """SIGKILLs `process` as soon as its checkpoint `step` is committed in `workdir`; asserts the
  run was still going (a run that finished first tests no resume)."""
  marker = os.path.join(workdir, "checkpoints", str(step), "commit_success.txt")
  deadline = time.monotonic() + 600
  while not os.path.exists(marker) and process.poll() is None and time.monotonic() < deadline:
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
