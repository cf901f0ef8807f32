"""Exports a trained run's policies as Hugging Face model directories.

    python -m experiments.export --workdir=DIR [--checkpoint=STEP] --out=DIR [--lora=merge|adapters]

One directory per policy under --out, named after the agents it acts for (config.json,
model.safetensors, tokenizer files with the chat template, generation_config.json), loadable with
`transformers.AutoModelForCausalLM.from_pretrained`, vLLM or lm-eval, and by this project as
`--config.model=DIR`. A LoRA team's adapters are merged into the base (`--lora=merge`, default) or
written as PEFT adapter files beside one export of the base (`--lora=adapters`). `export.json`
in --out lists the directories and the agents each serves. Bad input ends in one `error: ...`
line.
"""

from __future__ import annotations

from absl import app, flags, logging

from experiments import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (its config.json and checkpoints).")
_CHECKPOINT = flags.DEFINE_integer("checkpoint", None, "Checkpoint step to export (default: the "
                                   "latest).")
_OUT = flags.DEFINE_string("out", None, "Directory to write the exported models into.")
_LORA = flags.DEFINE_enum("lora", "merge", ["merge", "adapters"], "LoRA teams: merge each "
                          "adapter into the base, or write PEFT adapter files and the base.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
  from marl_jax.training import export  # after flag parsing, so --help stays fast
  team = export.restore_team(_WORKDIR.value, _CHECKPOINT.value, _LORA.value)
  manifest = export.export_team(team, _OUT.value, _LORA.value)
  for name, entry in manifest["models"].items():
    print(f"{_OUT.value}/{entry['path']}: {entry['format']} for {', '.join(entry['agents'])}")
  if manifest["base"]:
    print(f"{_OUT.value}/{manifest['base']}: the base model the adapters apply to")


if __name__ == "__main__":
  cli.run(main)
