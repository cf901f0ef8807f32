"""Paper configs: every preset builds, defaults are docs/papers.md's, cpu presets train end to end.

The end-to-end runs override the model with a tiny random 2-layer Llama carrying the SmolLM2
tokenizer (`toy_task.write_tiny_model`), cut replies to 16 tokens and sample without top-p
truncation: the embedded 135M model would take minutes per preset on 2 cores, and top-p sorts the
whole 49k vocabulary at every decoded token (~0.1 s per step on this CPU, tested in the sampler's
own tests). Everything else (env, workflow, rollout mode, estimator, loss, team policies,
checkpoints, evaluation traces) is the preset's own. A persistent compilation
cache shared by the runs lets presets with identical programs (sampler shapes, train steps) reuse
each other's compiles.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import math

import pytest

import toy_task
from configs import (atgrpo_games, atgrpo_plan_path, common, orchestration_spawn,
                     orchestration_stop)
from marl_jax.envs.code import data as code_data
from marl_jax.envs.search import task as search_task
from marl_jax.envs.writing import data as writing_data
from marl_jax.parallel import layouts
from marl_jax.training import config as config_lib
from marl_jax.training import llm_policy, setup, trainer
from marl_jax.training.metrics import read_metrics
from marl_jax.traces import replay, store
from marl_jax.traces.schema import validate
from marl_jax.workflows import registry

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest


def _module(name: str):
  return importlib.import_module(f"configs.{name}")


# Every option axis of every config file (the first option of an axis is its default).
AXES = {
    "atgrpo_math": {"variant": atgrpo_games.TASK_VARIANTS},
    "atgrpo_code": {"variant": atgrpo_games.TASK_VARIANTS},
    "drmas_search": {"estimator": common.DRMAS_ESTIMATORS,
                     "models": _module("drmas_search").MODELS},
    # drmas_math's cpu run also has a schedule: the smoke sizes or the README's main job (cpu).
    "drmas_math": {"estimator": common.DRMAS_ESTIMATORS, "models": _module("drmas_math").MODELS,
                   "schedule": _module("drmas_math").SCHEDULES},
    **{name: {"estimator": common.MAGRPO_ESTIMATORS, "models": _module(name).MODELS}
       for name in ("magrpo_tldr", "magrpo_arxiv", "magrpo_humaneval")},
    "orchestration_stop": {"models": common.MODELS, "review": orchestration_stop.REVIEWS},
    "orchestration_spawn": {"decision": tuple(orchestration_spawn.DECISIONS),
                            "models": orchestration_spawn.MODELS},
}
FILES = tuple(AXES)
# The AT-GRPO game files share the game table's axis (the plan_path cpu run: tests/training).
GAME_AXES = {f"atgrpo_{game}": {"variant": atgrpo_games.VARIANTS}
             for game in ("sokoban", "sudoku")}
# Plan-Path's cpu run also has a schedule: the former main job, or the RL comparison (cpu only).
GAME_AXES["atgrpo_plan_path"] = {"variant": atgrpo_games.VARIANTS,
                                 "schedule": atgrpo_plan_path.SCHEDULES}


def _presets():
  for name, axes in {**AXES, **GAME_AXES}.items():
    for options in itertools.product(*axes.values()):
      for cpu in ((), ("cpu",)):
        if (cpu or "rl" not in options) and not {"grpo", "rl"} <= set(options):
          yield name, ",".join(options + cpu)


def _config(name: str, preset: str | None):
  return _module(name).get_config(preset)


def _field(c, dotted: str):
  for part in dotted.split("."):
    c = c[part]
  return c


@pytest.mark.parametrize("name, preset", list(_presets()))
def test_every_preset_builds(name, preset):
  c = _config(name, preset)
  built = config_lib.build(c)
  assert (built.lora is not None) == (c.policy.kind == "lora")
  spec = built.spec
  shared = sum(len(group.split("+")) - 1 for group in c.policy.share)  # agents joining another's
  per_role = layouts.of(c.policy).per_role
  assert spec.num_policies == (len(spec.agents) - shared if per_role else 1)
  if "cpu" in preset.split(","):
    assert c.model == "smollm2-135m-instruct"
    rl = "rl" in preset.split(",")
    assert (c.rollout.problems_per_step, c.rollout.k) == ((4, 4) if rl else (2, 2))
    if name == "atgrpo_plan_path":  # compact prompts and a warm-start, then the schedule's RL
      assert c.sampling.max_new_tokens == 256 and c.env.kwargs.prompt == "compact"
      lr = 3e-3 if c.policy.kind == "lora" else 3e-4  # adapters warm-start at 10x
      assert (c.sft.steps, c.sft.problems_per_step, c.sft.lr) == ((4 if rl else 8), 4, lr)
      assert c.eval.num_problems == 16 and c.eval.at_start
      # main: one RL step (the main job until issue 39); rl: 8 steps at lr 2e-5, evaluated every 4
      assert (c.train.steps, c.eval.every, c.optim.lr) == ((8, 4, 2e-5) if rl else (1, 2, 1e-5))
      assert c.name.endswith("_rl") == rl
    elif rl:  # drmas_math's main job: one-operation problems, a warm-start, then 8 RL steps
      assert c.env.kwargs.level == "one_step" and c.sampling.max_new_tokens == 32
      assert (c.sft.steps, c.sft.problems_per_step, c.sft.lr) == (3, 8, 1e-4)
      assert (c.algo.filter, c.rollout.max_refills, c.optim.lr) == ("zero_variance", 1, 2e-5)
      assert (c.train.steps, c.eval.every, c.eval.num_problems, c.eval.k) == (8, 2, 32, 2)
      assert c.eval.at_start and not c.train.recompute_old_logp
      assert c.name.endswith("_rl")
    else:
      assert 32 <= c.sampling.max_new_tokens <= 64 and c.sft.steps == 0
      assert c.eval.num_problems <= 4 and not c.eval.at_start and c.eval.every == 2
      assert c.train.steps == 2
    assert c.train.remat and c.checkpoint.every_steps == (4 if rl and name == "drmas_math" else 1)
    assert c.train.share_prompts and c.train.logits_chunk == 32
    assert c.env.kwargs.get("path") is None and c.env.kwargs.get("corpus_path") is None


# docs/papers.md values of each file's default preset (section 1: AT-GRPO, 2: Dr. MAS, 3: MAGRPO).
_ATGRPO = {"rollout.mode": "tree", "rollout.k": 8, "rollout.problems_per_step": 32,
           "train.steps": 200, "sampling.max_new_tokens": 2048, "optim.lr": 1e-6,
           "optim.schedule": "constant", "optim.weight_decay": 0.01, "optim.max_grad_norm": 1.0,
           "loss.policy_loss": "ppo", "loss.clip_low": 0.2, "loss.clip_high": 0.2,
           "loss.dual_clip": 3.0, "loss.aggregation": "token_mean", "loss.kl_coef": 0.0,
           "loss.entropy_coef": 0.0, "algo.estimator": "at_grpo", "algo.filter": "lowest_mean",
           "algo.filter_fraction": 0.5, "algo.alpha": 1.0, "algo.std_ddof": 1,
           "eval.every": 10, "model": "qwen3-1.7b", "policy.kind": "shared", "env.max_turns": 4}
_DRMAS = {"rollout.mode": "independent", "algo.estimator": "drmas", "algo.alpha": 1.0,
          "algo.std_ddof": 1,
          "algo.filter": "none", "loss.clip_low": 0.2, "loss.clip_high": 0.2,
          "loss.dual_clip": 3.0, "loss.aggregation": "token_mean", "loss.kl_coef": 0.0,
          "optim.max_grad_norm": 1.0, "optim.lr": 1e-6, "eval.k": 16, "eval.temperature": 0.6,
          "eval.top_p": 0.95, "env.workflow": "drmas"}
_MAGRPO = {"rollout.mode": "independent", "rollout.k": 4, "env.workflow": "magrpo",
           "env.max_turns": 1, "algo.estimator": "magrpo", "algo.alpha": 0.0,
           "algo.baseline": "mean", "loss.policy_loss": "reinforce", "loss.kl_coef": 0.0,
           "policy.kind": "stacked"}
PAPER_DEFAULTS = {
    "atgrpo_math": {**_ATGRPO, "env.name": "math", "env.workflow": "atgrpo"},
    "atgrpo_code": {**_ATGRPO, "env.name": "code", "env.workflow": "atgrpo"},
    "drmas_math": {**_DRMAS, "env.name": "math", "model": "qwen3-4b", "env.max_turns": 2,
                   "rollout.problems_per_step": 32, "rollout.k": 8, "loss.entropy_coef": 0.0},
    "drmas_search": {**_DRMAS, "env.name": "search", "model": "qwen2.5-3b", "env.max_turns": 4,
                     "rollout.problems_per_step": 128, "rollout.k": 5,
                     "loss.entropy_coef": 0.001},
    "magrpo_tldr": {**_MAGRPO, "env.name": "writing", "env.kwargs.task": "tldr",
                    "model": "qwen3-1.7b", "optim.lr": 5e-6, "sampling.temperature": 0.7,
                    "sampling.top_p": 0.9, "sampling.max_new_tokens": 256},
    "magrpo_arxiv": {**_MAGRPO, "env.name": "writing", "env.kwargs.task": "arxiv",
                     "model": "qwen3-1.7b", "optim.lr": 5e-6, "sampling.temperature": 0.7,
                     "sampling.top_p": 0.9, "sampling.max_new_tokens": 256},
    "magrpo_humaneval": {**_MAGRPO, "env.name": "code", "model": "qwen2.5-3b", "optim.lr": 1e-5},
    # Not a paper's: Dr. MAS math with its exit made a coordinator's decision (issue 14).
    "orchestration_stop": {**_DRMAS, "env.name": "math", "model": "qwen3-4b",
                           "env.workflow": "learned_stop", "env.max_turns": 3,
                           "algo.group_by": "problem_turn_agent", "env.kwargs.round_cost": 0.1,
                           "rollout.problems_per_step": 32, "rollout.k": 8},
    "orchestration_spawn": {**_DRMAS, "env.name": "math", "model": "qwen3-4b",
                            "env.workflow": "spawn", "env.max_turns": 1,
                            "algo.group_by": "problem_turn_agent", "env.kwargs.spawn_cost": 0.1,
                            "rollout.problems_per_step": 32, "rollout.k": 8},
}


@pytest.mark.parametrize("name", FILES)
def test_defaults_are_the_papers(name):
  c = _config(name, None)
  got = {k: _field(c, k) for k in PAPER_DEFAULTS[name]}
  assert got == PAPER_DEFAULTS[name]
  assert _config(name, "").to_dict() == c.to_dict()  # an empty preset is the default


@pytest.mark.parametrize("name, preset, want", [
    # PettingLLMs' single-agent script: tree sampling, (problem, turn, agent) groups, filter.
    ("atgrpo_math", "sa_grpo", {"env.workflow": "single", "algo.estimator": "at_grpo",
                                "rollout.mode": "tree", "algo.filter": "lowest_mean",
                                "algo.alpha": 0.0, "algo.std_ddof": 1}),
    ("atgrpo_math", "mas_grpo", {"env.workflow": "atgrpo", "algo.estimator": "grpo",
                                 "rollout.mode": "independent", "algo.alpha": 1.0,
                                 "algo.std_ddof": 1}),
    ("atgrpo_code", "mas_lora", {"policy.kind": "lora",
                                 "lora.rank": 16, "lora.alpha": 32.0}),
    ("atgrpo_code", "mas_full", {"policy.kind": "stacked"}),
    ("atgrpo_code", "mas_norl", {"train.eval_only": True, "env.workflow": "atgrpo"}),
    ("atgrpo_math", "single", {"train.eval_only": True, "env.max_turns": 1}),
    # Dr. MAS's vanilla GRPO: calls scored with their trajectory's mean (traj_grpo).
    ("drmas_math", "grpo", {"algo.estimator": "traj_grpo", "algo.alpha": 1.0,
                            "algo.std_ddof": 1, "policy.kind": "shared"}),
    ("drmas_search", "full,grpo", {"algo.estimator": "traj_grpo", "policy.kind": "stacked"}),
    ("drmas_search", "lora", {"algo.estimator": "drmas", "policy.kind": "lora"}),
    ("magrpo_tldr", "rloo,shared", {"algo.baseline": "loo", "policy.kind": "shared"}),
    ("magrpo_humaneval", "remax,lora", {"algo.baseline": "max", "policy.kind": "lora"}),
    # Learned spawning over fixed workers: the dispatcher's model, one for the rest, RL on it.
    ("orchestration_spawn", "checked,split,cpu",
     {"env.workflow": "spawn_checked", "policy.kind": "stacked",
      "policy.share": ("worker_1+worker_2+worker_3+worker_4+aggregator",),
      "train.agents": "dispatcher"}),
    ("orchestration_spawn", "delegate,split",
     {"policy.share": ("stepwise+concise+checker+casework+aggregator",),
      "train.agents": "dispatcher"}),
])
def test_variants(name, preset, want):
  c = _config(name, preset)
  assert {k: _field(c, k) for k in want} == want


@pytest.mark.parametrize("name, preset, message", [
    ("drmas_math", "drmas,grpo", "a second estimator 'grpo'"),
    ("drmas_search", "sharded", "unknown option 'sharded'"),
    ("atgrpo_code", "mas_shared,mas_lora", "a second variant"),
    ("magrpo_arxiv", "full,cpu,gpu", "unknown option 'gpu'"),
    ("atgrpo_sudoku", "mas_shared,single", "a second variant"),
    ("atgrpo_plan_path", "cpu,gpu", "unknown option 'gpu'"),
    ("atgrpo_plan_path", "mas_grpo,rl", "the 'rl' schedule is a cpu schedule; add 'cpu'"),
    ("drmas_math", "drmas,rl", "the 'rl' schedule is a cpu schedule; add 'cpu'"),
    ("drmas_search", "drmas,rl,cpu", "unknown option 'rl'"),
    ("atgrpo_sokoban", "mas_shared,cpu,rl", "unknown option 'rl'"),
])
def test_bad_presets_name_the_options(name, preset, message):
  with pytest.raises(ValueError, match=message):
    _config(name, preset)


def test_the_main_jobs_dynamic_sampling_refuses_the_grpo_baseline():
  """drmas_math's `rl` schedule filters zero-variance groups, which traj_grpo does not have:
  config.build refuses it in one line, before any compute."""
  with pytest.raises(ValueError, match="filter 'zero_variance' applies to .* not 'traj_grpo'"):
    config_lib.build(_config("drmas_math", "grpo,rl,cpu"))


@pytest.mark.parametrize("preset, estimator, ratio_level", [
    ("action", "gae_action", "sequence"), ("token,cpu", "gae_token", "token")])
def test_marft_presets_build(preset, estimator, ratio_level):
  c = _config("marft_math", preset)
  config_lib.build(c)
  assert (c.algo.estimator, c.loss.ratio_level, c.policy.kind) == (estimator, ratio_level, "lora")
  assert c.rollout.k == 1 and tuple(c.policy.critic) == (1024, 512)
  with pytest.raises(ValueError, match="unknown option 'tree'"):
    _config("marft_math", "tree")


@pytest.mark.parametrize("preset, kind", [(None, "stacked"), ("lora", "lora")])
def test_learning_preset_builds(preset, kind):
  c = _config("learning_cpu", preset)
  config_lib.build(c)
  assert (c.env.name, c.policy.kind, c.model) == ("writing", kind, "smollm2-135m-instruct")
  assert c.eval.at_start and c.train.steps == 16 and c.env.kwargs.sentences == 3
  with pytest.raises(ValueError, match="already is a cpu preset"):
    _config("learning_cpu", "full,cpu")


def test_cli_data_fields_exist_for_local_datasets():
  """The trainer's config is locked: the data kwargs a command line sets must already exist."""
  math = ("path", "fmt", "level")
  for name, fields in (("atgrpo_math", math), ("atgrpo_code", ("path", "fmt")),
                       ("drmas_math", math), ("marft_math", math), ("orchestration_stop", math),
                       ("orchestration_spawn", math),
                       ("drmas_search", ("corpus_path", "questions_path")),
                       ("magrpo_tldr", ("path", "field")), ("magrpo_arxiv", ("path", "field")),
                       ("magrpo_humaneval", ("path", "fmt"))):
    c = _config(name, None)
    c.lock()
    for field in fields:
      c.env.kwargs[field] = "x"  # raises for a missing field of a locked config


# ---------------------------------------------------------------------------- problem sources


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_generated_problem_kwargs_rebuild_the_envs():
  """Without data files, seeds select generated (or packaged) problems the envs accept."""
  for env_name, workflow in (("math", "drmas"), ("code", "atgrpo"), ("code", "magrpo"),
                             ("writing", "magrpo"), ("search", "drmas")):
    for seed in (0, 29, 1_000_001):
      kwargs = registry.problem_kwargs(env_name, workflow, 2, seed, {"path": None})
      env = registry.make_env(env_name, **kwargs)
      assert not env.done
  search = registry.problem_kwargs("search", "drmas", 3, 29, {})
  q = search_task.WORLD_QUESTIONS
  assert (search["seed"], search["index"], search["max_steps"]) == (29 // q, 29 % q, 3)
  humaneval = registry.problem_kwargs("code", "magrpo", 1, 200, {})
  assert humaneval["humaneval_index"] == 200 % len(code_data.humaneval())
  math_env = registry.task("math", "atgrpo").problem("atgrpo", 4, 7)
  assert math_env == dict(seed=7, workflow="atgrpo", max_turns=4)


def test_local_datasets_map_seeds_to_rows(tmp_path):
  math_path = _jsonl(tmp_path / "m.jsonl", [{"problem": f"What is {i} + 1?", "answer": str(i + 1)}
                                            for i in range(3)])
  kw = registry.problem_kwargs("math", "drmas", 2, 7, {"path": math_path, "fmt": "plain"})
  assert kw["index"] == 7 % 3 and "seed" not in kw
  assert registry.make_env("math", **kw).problem.question == "What is 1 + 1?"

  docs = _jsonl(tmp_path / "d.jsonl", [{"abstract": f"abstract number {i}"} for i in range(5)])
  kw = registry.problem_kwargs("writing", "magrpo", 1, 13,
                               {"path": docs, "task": "arxiv", "field": None})
  env = registry.make_env("writing", **kw)
  assert (env.document, env.task) == ("abstract number 3", "arxiv")

  code = _jsonl(tmp_path / "c.jsonl", [
      {"id": f"t{i}", "question": f"print {i}", "style": "stdio",
       "tests": [{"input": "", "output": str(i)}]} for i in range(2)])
  for workflow in ("atgrpo", "single"):
    kw = registry.problem_kwargs("code", workflow, 2, 5, {"path": code, "fmt": "canonical"})
    assert "stdio_seed" not in kw and "humaneval_index" not in kw
    assert registry.make_env("code", **kw).problem.id == "t1"

  corpus = _jsonl(tmp_path / "corpus.jsonl", [{"title": "Zorblat", "text": "Zorblat is blue."},
                                              {"title": "Quim", "text": "Quim is red."}])
  questions = _jsonl(tmp_path / "q.jsonl", [{"question": "Colour of Zorblat?",
                                             "golden_answers": ["blue"]},
                                            {"question": "Colour of Quim?", "answers": ["red"]}])
  kw = registry.problem_kwargs("search", "drmas", 4, 3,
                               {"corpus_path": corpus, "questions_path": questions})
  assert kw["index"] == 1 and "seed" not in kw and "num_people" not in kw
  env = registry.make_env("search", **kw)
  assert env.question["answers"] == ["red"] and env.max_steps == 4

  # The trainer's problems come from the same mapping: a config pointing at the file trains on
  # its rows, seed s -> row s % rows, with dense problem ids.
  c = importlib.import_module("configs.drmas_math").get_config("cpu")
  c.env.kwargs.path = math_path
  built = setup.problems(c, 4, 2)
  assert [p.problem_id for p in built] == [0, 1]
  assert [registry.make_env("math", **p.kwargs).problem.question for p in built] == [
      "What is 1 + 1?", "What is 2 + 1?"]


def test_evaluation_reads_its_own_split(tmp_path):
  """eval.env_kwargs names a test file: evaluation reads its rows, training keeps its own, and
  an unset eval field (fmt) follows training's."""
  train = _jsonl(tmp_path / "train.jsonl", [{"problem": f"What is {i} + 1?", "answer": str(i + 1)}
                                            for i in range(3)])
  test = _jsonl(tmp_path / "test.jsonl", [{"problem": f"What is {i} * 2?", "answer": str(2 * i)}
                                          for i in range(4)])
  c = importlib.import_module("configs.drmas_math").get_config("cpu")
  c.env.kwargs.path, c.env.kwargs.fmt, c.eval.env_kwargs.path = train, "plain", test
  question = lambda p: registry.make_env("math", **p.kwargs).problem.question
  assert [question(p) for p in setup.problems(c, 0, 2)] == ["What is 0 + 1?", "What is 1 + 1?"]
  # Evaluation problem i reads row (seed_offset + i) % 4 of the test file: 1e6 % 4 == 0.
  evaluated = setup.problems(c, c.eval.seed_offset, 4, for_eval=True)
  assert [question(p) for p in evaluated] == [f"What is {i} * 2?" for i in range(4)]
  assert all(p.kwargs["fmt"] == "plain" for p in evaluated)
  with c.unlocked():
    c.eval.env_kwargs.corpus_path = "x.jsonl"
  with pytest.raises(ValueError, match=r"config.eval.env_kwargs sets \['corpus_path'\], which "
                                       r"config.env.kwargs does not declare"):
    config_lib.build(c)


def test_generated_writing_documents_have_the_requested_length():
  short = registry.make_env("writing", seed=3, sentences=2).document
  assert short == writing_data.generated_document(3, 2) and short.count(". ") == 1
  with pytest.raises(ValueError, match=r"sentences=0; expected an integer in \[1, 1000\]"):
    registry.make_env("writing", seed=3, sentences=0)


def test_empty_dataset_is_an_error(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(ValueError, match="has no rows"):
    registry.problem_kwargs("writing", "magrpo", 1, 0, {"path": str(empty)})


# ------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
  return tiny_model_dir


def _cpu_run(name: str, model_dir: str, preset: str = "cpu"):
  c = _config(name, preset)
  c.model = model_dir
  c.sampling.max_new_tokens, c.sampling.top_p, c.eval.top_p = 16, 1.0, None
  toy_task.quiet_logging(c)
  return c


def _check_workdir(c, workdir, summary) -> list[dict]:
  """Two logged steps, a checkpoint per step, valid and replayable evaluation traces."""
  assert summary["steps"] == 2 and summary["skipped_updates"] == 0
  records = read_metrics(workdir)
  assert [r["step"] for r in records] == [1, 2]
  assert all(math.isfinite(r["train/loss"]) for r in records)
  assert "eval/accuracy" in records[-1] and "eval/accuracy" not in records[0]
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                if p.name.isdigit()) == [1, 2]
  trace_path = workdir / "traces" / "eval_step2.jsonl"
  traces = [t for _, t in store.iter_traces(trace_path)]
  content = store.read_content(trace_path)
  assert len(traces) == c.eval.num_problems * c.eval.k
  for t in traces:
    validate(t)
    assert t["task_id"].startswith(c.env.name)
    assert replay.replay(t, content) == []
  return traces


@pytest.mark.parametrize("name,preset", [(name, "cpu") for name in FILES]
                         + [("orchestration_spawn", "delegate,cpu")])
def test_cpu_preset_trains_two_steps(name, preset, model_dir, tmp_path):
  c = _cpu_run(name, model_dir, preset)
  _check_workdir(c, tmp_path, trainer.train(c, str(tmp_path)))
  # Per-agent train metrics exist exactly for the agents that acted in the update.
  silent = 0
  for record in read_metrics(tmp_path):
    counts = {k.rsplit("/", 1)[1]: v for k, v in record.items() if k.startswith("agent/samples/")}
    assert counts and sum(counts.values()) > 0
    for agent, count in counts.items():
      assert ("agent/adv_mean/" + agent in record) == (count > 0), (agent, count)
      silent += count == 0
  if name == "orchestration_spawn":  # the tiny model never writes a valid choice: one worker
    assert silent > 0


HOSTILE = (
    "```python\nimport os\nwhile True:\n    os.fork()\n```",  # fork bomb
    "```python\nwhile True:\n    pass\n```",  # infinite loop
    "```python\nx = bytearray(1 << 34)\nprint(len(x))\n```",  # memory bomb
    "```python\nwhile True:\n    print('A' * 10000)\n```",  # output flood
)


@pytest.mark.parametrize("name", ["atgrpo_math", "atgrpo_code"])
def test_hostile_programs_do_not_break_training(name, model_dir, tmp_path, monkeypatch):
  """Every reply is a hostile program (the sampled tokens are kept, so the update still runs):
  the math tool agent's programs and the coder's programs run in the sandbox, time out or hit
  their limits, and training finishes with valid traces."""
  collect = llm_policy._Served.collect
  count = itertools.count()

  def hostile(self):
    return [(ticket, dataclasses.replace(g, text=HOSTILE[next(count) % len(HOSTILE)]))
            for ticket, g in collect(self)]

  monkeypatch.setattr(llm_policy._Served, "collect", hostile)
  c = _cpu_run(name, model_dir)
  c.rollout.tool_timeout_s = 1.0
  if name == "atgrpo_code":
    c.env.kwargs.case_timeout_s, c.env.kwargs.total_timeout_s = 0.5, 2.0
  traces = _check_workdir(c, tmp_path, trainer.train(c, str(tmp_path)))
  assert all(t["metrics"]["task_success"] == 0.0 for t in traces)
  if name == "atgrpo_math":
    assert all(any(e["type"] == "tool_result" for e in t["events"]) for t in traces)
