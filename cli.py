"""The `rollout` command line: a thin layer over the pipeline and worker functions.

Global options come first: `rollout --redis-url URL --namespace NS COMMAND ...`
(or ROLLOUT_REDIS_URL / ROLLOUT_NAMESPACE). Without a URL, commands use the local
Redis that `rollout up` or `rollout demo` started.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from pipeline.connection import ConnectionFailed, connect, redact
from pipeline.keys import check_namespace
from pipeline.queue import Queue
from pipeline.redis_server import local_redis_url

DEFAULT_NAMESPACE = "rollout"


@dataclass
class Context:
    redis_url: str | None
    namespace: str

    def url(self) -> str:
        if self.redis_url:
            return self.redis_url
        local = local_redis_url()
        if local is None:
            raise click.ClickException(
                "no Redis given and no local one running: pass --redis-url (or set ROLLOUT_REDIS_URL), "
                "or start a local stack with `rollout up`")
        return local

    def queue(self) -> Queue:
        try:
            return Queue(connect(self.url()), self.namespace)
        except ConnectionFailed as exc:
            raise click.ClickException(str(exc)) from None


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--redis-url", envvar="ROLLOUT_REDIS_URL", help="redis://, rediss:// or unix:// URL "
              "(env ROLLOUT_REDIS_URL). Default: the local Redis of `rollout up` / `rollout demo`.")
@click.option("--namespace", envvar="ROLLOUT_NAMESPACE", default=DEFAULT_NAMESPACE, show_default=True,
              help="Pipeline namespace: all its keys share this hash tag (env ROLLOUT_NAMESPACE).")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.pass_context
def main(ctx: click.Context, redis_url: str | None, namespace: str, verbose: int) -> None:
    """Redis-backed rollout queue for asynchronous RL: push prompts, run generation
    workers against SGLang engines, consume exact batches, inspect and operate it.

    \b
    Example:
      rollout demo                      # everything locally, on embedded defaults
      rollout --redis-url redis://h:6379 push data.jsonl --n-samples 8
    """
    _setup_logging(verbose)
    try:
        check_namespace(namespace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--namespace") from None
    ctx.obj = Context(redis_url, namespace)


# -- push ------------------------------------------------------------------------------


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--input-key", default="input", show_default=True, help="Field holding the prompt.")
@click.option("--label-key", default="label", show_default=True, help="Field holding the label (optional in rows).")
@click.option("--metadata-key", default="metadata", show_default=True, help="Field holding a metadata object.")
@click.option("--n-samples", "n_samples", default=1, show_default=True, type=click.IntRange(min=1),
              help="Samples per prompt (n_samples_per_prompt): the group size.")
@click.option("--epochs", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--shuffle/--no-shuffle", default=False, show_default=True, help="Shuffle each epoch (seeded).")
@click.option("--seed", default=42, show_default=True, help="Shuffle seed (rollout_seed).")
@click.option("--skip-bad", is_flag=True, help="Dead-letter bad rows instead of refusing the file.")
@click.option("--dataset-name", help="Name of the dataset cursor. Default: the file name.")
@click.option("--max-queued", type=click.IntRange(min=1),
              help="Feeder mode: keep pushing, but wait while the prompt list holds this many.")
@click.pass_obj
def push(obj: Context, file: Path, input_key, label_key, metadata_key, n_samples, epochs, shuffle, seed,
         skip_bad, dataset_name, max_queued) -> None:
    """Push prompt groups from a JSONL or Parquet FILE.

    The cursor lives in Redis: pushing the same dataset again resumes where the
    last push stopped and never pushes a (dataset, epoch, row) twice.

    \b
    Example:
      rollout push prompts.jsonl --n-samples 8 --epochs 2 --shuffle
    """
    from rich.progress import Progress

    from pipeline.producer import DatasetError, PushOptions, push_dataset, read_rows

    opts = PushOptions(input_key=input_key, label_key=label_key, metadata_key=metadata_key,
                       n_samples_per_prompt=n_samples, epochs=epochs, shuffle=shuffle, seed=seed,
                       skip_bad=skip_bad, dataset_name=dataset_name, max_queued=max_queued)
    queue = obj.queue()
    try:
        total = len(read_rows(file, opts)) * epochs
        with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
            task = progress.add_task(f"pushing {file.name}", total=total)
            report = push_dataset(queue, file, opts, progress=lambda n: progress.advance(task, n))
    except DatasetError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{report.dataset}: pushed {report.pushed} groups of {n_samples}, "
               f"{report.dead} bad rows dead-lettered, {report.already} already pushed before "
               f"({report.rows} rows x {epochs} epochs)")


# -- worker ----------------------------------------------------------------------------


@main.command()
@click.option("--engine-url", "engine_urls", multiple=True, required=True, envvar="ROLLOUT_ENGINE_URLS",
              help="SGLang engine or router URL; repeat for several (env ROLLOUT_ENGINE_URLS, space-separated).")
@click.option("--concurrency", default=512, show_default=True, type=click.IntRange(min=1),
              help="Samples in flight per engine (slime's sglang_server_concurrency).")
@click.option("--tokenizer", help="Hugging Face tokenizer path. Default: the byte-level tokenizer.")
@click.option("--apply-chat-template", is_flag=True, help="Template string prompts as a user message.")
@click.option("--reward", default="math_boxed", show_default=True,
              help="Built-in (exact_match, math_boxed, remote_rm) or dotted path to `async def rm(args, sample)`.")
@click.option("--group-reward", is_flag=True, help="The reward scores a whole group: rm(args, samples).")
@click.option("--reward-key", help="Key picked from dict rewards.")
@click.option("--rm-url", help="URL for the remote_rm reward.")
@click.option("--reward-queue", help="Score in rq workers listening on this queue (slow judges).")
@click.option("--max-new-tokens", default=1024, show_default=True, type=click.IntRange(min=1),
              help="rollout_max_response_len.")
@click.option("--temperature", default=1.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=-1, show_default=True)
@click.option("--stop", multiple=True, help="Stop string; repeat for several.")
@click.option("--stop-token-id", "stop_token_ids", multiple=True, type=int, help="Stop token id; repeat.")
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(min=1),
              help="Engine or reward failures per group before it is dead-lettered.")
@click.option("--lease", "lease_s", default=30.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds without a heartbeat before this worker's groups are given back.")
@click.option("--mask-offpolicy-prefix", is_flag=True,
              help="loss_mask 0 for tokens generated under an older weight version.")
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port.")
@click.pass_obj
def worker(obj: Context, engine_urls, concurrency, tokenizer, apply_chat_template, reward, group_reward,
           reward_key, rm_url, reward_queue, max_new_tokens, temperature, top_p, top_k, stop, stop_token_ids,
           max_attempts, lease_s, mask_offpolicy_prefix, metrics_port) -> None:
    """Run one generation worker until Ctrl-C / SIGTERM.

    It claims prompt groups, generates every sample through SGLang's /generate,
    scores them and publishes finished groups; on shutdown it hands back what it
    holds. Run as many as you like, on any host.

    \b
    Example:
      rollout worker --engine-url http://router:30000 --concurrency 256 --reward math_boxed
    """
    from workers.worker import SamplingSettings, WorkerSettings, run_worker

    urls = [u for url in engine_urls for u in url.split()]
    settings = WorkerSettings(
        redis_url=obj.url(), engine_urls=urls, namespace=obj.namespace, concurrency_per_engine=concurrency,
        tokenizer=tokenizer, apply_chat_template=apply_chat_template, reward=reward, group_reward=group_reward,
        reward_key=reward_key, rm_url=rm_url, reward_queue=reward_queue, max_attempts=max_attempts,
        lease_s=lease_s, mask_offpolicy_prefix=mask_offpolicy_prefix, metrics_port=metrics_port,
        sampling=SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, stop=list(stop), stop_token_ids=list(stop_token_ids)),
    )
    try:
        asyncio.run(run_worker(settings))
    except (ConnectionFailed, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


# -- simulator -------------------------------------------------------------------------


@main.command("sim-engine")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--max-running", default=256, show_default=True, help="Requests decoding at once; more wait.")
@click.option("--decode-rate", default=2000.0, show_default=True, help="Tokens per second per running request.")
@click.option("--median-tokens", default=64, show_default=True, help="Median output length.")
@click.option("--p99-tokens", default=640, show_default=True, help="p99 output length (long tail).")
@click.option("--skill", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="Chance an arithmetic question is answered right.")
@click.option("--error-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Fault injection: fraction of /generate answered 500/503.")
def sim_engine(host, port, seed, max_running, decode_rate, median_tokens, p99_tokens, skill, error_rate) -> None:
    """Run the SGLang-compatible simulator (no GPU needed).

    It answers SGLang's native HTTP API (/generate, /abort_request,
    /pause_generation, /update_weights_from_disk, ...) with long-tailed latencies
    and optional faults; more faults via POST /sim/faults.

    \b
    Example:
      rollout sim-engine --port 30000 --median-tokens 128 --p99-tokens 1280
    """
    from workers.simulator import SimConfig, serve

    config = SimConfig(seed=seed, max_running_requests=max_running, decode_tokens_per_s=decode_rate,
                       median_tokens=median_tokens, p99_tokens=p99_tokens, skill=skill, error_rate=error_rate)
    click.echo(f"SGLang simulator on http://{host}:{port}", err=True)
    try:
        asyncio.run(serve(config, host, port))
    except KeyboardInterrupt:
        pass


# -- demo ------------------------------------------------------------------------------


@main.command()
@click.option("--steps", default=5, show_default=True, type=click.IntRange(min=1), help="Training steps.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1), help="Groups per step.")
@click.option("--n-samples", default=4, show_default=True, type=click.IntRange(min=1), help="Samples per group.")
@click.option("--workers", "n_workers", default=2, show_default=True, type=click.IntRange(min=1),
              help="Generation worker processes.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary (with the audit) instead.")
def demo(steps, batch_size, n_samples, n_workers, as_json) -> None:
    """Run the whole pipeline locally and train on it for a few steps.

    Starts an embedded Redis and an SGLang simulator, pushes a bundled arithmetic
    dataset, runs worker processes and a minimal trainer loop that takes exact
    batches and commits them, then prints the audit and stops everything.

    \b
    Example:
      rollout demo --steps 10 --batch-size 16 --n-samples 8 --workers 4
    """
    from workers.demo import DemoOptions, run_demo

    summary = run_demo(DemoOptions(steps=steps, batch_size=batch_size, n_samples=n_samples, workers=n_workers),
                       echo=None if as_json else click.echo)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    if not summary["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
