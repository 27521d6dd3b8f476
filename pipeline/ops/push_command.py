"""`rollout push`: prompt groups from a dataset file into the queue (pipeline/producer.py),
once or as a feeder that keeps the prompt list topped up."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import redis

from pipeline.cli_support import INTERRUPTED_EXIT_CODE, Context, dump, stop_on_sigterm
from pipeline.connection import STARTUP_WAIT_S
from pipeline.producer import DEFAULT_MAX_PROMPT_BYTES, MAX_SAMPLES_PER_PROMPT
from pipeline.queue import Queue
from pipeline.wording import counted


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--input-key", default="input", show_default=True, help="Field holding the prompt.")
@click.option("--label-key", default="label", show_default=True, help="Field holding the label (optional in rows).")
@click.option("--metadata-key", default="metadata", show_default=True, help="Field holding a metadata object.")
@click.option("--n-samples", "n_samples", default=1, show_default=True,
              type=click.IntRange(1, MAX_SAMPLES_PER_PROMPT),
              help="Samples per prompt (n_samples_per_prompt): the group size.")
@click.option("--epochs", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--shuffle/--no-shuffle", default=False, show_default=True, help="Shuffle each epoch (seeded).")
@click.option("--seed", default=42, show_default=True, help="Shuffle seed (rollout_seed).")
@click.option("--skip-bad", is_flag=True, help="Dead-letter bad rows instead of refusing the file.")
@click.option("--dataset-name", help="Name of the dataset cursor. Default: the file name.")
@click.option("--restart-cursor", is_flag=True,
              help="Forget this dataset's cursor and push every row again, under new group ids.")
@click.option("--max-queued", type=click.IntRange(min=1),
              help="Feeder mode: keep pushing, but wait while the prompt list holds this many; "
                   "rides out Redis restarts (retrying with backoff) instead of exiting.")
@click.option("--max-prompt-bytes", default=DEFAULT_MAX_PROMPT_BYTES, show_default=True,
              type=click.IntRange(min=1), help="Largest row (prompt, label and metadata as stored); larger is bad.")
@click.option("--tokenizer", help="Hugging Face tokenizer path: with --context-length, refuse prompts too long.")
@click.option("--context-length", type=click.IntRange(min=1),
              help="The engine's context in tokens (SGLang's --context-length); needs --tokenizer.")
@click.option("--apply-chat-template/--no-apply-chat-template", default=None,
              help="Count string prompts in the chat template, or as text. Default: as the worker does "
                   "(the template when the tokenizer has one).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.pass_obj
def push(obj: Context, file: Path, input_key, label_key, metadata_key, n_samples, epochs, shuffle, seed,
         skip_bad, dataset_name, restart_cursor, max_queued, max_prompt_bytes, tokenizer, context_length,
         apply_chat_template, as_json) -> None:
    """Push prompt groups from a JSONL or Parquet FILE.

    The cursor lives in Redis: pushing the same dataset again resumes where the
    last push stopped and never pushes a (dataset, epoch, row) twice. It is kept
    with a fingerprint of the file and options: resuming with another file, seed,
    shuffle or group size is refused (use --dataset-name or --restart-cursor).
    A row dead-lettered by --skip-bad can be fixed in the file and sent again
    with `rollout dead retry`. Rows without a label are pushed with a warning:
    the default reward (math_boxed) needs one and dead-letters such groups on
    their first attempt.

    \b
    JSON keys (stable; docs/cli.md): namespace, file, dataset, rows, epochs,
    n_samples, pushed, dead, already, without_label.

    \b
    Example:
      rollout push prompts.jsonl --n-samples 8 --epochs 2 --shuffle
    """
    from rich.progress import Progress

    from pipeline.producer import DatasetError, PushOptions, PushReport, load_dataset, push_dataset
    from pipeline.retry import Reconnect

    if (tokenizer is None) != (context_length is None):
        raise click.UsageError("--tokenizer and --context-length go together: the prompt length is checked "
                               "against the context")
    opts = PushOptions(input_key=input_key, label_key=label_key, metadata_key=metadata_key,
                       n_samples_per_prompt=n_samples, epochs=epochs, shuffle=shuffle, seed=seed,
                       skip_bad=skip_bad, dataset_name=dataset_name, max_queued=max_queued,
                       max_prompt_bytes=max_prompt_bytes, context_length=context_length,
                       count_tokens=_token_counter(tokenizer, apply_chat_template) if tokenizer else None,
                       restart_cursor=restart_cursor)
    queue = obj.queue(wait_s=STARTUP_WAIT_S if max_queued else 0.0)  # a feeder waits for Redis like a worker
    # Each chunk and its cursor move in one script: stopping anywhere loses nothing.
    # Exit 130 (as a shell reports Ctrl-C): a script must be able to tell the push stopped early.
    with stop_on_sigterm(lambda: "push stopped; pushing the same dataset again resumes from its cursor",
                          exit_code=INTERRUPTED_EXIT_CODE):
        try:
            data = load_dataset(file, opts)
            if not data.rows:
                click.echo(f"warning: {file} holds no rows: nothing pushed", err=True)
                if as_json:
                    click.echo(dump(_push_record(obj, file, PushReport(dataset_name or file.name, 0), epochs,
                                                  n_samples)))
                return
            _warn_before_writing_every_epoch(data.rows, epochs, max_queued)
            with Progress(transient=True, disable=not sys.stderr.isatty()) as progress, \
                    _FeederProgress(queue, opts.dataset_name or file.name, len(data.rows) * epochs, max_queued) \
                    as feeder:
                task = progress.add_task(f"pushing {file.name}", total=len(data.rows) * epochs)
                # A feeder runs for the whole training run: it waits out a Redis restart like
                # the workers and the trainer do. A one-shot push stops and says how to resume.
                reconnect = Reconnect(f"feeder {opts.dataset_name or file.name}") if max_queued else None

                def advance(n: int) -> None:
                    progress.advance(task, n)
                    feeder.pushed += n

                report = push_dataset(queue, data, opts, progress=advance, reconnect=reconnect)
        except DatasetError as exc:
            raise click.ClickException(str(exc)) from None
        except redis.RedisError as exc:
            raise click.ClickException(obj.scrub(f"push stopped by a Redis error ({exc}); every chunk pushed is "
                                                 "recorded in the cursor: run the same push again to resume")) from None
    if n_samples == 1:
        click.echo("warning: --n-samples 1: groups of one sample, so every GRPO advantage (reward minus the "
                   "group's mean) is zero; GRPO-style training needs --n-samples 8 or so", err=True)
    if report.without_label:
        click.echo(f"warning: {report.without_label} of {report.rows} rows have no {label_key!r} field: the default "
                   "reward math_boxed (and exact_match) needs a label and dead-letters their groups on the first "
                   "attempt (use --label-key, or a reward that needs none)", err=True)
    if as_json:
        click.echo(dump(_push_record(obj, file, report, epochs, n_samples)))
    else:
        click.echo(f"{report.dataset}: pushed {counted(report.pushed, 'group')} of {n_samples}, "
                   f"{counted(report.dead, 'bad row')} dead-lettered, {report.already} already pushed before "
                   f"({counted(report.rows, 'row')} x {counted(epochs, 'epoch')})")
    if report.dead:
        click.echo("fix dead-lettered rows in the file, then `rollout dead retry --all` re-reads them", err=True)


#: Seconds between a feeder's progress lines (`push --max-queued` runs for hours, often in a container).
FEEDER_PROGRESS_S = 30.0


class _FeederProgress:
    """In feeder mode (--max-queued), a line on stderr every FEEDER_PROGRESS_S: groups pushed
    of the total and what the prompt list holds, so a feeder waiting for the workers says so."""

    def __init__(self, queue: Queue, dataset: str, total: int, max_queued: int | None):
        import threading

        self.queue, self.dataset, self.total, self.max_queued = queue, dataset, total, max_queued
        self.pushed = 0  # groups, advanced by the push
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feeder-progress", daemon=True)

    def __enter__(self) -> "_FeederProgress":
        if self.max_queued is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(FEEDER_PROGRESS_S):
            try:
                queued = self.queue.redis.llen(self.queue.keys.prompts)
                listed = f"{queued:,} of {self.max_queued:,}"
                full = queued >= self.max_queued and self.pushed < self.total
                waiting = "; waiting for the workers to take prompts" if full else ""
            except redis.RedisError:
                listed, waiting = "unknown", "; Redis unreachable, retrying"
            rate = self.pushed / max(time.monotonic() - started, 1e-9)
            click.echo(f"feeder {self.dataset}: pushed {self.pushed:,} of {self.total:,} groups ({rate:.1f}/s); "
                       f"prompt list {listed}{waiting}", err=True)


#: A push without --max-queued writes every epoch to Redis up front: above this, say so.
PUSH_UP_FRONT_WARN_BYTES = 64 * 2**20


def _warn_before_writing_every_epoch(rows: list, epochs: int, max_queued: int | None) -> None:
    up_front = sum(r.raw_bytes for r in rows) * epochs
    if max_queued is None and up_front > PUSH_UP_FRONT_WARN_BYTES:
        click.echo(f"warning: writing {len(rows):,} rows x {epochs} epochs to Redis up front "
                   f"(~{up_front / 2**20:,.0f} MB of prompts, held until trained); --max-queued 1024 feeds them as "
                   f"the workers drain the list (keep that push running, e.g. in the background)", err=True)


def _push_record(obj: Context, file: Path, report, epochs: int, n_samples: int) -> dict:
    from dataclasses import asdict

    return {"namespace": obj.namespace, "file": str(file), **asdict(report), "epochs": epochs, "n_samples": n_samples}


def _token_counter(name: str, apply_chat_template: bool | None):
    """Prompt length in tokens, for the context check at push time."""
    from workers.tokenizer import TokenizerError, encode_prompt, load_tokenizer

    try:
        tokenizer = load_tokenizer(name)
    except TokenizerError as exc:
        raise click.BadParameter(str(exc), param_hint="--tokenizer") from None
    return lambda prompt: len(encode_prompt(tokenizer, prompt, apply_chat_template))
