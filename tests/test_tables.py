"""Every table an operator reads, at 80 and 120 columns and piped: nothing wider than the
terminal, no line padded with trailing spaces, no column dropped, and nothing cut in the
middle of a word that matters (a flag, a count, a state)."""
from __future__ import annotations

import io
import json

import pytest

from pipeline.consumer import Consumer
from pipeline.control import configure
from pipeline.ops.status import RateTracker, snapshot
from pipeline.queue import Place, Queue
from pipeline.types import Group, Status
from tests.groups import claim, finish, publish

#: Long names, as a real fleet has them.
WORKERS = {
    "gpu-node-017.cluster.example.internal-48213-a1b2c3": "full: 253 of 256 sample slots",
    "gpu-node-018.cluster.example.internal-48214-d4e5f6":
        "engine-down: connection refused to http://engine-with-a-long-name.cluster.local:30000",
    "gpu-node-019-99-ab12cd": "waiting on engine: 12 requests out, no answer for 31s",
}
ENGINE = "http://engine-with-a-long-name.cluster.local:30000"
MISSING_LABEL = ("the reward math_boxed needs a label and sample 0 has none; not retried: give the rows a label "
                 "(push --label-key), or use a reward that needs none; rows pushed with --input-key question")
WIDTHS = [80, 120, None]  # None: piped, at the width rich picks for a pipe


@pytest.fixture
def busy(queue: Queue, tmp_path) -> Queue:
    """A namespace with everything a table shows: long worker names and states, dead
    letters of each kind, results delivered and waiting, big counters."""
    configure(queue.redis, queue.keys, max_ready=4096)
    queue.push_groups([Group.fresh(f"data/prompts-2024.jsonl:0:{i}", f"What is {i} + 1?", 4, label=str(i + 1))
                       for i in range(12)])
    for name, state in WORKERS.items():
        queue.register(name, json.dumps({"engines": [ENGINE], "state": state, "capacity": 256,
                                         "inflight_samples": 253, "counters": {"groups_completed": 123456}}))
    first = list(WORKERS)[0]
    held = [c.group for c in claim(queue, first, 8).groups]
    for g in held[:4]:
        publish(queue, first, finish(g), Place.RESULTS)
    publish(queue, first, finish(held[4]), Place.DEAD,
            error="engine failed 3 times; last error: 503 Service Unavailable from " + ENGINE)
    publish(queue, first, finish(held[5]), Place.DEAD, error=MISSING_LABEL)
    queue.redis.xadd(queue.keys.dead, {"gid": "junk:0:0", "data": b"\x00not msgpack", "error": "bad"})
    configure(queue.redis, queue.keys, max_staleness=2, batch_size=2)
    queue.redis.hset(queue.keys.stats, mapping={"pushed": 1234567, "committed": 1234000, "handed_back": 0})
    Consumer(queue.redis, queue.keys.namespace).next_batch(2, timeout=5)  # two pending
    return queue


def rendered(run, monkeypatch, width: int | None, *args: str) -> str:
    if width is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(width))
    result = run(*args)
    assert result.exit_code in (0, 1), result.output
    return result.stdout


def check_lines(text: str, width: int | None, padded_ok: bool = False) -> list[str]:
    lines = text.splitlines()
    assert lines
    padded = [l for l in lines if l != l.rstrip()]
    assert padded_ok or not padded, f"lines padded with trailing spaces: {padded}"
    if width is not None:
        wide = [l for l in lines if len(l) > width]
        assert not wide, f"lines wider than {width}: {wide}"
    return lines


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("width", WIDTHS)
def test_status(run, busy, monkeypatch, width):
    text = rendered(run, monkeypatch, width, "status", "--sample", "0")
    check_lines(text, width)
    for whole in ("handed back 0", "pushed 1,234,567", "committed 1,234,000", "ready 2 (max 4,096)",
                  "pending 2"):
        assert whole in text, (whole, text)
    header = next(l for l in text.splitlines() if l.split()[:1] == ["worker"])
    assert header.split() == ["worker", "state", "engines", "groups", "samples", "done", "beat"]
    for state in ("full", "engine-down", "waiting on engine"):
        assert state in text
    # A state's details, whole, under the table (full's are the samples column).
    assert "engine-down: connection refused to" in words(text)
    assert "253/256" in text and "123456" in text


@pytest.mark.parametrize("width", WIDTHS)
def test_status_of_a_worker(run, busy, monkeypatch, width):
    text = rendered(run, monkeypatch, width, "status", "--worker", list(WORKERS)[0])
    check_lines(text, width if width is None else 120)  # ids and claim tokens are long: two lines a group
    assert "holds 2 groups" in text


@pytest.mark.parametrize("width", WIDTHS)
def test_dead_list(run, busy, monkeypatch, width):
    text = rendered(run, monkeypatch, width, "dead", "list")
    lines = check_lines(text, width)
    assert lines[0].split() == ["id", "group", "age", "try", "reason", "error"]
    assert "--input-key question" in text  # the end of the error, its flag whole
    assert not [l for l in lines if l.endswith("-")], text  # nothing split at a hyphen
    assert "[cannot retry]" in text and "engine failed 3 times" in text
    assert "3 dead letters (other 2, malformed 1)" in text


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("args, wholes", [
    (("audit",), ["results pending", "in flight: " + list(WORKERS)[0], "1,234,567"]),
    (("inspect", "data/prompts-2024.jsonl:0:0"), ["delivered 1 time,", "(the current session)"]),
    (("configure",), ["η=2, B=2", "30s"]),
], ids=["audit", "inspect", "configure"])
def test_listings(run, busy, monkeypatch, width, args, wholes):
    text = rendered(run, monkeypatch, width, *args)
    check_lines(text, width)
    for whole in wholes:  # lines break between words only
        assert whole in words(text), (whole, text)


@pytest.mark.parametrize("width", WIDTHS)
def test_consume(run, busy, monkeypatch, width):
    configure(busy.redis, busy.keys, max_staleness=-1, batch_size=-1)  # no pacing: claim the rest
    for c in claim(busy, "w2", 4).groups:
        g = finish(c.group, status=Status.TRUNCATED)
        g.samples[0].status = Status.COMPLETED
        publish(busy, "w2", c, Place.RESULTS, group=g)
    text = rendered(run, monkeypatch, width, "consume", "--batch-size", "4", "--steps", "2", "--consumer", "c2",
                    "--timeout", "5")
    lines = check_lines(text, width)
    header = next(l for l in lines if l.split()[:1] == ["group"])
    assert header.split() == ["group", "statuses", "rewards", "versions", "lag"]
    assert "1 completed, 3 truncated" in text  # never cut


@pytest.mark.parametrize("width", [80, 120])
def test_up_dashboard(busy, width):
    """`rollout up`'s frame: its header and the status view (local/stack.py)."""
    from rich.console import Console

    from pipeline.ops.status_render import render

    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=True).print(
        render(snapshot(busy, RateTracker()), title=f"rollout up | {busy.keys.namespace}"))
    text = out.getvalue()
    check_lines(text, width, padded_ok=True)  # a terminal: a live display overwrites its own lines
    assert "253/256" in text and "full" in text and "full: 253 of 25…" not in text
