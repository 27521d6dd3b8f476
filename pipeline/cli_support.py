"""What every command module of the `rollout` command line shares: the command's
context (Redis URL and namespace), click types for finite numbers and durations, the
options several commands take, SIGTERM handling and output helpers. The commands
themselves live beside the code they drive (docs/architecture.md, the map)."""
from __future__ import annotations

import json
import math
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import click

from pipeline.connection import ConnectionFailed, connect, scrub
from pipeline.metrics import DEFAULT_HOST as DEFAULT_METRICS_HOST
from pipeline.queue import Queue
from pipeline.redis_server import local_redis_url

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

    def queue(self, wait_s: float = 0.0, read_only: bool = False) -> Queue:
        """`wait_s`: a long-running command waits that long for a Redis it cannot reach yet.
        `read_only`: a command that only reads (status, audit, dead list) works on a server
        no writer may use (a replica, one that may evict keys: pipeline/server_checks.py)."""
        try:
            return Queue(connect(self.url(), wait_s=wait_s, read_only=read_only), self.namespace)
        except ConnectionFailed as exc:
            raise click.ClickException(self.scrub(str(exc))) from None

    def scrub(self, text: str) -> str:
        """`text` with the Redis password (if any) masked: errors never show it."""
        return scrub(text, self.redis_url) if self.redis_url else text

    def control_queue(self, command: str, create: bool) -> Queue:
        """The queue for a command that writes control state (`command`, for the message).
        A namespace nobody has pushed to or registered in is refused unless `create`: a
        typo there would pause (or resume, or configure) nothing and leave the real
        pipeline running. With `create` it is written anyway (pause before the first push)."""
        from pipeline.namespaces import empty_message, namespace_is_empty

        queue = self.queue()
        if not create and namespace_is_empty(queue.redis, queue.keys):
            raise click.ClickException(f"{empty_message(queue.redis, self.namespace)}; nothing done: "
                                       f"`rollout --namespace {self.namespace} {command} --create` writes to it "
                                       f"anyway (e.g. to pause before the first push)")
        return queue

    def warn_if_empty(self, queue: Queue) -> None:
        """A command that only reads says when the namespace holds nothing (a typo?)."""
        from pipeline.namespaces import empty_message, namespace_is_empty

        if namespace_is_empty(queue.redis, queue.keys):
            click.echo(f"warning: {empty_message(queue.redis, self.namespace)}", err=True)

    def nonempty_queue(self, read_only: bool = False) -> Queue:
        """The queue, or a one-line error when the namespace holds nothing at all."""
        from pipeline.namespaces import empty_message, namespace_is_empty

        queue = self.queue(read_only=read_only)
        if namespace_is_empty(queue.redis, queue.keys):
            raise click.ClickException(empty_message(queue.redis, self.namespace))
        return queue


ENGINE_API_KEY_ENV = "ROLLOUT_ENGINE_API_KEY"
ENGINE_API_KEY_OPTION = click.option(
    "--api-key", envvar=ENGINE_API_KEY_ENV, show_envvar=True,
    help="The engines' SGLang --api-key, sent with every request to them (prefer the environment "
         "variable: a command line is visible to every local user).")

CREATE_OPTION = click.option(
    "--create", is_flag=True,
    help="Write to a namespace nobody has pushed to or registered in yet (e.g. pause before the first push); "
         "without it such a namespace is refused, as a misspelled one would be.")

REPLICAS_OPTION = click.option(
    "--replicas", type=click.IntRange(min=0), default=0, show_default=True,
    help="Redis behind Sentinel: return once this many replicas have the change (WAIT; waiting while none is "
         "in sync), so a failover cannot forget it (docs/operations.md, Durability).")

#: PyTorch's CPU build: pip's default torch is the CUDA build (GBs), useless without a GPU.
TORCH_CPU_BUILD = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_INSTALL_HINT = f"pip install -e '.[torch]' in your clone (without a GPU, first the CPU build: {TORCH_CPU_BUILD})"


METRICS_HOST_OPTION = click.option(
    "--metrics-host", default=DEFAULT_METRICS_HOST, show_default=True,
    help="Address --metrics-port listens on; 0.0.0.0 for every interface (a Prometheus on another host).")


def rich_console(stderr: bool = False):
    """A console for a command's output. Piped or redirected, its lines are not padded with
    the spaces rich fills a table's cells with (a log or a diff reads them as content); on a
    terminal they stay, since a live display overwrites the lines it drew before."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    out = stream if stream.isatty() else _TrimmedLines(stream)
    return Console(file=out, highlight=False, soft_wrap=False)


def text_width() -> int:
    """The width plain lines are wrapped at: the terminal's, else $COLUMNS, else 80 (as rich)."""
    return rich_console().width


def echo_wrapped(line: str, indent: int = 0, err: bool = False) -> None:
    """`line` wrapped between words at the terminal's width, continuation lines indented."""
    from pipeline.tables import wrapped

    click.echo(wrapped(line, text_width(), indent), err=err)


class _TrimmedLines:
    """A text stream that writes each line without its trailing spaces (a line not ended
    yet waits for its end, or for a flush: rich writes and flushes a whole print at once)."""

    def __init__(self, out):
        self.out, self.pending = out, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        if lines:
            self.out.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.out.write(self.pending)
            self.pending = ""
        self.out.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.out.fileno()


@contextmanager
def stop_on_sigterm(stopped: Callable[[], str] | None = None, exit_code: int = 0):
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


def dump(obj) -> str:
    return json.dumps(obj, default=str)


def check_port_free(host: str, port: int, option: str) -> None:
    """A one-line error now rather than a traceback when the server binds later."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise click.BadParameter(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                                     param_hint=option) from None


def given_engine_urls(engine_urls: tuple[str, ...]) -> list[str]:
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
