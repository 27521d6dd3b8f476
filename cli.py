"""The `rollout` command line: a thin layer over the pipeline and worker functions.

Global options come first: `rollout --redis-url URL --namespace NS COMMAND ...`
(or ROLLOUT_REDIS_URL / ROLLOUT_NAMESPACE). Without a URL, commands use the local
Redis that `rollout up` or `rollout demo` started.
"""
from __future__ import annotations

import logging
import shlex
import sys

import click
import redis

from chaos.commands import chaos
from engines.commands import sim_engine, torch_engine
from local.commands import demo, prepare_model, up
from local.processes import REDIS_URL_ENV
from pipeline.cli_support import Context
from pipeline.connection import ConnectionFailed
from pipeline.keys import check_namespace
from pipeline.ops.admin_commands import acl, configure, functions, purge
from pipeline.ops.dead_commands import dead
from pipeline.ops.push_command import push
from pipeline.ops.status_commands import audit_cmd, inspect_cmd, status
from pipeline.trainers.commands import consume, eval_group
from workers.commands import reward_worker, worker
from workers.engine_commands import pause, resume

DEFAULT_NAMESPACE = "rollout"

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
            command, secret = fixed
            note = (f" (with {REDIS_URL_ENV} set to your URL, as `export {REDIS_URL_ENV}=URL`: the URL you gave "
                    "holds a password, which is not repeated here, and the environment keeps it out of `ps`)"
                    if secret else "")
            raise click.UsageError(f"{exc.option_name} is a global option: it goes before the command, as in "
                                   f"`{ctx.info_name} {command}`{note}", ctx=exc.ctx) from None
        except ConnectionFailed as exc:
            raise click.ClickException(_scrub(ctx, str(exc))) from None
        except redis.AuthenticationError as exc:
            raise click.ClickException(_scrub(ctx, f"Redis refused the credentials: {exc}")) from None
        except redis.ConnectionError as exc:
            raise click.ClickException(_scrub(ctx, f"lost the connection to Redis: {exc}")) from None
        except redis.RedisError as exc:
            raise click.ClickException(_scrub(ctx, f"Redis error: {exc}")) from None


def _global_options_first(argv: list[str], exc: click.NoSuchOption) -> tuple[str, bool] | None:
    """The command line `argv` with the global options given after the command moved
    before it, if the unknown option is one of them, and whether a --redis-url holding a
    password was left out (a masked one would not work: the environment variable will)."""
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
    secret = False
    tokens = iter(argv[i:])
    for token in tokens:
        if token == "--":
            rest += [token, *tokens]
        elif name(token) in GLOBAL_OPTIONS and name(token) not in own:
            option = [token] + ([next(tokens, "")] if GLOBAL_OPTIONS[name(token)] and "=" not in token else [])
            if name(token) == "--redis-url" and redact(option[-1]) != option[-1]:
                secret = True  # left out: ROLLOUT_REDIS_URL gives it
            else:
                moved += option
        else:
            rest.append(token)
    words = [redact(w) if "://" in w else w for w in front + moved + rest]
    return shlex.join(words), secret


def _scrub(ctx: click.Context, text: str) -> str:
    obj = ctx.find_object(Context)
    return obj.scrub(text) if obj is not None else text


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


for command in (push, worker, reward_worker, sim_engine, torch_engine, prepare_model, demo, up, chaos, status,
                inspect_cmd, audit_cmd, pause, resume, configure, eval_group, dead, consume, acl, functions, purge):
    main.add_command(command)


if __name__ == "__main__":
    main(prog_name="rollout")
