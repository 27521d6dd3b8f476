"""`rollout pause` and `rollout resume`: the weight-update protocol from the shell
(pipeline/controller.py over the engines' SGLang control calls, workers/engine.py)."""
from __future__ import annotations

import asyncio
import json

import click

from pipeline.cli_support import (CREATE_OPTION, ENGINE_API_KEY_OPTION, ENGINE_URLS_ENV, REPLICAS_OPTION, Context,
                                  Seconds, given_engine_urls)
from pipeline.queue import Queue
from pipeline.types import PauseMode, ReleasePolicy, choices
from pipeline.wording import counted


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
    from workers.engine_errors import EngineError

    return (EngineError,)


_ENGINE_URL_OPTION = click.option(
    "--engine-url", "engine_urls", multiple=True, envvar=ENGINE_URLS_ENV,
    help="Engine or router URL to control; repeat for several (env ROLLOUT_ENGINE_URLS). "
         "Default: the engines the live workers report in their heartbeats.")


@click.command()
@click.option("--mode", type=click.Choice(choices(PauseMode)), default=PauseMode.ABORT.value, show_default=True,
              help="abort: end in-flight requests (partial output is requeued); retract / in_place: "
                   "keep them inside the engines.")
@_ENGINE_URL_OPTION
@ENGINE_API_KEY_OPTION
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, type=Seconds(min=0),
              help="abort: seconds to wait for the workers to requeue every interrupted group.")
@REPLICAS_OPTION
@CREATE_OPTION
@click.pass_obj
def pause(obj: Context, mode, engine_urls, api_key, timeout_s, replicas, create) -> None:
    """Stop admission and pause the engines (before a weight update).

    Workers stop claiming at once. Every engine (each one behind a router) gets
    /pause_generation; with --mode abort, interrupted groups go to the requeue
    stream with their partial output and continue after `rollout resume`.

    \b
    Example:
      rollout pause --mode abort
      rollout pause --mode in_place --engine-url http://router:30000
      rollout --namespace exp2 pause --create    # before the first push to exp2
    """
    from pipeline.controller import Controller
    from workers.engine_set import EngineSet

    given = given_engine_urls(engine_urls)
    queue = obj.control_queue("pause", create)
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


@click.command()
@click.option("--weight-version", type=click.IntRange(min=0),
              help="The trainer's new weight version. Default: unchanged. It only moves forward, unless --rollback.")
@click.option("--rollback", is_flag=True,
              help="Allow --weight-version behind the recorded one (a trainer resumed from an earlier checkpoint).")
@click.option("--release-policy", type=click.Choice(choices(ReleasePolicy)), default=ReleasePolicy.CONTINUE.value,
              show_default=True, help="Aborted groups: continue their partial output, restart them, or drop them.")
@_ENGINE_URL_OPTION
@ENGINE_API_KEY_OPTION
@REPLICAS_OPTION
@CREATE_OPTION
@click.pass_obj
def resume(obj: Context, weight_version, rollback, release_policy, engine_urls, api_key, replicas, create) -> None:
    """Record the new weight version, continue the engines, reopen admission.

    Aborted groups in the requeue stream go back to the head of the prompt list
    first (continuing from their partial output by default). An operator's
    pause and resume act whatever trainer session runs (they are not fenced)
    and are recorded (`unfenced_write` in the trainer hash); a weight version
    behind the recorded one needs --rollback.

    \b
    Example:
      rollout resume --weight-version 12
      rollout resume --weight-version 12 --engine-url http://router:30000
      rollout resume --weight-version 8 --rollback
    """
    from pipeline.controller import Controller
    from workers.engine_set import EngineSet

    given = given_engine_urls(engine_urls)
    queue = obj.control_queue("resume", create)
    urls, source = _engines_for_control(queue, given)

    async def go():
        engines = EngineSet(urls, api_key=api_key) if urls else None
        try:
            controller = Controller(queue, engines, release_policy=release_policy, replicas=replicas)
            report = await controller.resume(weight_version, rollback=rollback)
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
