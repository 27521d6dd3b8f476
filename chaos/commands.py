"""`rollout chaos`: the fault campaign (chaos/campaign.py) from the shell."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from pipeline.cli_support import FiniteFloat, dump, stop_on_sigterm
from pipeline.redis_server import Fsync, RedisServerError


@click.command()
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
    SIGSTOP of a worker past its lease; a second trainer (and one whose
    update loop outlives its fence); a primary that may evict keys; the
    server's clock stepping back and forward; dropped replies, resets and
    latency on the workers' links; engine 5xx, hangs and abort storms. Then
    drains and checks that every pushed group was trained exactly once or is a
    dead letter or a drop with its reason. Progress goes to stderr; exit code 1
    when the campaign is not ok. It starts its own Redis (--redis-url is not used).
    Needs sglang-router (the router extra: pip install -e '.[router]').

    \b
    Example:
      rollout chaos --minutes 1 --seed 7
    """
    from chaos.campaign import ChaosError, ChaosSettings, run_campaign
    from local.router import RouterError, require_router
    from pipeline.redis_sentinel import DeploymentError

    try:  # before anything starts (or a run directory is made)
        require_router()
    except RouterError as exc:
        raise click.ClickException(str(exc)) from None

    settings = ChaosSettings(minutes=minutes, seed=seed, fsync=Fsync(fsync), workers=workers, work_dir=work_dir,
                             keep=keep)
    # SIGTERM, like Ctrl-C, stops every process the campaign started before it exits.
    with stop_on_sigterm(lambda: "chaos campaign stopped before its end: nothing proven", exit_code=1):
        try:
            report = run_campaign(settings, say=lambda msg: click.echo(msg, err=True))
        except (ChaosError, RouterError, RedisServerError, DeploymentError) as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(dump(report.to_dict()) if as_json else report.render())
    if not report.ok:
        sys.exit(1)
