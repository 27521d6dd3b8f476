"""`rollout consume` (a stand-in trainer over pipeline/consumer.py) and `rollout eval
push / results` (evaluation passes, pipeline/trainers/eval.py)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from pipeline.cli_support import (METRICS_HOST_OPTION, Context, Seconds, check_port_free, dump, rich_console,
                                  stop_on_sigterm)
from pipeline.producer import MAX_SAMPLES_PER_PROMPT
from pipeline.queue import Queue
from pipeline.tables import Col, FittedTable, packed
from pipeline.wording import counted


@click.command()
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
@METRICS_HOST_OPTION
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
    from pipeline.keys import check_name
    from pipeline.retry import RedisUnavailable

    try:
        check_name("--consumer", consumer)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    queue = obj.queue()
    if metrics_port:
        check_port_free(metrics_host, metrics_port, "--metrics-port")
        prom.serve_metrics(metrics_port, metrics_host)
    console = rich_console()
    started = time.monotonic()
    done = 0
    # A batch taken but not committed when stopped is delivered again to this consumer name.
    with stop_on_sigterm(lambda: f"stopped after {done} of {steps} batches"), \
            Progress(transient=True, console=rich_console(stderr=True), disable=not sys.stderr.isatty()) as progress:
        _wait_for_the_first_push(queue, obj.namespace, timeout_s)  # before a Consumer creates any key
        reader = Consumer(queue.redis, obj.namespace, consumer=consumer)
        task = progress.add_task(f"batches of {batch_size}", total=steps)
        for step in range(steps):
            try:
                batch = reader.next_batch(batch_size, timeout=timeout_s)
                reader.commit(batch)
            except (BatchTimeout, RedisUnavailable, ValueError) as exc:
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
                click.echo(dump(row))
            else:
                _print_batch(console, row, steps)
    if not as_json:
        console.print(f"committed {counted(done, 'batch', 'batches')} ({counted(done * batch_size, 'group')}) in "
                      f"{time.monotonic() - started:.2f}s", markup=False)


def _wait_for_the_first_push(queue: Queue, namespace: str, timeout_s: float) -> None:
    """A trainer started beside its feeder (compose starts them together) waits for the
    first push up to its batch timeout, saying what it waits for (and the namespace it
    may have meant); a typo'd namespace is never created."""
    from pipeline.namespaces import empty_message, namespace_is_empty

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


#: `consume`'s table: the statuses stay whole ("2 truncated"); ids, rewards and versions share the rest.
BATCH_COLUMNS = [Col("group", flex=True, min_width=12), Col("statuses"), Col("rewards", flex=True, min_width=8),
                 Col("versions", flex=True, min_width=8), Col("lag", "right")]


def _print_batch(console, row: dict, steps: int) -> None:
    from collections import Counter

    lags = " ".join(f"{k}:{v}" for k, v in row["staleness"].items())
    reward = "-" if row["mean_reward"] is None else f"{row['mean_reward']:.3f}"
    head = [f"step {row['step'] + 1}/{steps}", f"{len(row['groups'])} groups", f"wait {row['wait_s']:.2f}s",
            f"version {row['weight_version']}", f"mean reward {reward}", f"lag:groups {lags}"]
    head += [f"{n} {what}" for what, n in (("restarted", row["restarted"]), ("dead-lettered", row["dead"]),
                                           ("duplicates discarded", row["duplicates_discarded"])) if n]
    head += [f"{n} dropped ({reason})" for reason, n in row["dropped"].items()]
    console.print("\n".join(packed(head, console.width, sep="  ")), markup=False)
    rows = []
    for g in row["groups"]:
        statuses = ", ".join(f"{n} {s}" for s, n in Counter(g["statuses"]).items())
        rewards = " ".join(f"{r:g}" if isinstance(r, (int, float)) else ("-" if r is None else "{..}")
                           for r in g["rewards"])
        rows.append((g["group_id"], statuses, rewards, ",".join(g["weight_versions"]) or "-", str(g["staleness"])))
    console.print(FittedTable(BATCH_COLUMNS, rows))


@click.group("eval")
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
        click.echo(dump({"namespace": eval_namespace(obj.namespace), "datasets": datasets}))
        return
    if not datasets:
        click.echo(f"no finished eval groups in {eval_namespace(obj.namespace)}")
    for name, d in datasets.items():
        mean = "n/a" if d["mean_reward"] is None else f"{d['mean_reward']:.4f}"
        click.echo(f"{name}: {d['groups']} prompts, {d['samples']} samples, mean reward {mean}, "
                   f"{d['truncated']} truncated")
