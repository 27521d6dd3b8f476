"""GRPO on a tiny byte-level model, through the whole pipeline, on a CPU.

    python examples/grpo_tiny.py                 # 60 steps (~30 s), prints the reward curve
    python examples/grpo_tiny.py --json          # one JSON object; exit 1 unless the run is clean
    python examples/grpo_tiny.py --png curve.png # where to plot it (when matplotlib is installed)

Redis, `rollout torch-engine` processes, `rollout worker` processes and this process
as the trainer (see local/grpo_run.py). The prompt names a letter case ("lower: " or
"upper: "); the reward is the share of the response written in it. Every step checks
that the trainer's log-probs of every trained token, under the weights of the version
that generated it, match the engine's within 1e-4.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click

from local.grpo_run import GRPOOptions, run_grpo


@click.command()
@click.option("--steps", default=GRPOOptions.steps, show_default=True, type=click.IntRange(min=1))
@click.option("--batch-size", default=GRPOOptions.batch_size, show_default=True, type=click.IntRange(min=1),
              help="Groups per step.")
@click.option("--n-samples", default=GRPOOptions.n_samples, show_default=True, type=click.IntRange(min=2),
              help="Samples per prompt.")
@click.option("--engines", default=GRPOOptions.engines, show_default=True, type=click.IntRange(1, 2))
@click.option("--workers", default=GRPOOptions.workers, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True)
@click.option("--png", default="grpo_tiny_curve.png", show_default=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Save the reward curve here when matplotlib is installed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary instead of the table.")
def main(steps, batch_size, n_samples, engines, workers, seed, png, as_json) -> None:
    opts = GRPOOptions(steps=steps, batch_size=batch_size, n_samples=n_samples, engines=engines, workers=workers,
                       curve_png=png)
    opts.trainer = replace(opts.trainer, seed=seed)
    summary = run_grpo(opts, echo=None if as_json else click.echo)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
