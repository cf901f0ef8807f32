"""The lm-eval adapter (`--model marl_jax`) run offline: local task YAMLs over a local JSONL file
written here, a tiny trained run as `checkpoint=` and its export as `model=`; loglikelihoods,
rolling loglikelihoods and greedy generations against a transformers (PyTorch) forward of the
same weights.

Tolerance, per scored token: our logits and PyTorch's differ by fp32 rounding, at most
20 * sqrt(128) * eps32 * max|logit| (derived in tests/training/test_export.py); a log-prob is a
logit minus a logsumexp, so it is off by at most twice that, and a sum over m tokens by 2m times.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is an optional dependency: pip install "
                              "-r requirements-eval.txt")
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

import toy_task  # noqa: E402
from experiments import export_check  # noqa: E402
from marl_jax.training import export, trainer  # noqa: E402
from marl_jax.training import lm_eval_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("shared_compiles")  # conftest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_LENGTH = 24  # small, so the long document below spans several rolling windows
LONG = ("A much longer document that is split into several rolling windows of the maximum "
        "length, so that the windowing and every window's own context are exercised.")
_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
TASKS = {
    "tiny_mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
               "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
               "target_delimiter: ''\n"  # the choices carry their own leading space
               "metric_list:\n  - metric: acc\n",
    "tiny_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
                    "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
                "doc_to_target: '{{choices[answer]}}'\ngeneration_kwargs:\n  until: ['\\n']\n"
                "  max_gen_toks: 8\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(workdir of a one-step toy run, its export, the task directory, the HF model and tokenizer
  of the export)."""
  root = tmp_path_factory.mktemp("lm_eval")
  model_dir, workdir = str(root / "model"), str(root / "run")
  toy_task.write_tiny_model(model_dir)
  toy_task.register()
  c = toy_task.toy_config(model_dir, steps=1)
  c.eval.num_problems, c.eval.k = 1, 1
  trainer.train(c, workdir)
  export.export_team(export.restore_team(workdir), str(root / "export"))
  path = str(root / "export" / "writer")
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(path)
  # One choice is the model's own greedy next token, so some scored pair is greedy: the first
  # question whose greedy token, as text, tokenises back to itself after the question.
  encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
  for question in ("The sky is:", "Answer:", "The sky is", "Q: colour? A:"):
    ids = encode(question)
    token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
    if encode(question + tokenizer.decode([token])) == ids + [token]:
      break
  else:
    raise AssertionError("no question's greedy token round-trips through the tokenizer")
  rows = [{"question": question, "choices": [tokenizer.decode([token]), " blue", " loud"],
           "answer": 1, "text": "Apples and oranges are fruits."},
          {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0,
           "text": LONG}]
  tasks = root / "tasks"
  tasks.mkdir()
  (tasks / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  for name, body in TASKS.items():
    (tasks / f"{name}.yaml").write_text(_TASK.format(name=name, data=tasks / "data.jsonl") + body)
  return workdir, path, str(tasks), model, tokenizer


def _evaluate(model_args: dict, tasks: list[str], task_dir: str) -> dict:
  return lm_eval.simple_evaluate(model="marl_jax", model_args=model_args, tasks=tasks,
                                 task_manager=TaskManager(include_path=task_dir), batch_size=4,
                                 log_samples=True)["samples"]


def _reference(model, context: list[int], continuation: list[int]) -> tuple[float, bool, float]:
  """(sum of log p(continuation), all greedy, the tolerance) from PyTorch, float64 softmax."""
  ids = torch.tensor([context + continuation[:-1]])
  with torch.no_grad():
    logits = model(ids).logits[0, len(context) - 1:].double()
  logp = torch.log_softmax(logits, dim=-1)
  target = torch.tensor(continuation)
  eps_logit = 20 * math.sqrt(128) * float(np.finfo(np.float32).eps) * float(logits.abs().max())
  return (float(logp[torch.arange(len(continuation)), target].sum()),
          bool((logits.argmax(-1) == target).all()), 2 * len(continuation) * eps_logit)


def test_loglikelihoods_match_a_transformers_forward(setup):
  workdir, _, tasks, model, tokenizer = setup
  samples = _evaluate({"checkpoint": workdir, "max_length": MAX_LENGTH},
                      ["tiny_mc", "tiny_rolling"], tasks)
  encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
  greedy_seen = 0
  for sample in samples["tiny_mc"]:
    for (context, continuation), ((ll, greedy),) in zip(sample["arguments"], sample["resps"]):
      context_ids, whole = encode(context), encode(context + continuation)
      assert whole[:len(context_ids)] == context_ids
      want, want_greedy, tol = _reference(model, context_ids, whole[len(context_ids):])
      assert abs(ll - want) <= tol and greedy == want_greedy, (context, continuation)
      greedy_seen += greedy
  assert greedy_seen >= 1  # the greedy choice is recognised as such
  prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
  for sample in samples["tiny_rolling"]:
    ((text,),), ((ll,),) = sample["arguments"], sample["resps"]
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        encode(text), prefix, MAX_LENGTH, 1)]
    refs = [_reference(model, c, r) for c, r in windows]
    assert abs(ll - sum(r[0] for r in refs)) <= sum(r[2] for r in refs)
    if text == LONG:
      assert len(windows) >= 2  # one more window than the first, with its own context


def test_generate_until_matches_transformers_greedy_decoding(setup):
  _, path, tasks, model, tokenizer = setup
  samples = _evaluate({"model": path}, ["tiny_gen"], tasks)
  for sample in samples["tiny_gen"]:
    (context, kwargs), = sample["arguments"]
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=kwargs["max_gen_toks"],
                         do_sample=False)[0, len(ids):]
    want = tokenizer.decode(out, skip_special_tokens=True).split("\n")[0]
    assert sample["resps"] == [[want]], context
    assert want  # the comparison is not between two empty strings


def test_bad_model_arguments_are_refused(setup):
  workdir, path, _, _, _ = setup
  cases = [({"checkpoint": workdir, "model": path}, "give exactly one of checkpoint="),
           ({"model": path, "policy": "writer"}, "step= and policy= pick a checkpoint's policy"),
           ({"checkpoint": workdir, "policy": "critic"},
            r"policy='critic'; expected one of \['writer'\]"),
           ({"model": path, "max_length": 10**6}, "expected at most the model's context, 512"),
           ({"model": path, "max_batch_size": 8}, "max_batch_size=8; expected none"),
           ({"model": path, "batch_size": "auto"}, "batch_size='auto'; expected an integer >= 1")]
  for kwargs, message in cases:
    with pytest.raises(ValueError, match=message):
      lm_eval_model.MarlJaxLM(**kwargs)
  lm = lm_eval_model.MarlJaxLM(model=path)
  with pytest.raises(ValueError, match=r"generation options \['num_beams'\] are not supported"):
    lm._sampling({"until": ["\n"], "num_beams": 4})


def _harness(model_args: str, tasks: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=_REPO, JAX_PLATFORMS="cpu", HF_DATASETS_OFFLINE="1",
             HF_HUB_OFFLINE="1")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "experiments.harness", "run", "--model",
                         "marl_jax", "--model_args", model_args, "--tasks", "tiny_mc",
                         "--include_path", tasks, "--batch_size", "2"], cwd=_REPO, env=env,
                        capture_output=True, text=True, timeout=600, check=False)


def test_harness_command_runs_the_registered_model(setup):
  """`python -m experiments.harness` is lm-eval's CLI with `--model marl_jax` known; scoring shows
a bar over the (context, choice) pairs: tiny_mc's two questions have 3 + 2 choices."""
  _, path, tasks, _, _ = setup
  run = _harness(f"model={path},max_length={MAX_LENGTH}", tasks)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "|tiny_mc" in run.stdout and "acc" in run.stdout
  bar = run.stderr.replace("\r", "\n").splitlines()
  assert any(re.match(r"loglikelihood: 100%.*\| 5/5 ", line) for line in bar), run.stderr[-2000:]


@pytest.mark.parametrize("model_args, message", [
    ("checkpoint=/nowhere", "error: /nowhere has no checkpoint; expected the workdir of a run"),
    ("model={path},max_length=x", "error: marl_jax model argument max_length='x'; expected an "
                                  "integer >= 2"),
])
def test_harness_bad_input_is_one_line(setup, model_args, message):
  _, path, tasks, _, _ = setup
  run = _harness(model_args.format(path=path), tasks)
  last = run.stderr.strip().splitlines()[-1]
  assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
  assert last.startswith(message), last


def test_export_check_finds_the_export_and_the_run_agree(setup):
  """`experiments.export_check`: the run's logits against the export's in transformers, and the
  marl_jax lm-eval model against lm-eval's own `hf` model on the export, within the bounds."""
  workdir, path, _, _, _ = setup
  records = {r["what"]: r for r in export_check.compare(workdir, os.path.dirname(path))}
  eps_logit = 20 * math.sqrt(128) * float(np.finfo(np.float32).eps)
  logits = records["logits"]
  assert logits["policy"] == "writer" and logits["max_abs_logit"] > 1.0
  assert logits["max_abs_diff"] <= eps_logit * logits["max_abs_logit"]
  longest = max(len(c) for _, c in export_check.PAIRS)  # characters bound the tokens scored
  ll = records["loglikelihood"]
  assert ll["max_abs_diff"] <= 2 * longest * eps_logit * logits["max_abs_logit"] * 2
  assert ll["greedy_agree"] == ll["pairs"] == len(export_check.PAIRS)
