"""`rollout status`, `rollout inspect` and `rollout audit`: what an operator reads
(pipeline/ops/status.py, inspect.py, audit.py)."""
from __future__ import annotations

import sys
import time

import click

from pipeline.cli_support import Context, Seconds, dump, echo_wrapped, rich_console, stop_on_sigterm
from pipeline.queue import Queue
from pipeline.wording import counted


@click.command()
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
    backlog_age_s, requeue_age_s, checkpoints, alerts.
    With --worker: namespace, workers (worker, registered, alive, lease_left_s,
    groups: group_id, token, held_s, claims, attempts, restarts, n_samples).

    \b
    Example:
      rollout status
      rollout --namespace exp1 status --json | jq .results_ready
      rollout status --watch --interval 1
      rollout status --worker host-1234-ab12cd
    """
    from pipeline.namespaces import empty_message
    from pipeline.ops.status import RateTracker, snapshot
    from pipeline.ops.status_render import render

    queue = obj.queue(read_only=True)
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
            rich_console().print(render(snap))
        return
    with stop_on_sigterm():
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
        click.echo(dump({"namespace": obj.namespace, "workers": [asdict(w) for w in found]}))
        return
    for w in found:
        if not w.registered:
            state = "not registered (an in-flight hash left behind; a live worker's orphan reap gives it back)"
        elif w.alive:
            state = f"alive, lease {age(w.lease_left_s)} left"
        else:
            state = f"dead, lease ran out {age(-w.lease_left_s)} ago (its groups return at the next reap)"
        echo_wrapped(printable(f"worker {w.worker}: {state}; holds {counted(len(w.groups), 'group')}"), indent=2)
        for g in w.groups:
            held = "held " + (age(g.held_s) if g.held_s is not None else "?")
            tries = "" if g.attempts is None else \
                f", {counted(g.attempts, 'attempt')}, {counted(g.restarts, 'restart')}"
            # Two lines a group or more: ids and claim tokens are long, and a terminal is not.
            click.echo(printable(f"  {g.group_id}"))
            echo_wrapped(printable(f"      {held}, {counted(g.claims, 'claim')}{tries}, claim {g.token}"), indent=6)
    click.echo("`rollout inspect GROUP_ID` for a group's history")


@click.command("inspect")
@click.argument("group_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.pass_obj
def inspect_cmd(obj: Context, group_id, as_json) -> None:
    """Say where one group is, and what happened to it.

    Where: queued in the prompt list (at which position), in flight (which
    worker, alive or not, since when), requeued, in the results (delivered to
    which trainer session, how often), a dead letter (why), committed (when, in
    which batch), dropped (why), or nowhere. Read in one atomic step. Then its
    claim count and attempts, its label and each sample's status and reward (a
    dict reward in full) while the group is stored, its in-flight checkpoint
    while queued or in flight (per sample: tokens so far, weight versions, age),
    and its history: claims with their tokens, reaps, hand-backs, publishes,
    releases and the batch that trained it.

    \b
    JSON keys (stable; docs/cli.md): namespace, group_id, place (prompts,
    inflight, requeue, results, dead, committed, dropped, nowhere, several),
    where (place, age_s, position, worker, alive, token, entry_id, session,
    current_session, deliveries, error, reason, batch), claims, max_claims,
    admitted_version, attempts, restarts, n_samples, label, samples (index,
    status, response_length, reward, attributes), history (at_ms, age_s, event,
    who, detail), checkpoint (its in-flight checkpoint or null: writer, records,
    bytes, tokens, age_s, samples: position, tokens, weight_versions, status,
    age_s; error). Exit code 1 for an id the namespace knows nothing of.

    \b
    Example:
      rollout inspect prompts.jsonl:0:17
      rollout inspect prompts.jsonl:0:17 --json | jq .history
    """
    from pipeline.ops.inspect import GroupPlace, locate
    from pipeline.ops.printable import printable

    report = locate(obj.nonempty_queue(read_only=True), group_id)
    if as_json:
        click.echo(dump(report.to_dict()))
    else:
        for line in report.lines():  # errors and details come from data: printable
            # Continuation lines under the value: after the label, or after a history line's event.
            echo_wrapped(printable(line), indent=17 if line.startswith("    ") else 13)
    if report.place == GroupPlace.NOWHERE and not report.history:
        sys.exit(1)  # an id this namespace never saw: a typo, or another namespace


def _watch(queue: Queue, tracker, as_json: bool, interval: float) -> None:
    """Refresh until Ctrl-C; a Redis restart or failover is watched through: in the view
    itself (pipeline/ops/status_watch.py), or with --json said on stderr."""
    from pipeline.ops.status_watch import StatusWatch

    watch = StatusWatch(queue, tracker, interval)
    try:
        if as_json:
            _watch_json(watch)
        console = rich_console()
        if console.is_terminal:
            watch.run_live(console)
        else:
            watch.run_piped(console)
    except KeyboardInterrupt:
        pass


def _watch_json(watch) -> None:
    """One JSON object per good read on stdout; the outage and its end on stderr."""
    down = False
    while True:
        if watch.read():
            if down:
                click.echo(watch.outage.banner()[0], err=True)
            down = False
            click.echo(watch.last.to_json())
        elif not down:
            down = True
            click.echo(watch.outage.banner()[0], err=True)
        time.sleep(watch.interval)


@click.command("audit")
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
    unregistered_inflight (worker ids), checkpoints (groups with an in-flight
    checkpoint), checkpoint_bytes, orphan_checkpoints, evicted_keys, eviction_policy, ok.

    \b
    Example:
      rollout --namespace exp1 audit
      rollout audit --json | jq .lost
    """
    from pipeline.ops.audit import audit

    queue = obj.nonempty_queue(read_only=not reap_orphans)
    if reap_orphans:
        click.echo(f"gave back {queue.reap_orphans(scan=True)} groups of unregistered workers", err=True)
    with rich_console(stderr=True).status("auditing (reading every stream) ..."):
        report = audit(queue)
    if as_json:
        click.echo(dump(report.to_dict()))
    else:
        _print_audit(report)
    if not report.ok:
        sys.exit(1)


def _print_audit(report) -> None:
    from pipeline.tables import Col, FittedTable

    rows = [("prompts", report.prompts)]
    for worker, n in sorted(report.inflight.items()):
        rows.append((f"in flight: {worker}", n))
    rows += [("requeue", report.requeue), ("results undelivered", report.results_undelivered),
             ("results pending", report.results_pending), ("dead letters", report.dead),
             ("dropped", report.dropped), ("committed", report.committed), ("discarded", report.discarded),
             ("= accounted", report.accounted), ("pushed", report.pushed)]
    if report.checkpoints:
        rows.append(("in-flight checkpoints", report.checkpoints))
    console = rich_console()
    console.print(FittedTable([Col("place", flex=True, min_width=20), Col("groups", "right")],
                              [(name, f"{n:,}") for name, n in rows], show_header=False))
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
    if report.orphan_checkpoints:
        console.print(f"PROBLEM: {report.orphan_checkpoints} in-flight checkpoints (or their records) belong to "
                      "groups neither queued nor in flight", style="red")
