"""Every `--json` output: exact keys and types, as docs/cli.md documents them, and each
command's --help naming its keys. A key renamed or dropped fails here first."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main as cli_main
from pipeline.consumer import Consumer
from pipeline.control import configure
from pipeline.queue import Place
from tests.groups import claim, finish, fresh, produce, publish, write_checkpoint

REPO = Path(__file__).resolve().parent.parent
NUM = (int, float)
NONE = type(None)


class ListOf:
    def __init__(self, item):
        self.item = item


class MapOf:
    """A JSON object with free keys (worker ids, group ids, reasons) and values of one type."""

    def __init__(self, value):
        self.value = value


THROUGHPUT = {"window_s": NUM, "committed": int, "committed_per_min": NUM, "published_per_min": (*NUM, NONE),
              "claimed_per_min": (*NUM, NONE), "sampled_s": NUM}
STALENESS = {"checked": int, "waiting": int, "by_lag": MapOf(int), "max": (int, NONE), "mean": (*NUM, NONE),
             "over_limit": int, "malformed": int}
WORKER_ROW = {"worker": str, "alive": bool, "last_heartbeat_s": NUM, "lease_left_s": NUM, "inflight_groups": int,
              "state": str, "engines": ListOf(str), "capacity": (int, NONE), "inflight_samples": (int, NONE),
              "host": (str, NONE), "pid": (int, NONE), "lease_s": (*NUM, NONE), "heartbeat_s": (*NUM, NONE),
              "counters": MapOf(int)}
DEPARTED = {"worker": str, "how": str, "groups": int, "age_s": NUM, "overdue_s": NUM}
CHECKPOINTS = {"groups": int, "bytes": int, "tokens": int, "oldest_write_age_s": (*NUM, NONE), "written": int,
               "refused": int, "claimed": int, "tokens_claimed": int, "tokens_resumed": int, "tokens_lost": int}
STATUS = {
    "namespace": str, "time": NUM, "empty": bool, "prompts": int, "inflight": int, "inflight_by_worker": MapOf(int),
    "unregistered_inflight": ListOf(str), "results_ready": int, "results_pending": int, "requeue": int, "dead": int,
    "workers_alive": int, "workers": ListOf(WORKER_ROW), "departed": ListOf(DEPARTED), "claimed_repeatedly": int,
    "most_claimed": MapOf(int), "weight_version": int, "paused": bool, "max_staleness": (int, NONE),
    "batch_size": (int, NONE), "max_ready": int, "lease_s": NUM, "max_claims": int, "admitted": int,
    "counters": MapOf(int), "throughput": THROUGHPUT, "staleness": STALENESS, "backlog_age_s": (*NUM, NONE),
    "requeue_age_s": (*NUM, NONE), "checkpoints": CHECKPOINTS, "alerts": ListOf(str),
}
HELD_GROUP = {"group_id": str, "token": str, "held_s": (*NUM, NONE), "claims": int, "attempts": (int, NONE),
              "restarts": (int, NONE), "n_samples": (int, NONE)}
STATUS_WORKER = {"namespace": str, "workers": ListOf({"worker": str, "registered": bool, "alive": bool,
                                                       "lease_left_s": (*NUM, NONE), "groups": ListOf(HELD_GROUP)})}
WHEREABOUTS = {"place": str, "age_s": (*NUM, NONE), "position": (int, NONE), "worker": (str, NONE),
               "alive": (bool, NONE), "token": (str, NONE), "entry_id": (str, NONE), "session": (str, NONE),
               "current_session": (bool, NONE), "deliveries": (int, NONE), "error": (str, NONE),
               "reason": (str, NONE), "batch": (str, NONE)}
JSON_VALUE = (int, float, str, bool, dict, list, NONE)  # a label, a reward: any JSON value
EVENT = {"at_ms": int, "age_s": NUM, "event": str, "who": str, "detail": str}
SAMPLE_CHECKPOINT = {"position": int, "tokens": int, "weight_versions": ListOf(str), "status": str, "age_s": NUM}
CHECKPOINT = {"writer": str, "records": int, "bytes": int, "tokens": int, "age_s": NUM,
              "samples": ListOf(SAMPLE_CHECKPOINT), "error": (str, NONE)}
INSPECT = {"namespace": str, "group_id": str, "place": str, "where": ListOf(WHEREABOUTS), "claims": int,
           "max_claims": int, "admitted_version": (int, NONE), "attempts": (int, NONE), "restarts": (int, NONE),
           "n_samples": (int, NONE), "label": JSON_VALUE,
           "samples": ListOf({"index": (int, NONE), "status": str, "response_length": int, "reward": JSON_VALUE,
                              "attributes": ListOf(str)}),
           "history": ListOf(EVENT), "checkpoint": (CHECKPOINT, NONE)}
PUSH = {"namespace": str, "file": str, "dataset": str, "rows": int, "epochs": int, "n_samples": int, "pushed": int,
        "dead": int, "already": int, "without_label": int}
AUDIT = {"pushed": int, "prompts": int, "inflight": int, "inflight_by_worker": MapOf(int), "requeue": int,
         "results_undelivered": int, "results_pending": int, "dead": int, "dropped": int, "committed": int,
         "discarded": int, "duplicates_discarded": int, "accounted": int, "lost": int, "extra": int,
         "in_two_places": ListOf(str), "committed_and_live": ListOf(str), "orphan_payloads": int,
         "missing_payloads": int, "unregistered_inflight": ListOf(str), "checkpoints": int, "checkpoint_bytes": int,
         "orphan_checkpoints": int, "evicted_keys": int, "eviction_policy": str, "ok": bool}
CONFIGURE = {"paused": bool, "weight_version": int, "max_staleness": (int, NONE), "batch_size": (int, NONE),
             "max_ready": int, "lease_s": NUM, "max_claims": int, "release_policy": str, "version_clock": str,
             "admitted": int, "committed": int, "budget_base": int, "staleness_limit": (int, NONE),
             "draining": ListOf(str)}
DEAD_LETTER = {"entry_id": str, "group_id": str, "error": str, "reason": (str, NONE), "age_s": NUM,
               "retriable": bool, "not_retriable_because": (str, NONE), "bad_row": bool,
               "decode_error": (str, NONE), "payload_bytes": int, "dataset": (str, NONE), "epoch": (int, NONE),
               "row": (int, NONE), "attempts": (int, NONE), "restarts": (int, NONE), "worker": (str, NONE),
               "n_samples": (int, NONE), "statuses": (ListOf(str), NONE)}
DEAD_LIST = {"namespace": str, "total": int, "dead_letters": ListOf(DEAD_LETTER)}
DEAD_SHOW = DEAD_LETTER | {
    "payload_head": (str, NONE), "prompt": (str, list, NONE), "label": (str, NONE), "admitted_version": (int, NONE),
    "created_at": (*NUM, NONE), "claimed_at": (*NUM, NONE), "finished_at": (*NUM, NONE), "raw_row": (str, NONE),
    "samples": (ListOf({"index": (int, NONE), "status": str, "response_length": int, "reward": (*NUM, dict, NONE),
                        "weight_versions": ListOf(str), "response": str}), NONE),
    "history": ListOf(EVENT)}
CONSUME = {"step": int, "groups": ListOf({"group_id": str, "statuses": ListOf(str), "rewards": list,
                                          "weight_versions": ListOf(str), "staleness": int}),
           "group_ids": ListOf(str), "weight_version": int, "wait_s": NUM, "mean_reward": (*NUM, NONE),
           "staleness": MapOf(int), "dropped": MapOf(int), "restarted": int, "dead": int,
           "duplicates_discarded": int}
DEAD_SUMMARY = {"total": int, "by_reason": MapOf(int), "example": MapOf(str)}
DEMO_SIM = {"ok": bool, "error": (str, NONE), "groups_trained": int, "trained_twice": int,
            "mean_reward": (*NUM, NONE), "audit": (AUDIT, NONE), "dead_letters": DEAD_SUMMARY,
            "steps": ListOf({"step": int, "wait_s": NUM, "groups": int, "samples": int, "mean_reward": (*NUM, NONE),
                             "truncated": int, "mean_turns": (*NUM, NONE), "tool_tokens": (int, NONE),
                             "max_staleness": int, "group_ids": ListOf(str),
                             "update_s": (*NUM, NONE), "requeued": (int, NONE)})}
DEMO_TORCH_KEYS = {"ok", "error", "steps", "reward_first", "reward_last", "reward_window", "logprob_max_abs_diff",
                   "logprob_mean_abs_diff", "weight_versions_seen", "engine_versions_ok", "samples_continued",
                   "audit_ok", "audit", "dead_letters", "seconds", "curve"}

CHAOS = {"pushed": int, "trained_once": int, "trained_twice": int, "lost": int, "dead": int, "dropped": int,
         "faults": MapOf(int), "ok": bool, "seed": int, "minutes": NUM, "batches": int,
         "dead_reasons": MapOf(int), "dropped_reasons": MapOf(int),
         "by_kind": MapOf({"injected": int, "affected": int, "unit": str, "recovery_p50_s": (*NUM, NONE),
                           "recovery_max_s": (*NUM, NONE)}),
         "audit_ok": bool, "checks": ListOf(str), "problems": ListOf(str)}

#: command (as in docs/cli.md and --help) -> its schema
SCHEMAS = {("push",): PUSH, ("status",): STATUS, ("inspect",): INSPECT, ("audit",): AUDIT, ("configure",): CONFIGURE,
           ("dead", "list"): DEAD_LIST, ("dead", "show"): DEAD_SHOW, ("consume",): CONSUME, ("demo",): DEMO_SIM,
           ("chaos",): CHAOS}  # chaos's output is checked by tests/test_chaos.py's campaign


def check(value, schema, where: str = "$") -> None:
    """Assert `value` has exactly the keys of `schema` with the types given."""
    if isinstance(schema, tuple):
        for option in schema:
            try:
                check(value, option, where)
                return
            except AssertionError:
                continue
        raise AssertionError(f"{where}: {value!r:.200} is none of {schema}")
    if isinstance(schema, dict):
        assert isinstance(value, dict), f"{where}: {value!r:.100} is not an object"
        assert set(value) == set(schema), (f"{where}: keys differ: extra {set(value) - set(schema)}, "
                                           f"missing {set(schema) - set(value)}")
        for key, sub in schema.items():
            check(value[key], sub, f"{where}.{key}")
    elif isinstance(schema, ListOf):
        assert isinstance(value, list), f"{where}: {value!r:.100} is not a list"
        for i, item in enumerate(value):
            check(item, schema.item, f"{where}[{i}]")
    elif isinstance(schema, MapOf):
        assert isinstance(value, dict), f"{where}: {value!r:.100} is not an object"
        for key, item in value.items():
            check(item, schema.value, f"{where}.{key}")
    else:
        if schema in (int, float) and isinstance(value, bool):
            raise AssertionError(f"{where}: {value!r} is a bool, not {schema.__name__}")
        assert isinstance(value, schema), f"{where}: {value!r:.100} is not {schema}"


def keys_of(schema, top: bool = True) -> set[str]:
    """Every key a schema names, nested ones included, except inside another command's
    object (demo's audit: documented with `rollout audit`)."""
    if isinstance(schema, tuple):
        return set().union(*(keys_of(s, top) for s in schema))
    if isinstance(schema, ListOf):
        return keys_of(schema.item, top)
    if isinstance(schema, dict):
        if not top and any(schema is other for other in SCHEMAS.values()):
            return set()
        return set(schema).union(*(keys_of(s, False) for s in schema.values()))
    return set()


@pytest.fixture
def rollout(run):
    """The command's stdout as JSON (every --json command prints objects, one per line)."""

    def call(*args: str, code: int = 0):
        result = run(*args)
        assert result.exit_code == code, result.output
        return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]

    return call


def test_push_json(rollout, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"input": "1 + 1?", "label": "2"}\n{"input": "2 + 2?"}\n{"no": "input"}\n')
    [d] = rollout("push", str(data), "--skip-bad", "--n-samples", "2", "--json")
    check(d, PUSH)
    assert (d["rows"], d["pushed"], d["dead"], d["without_label"], d["n_samples"]) == (3, 2, 1, 1, 2)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    [d] = rollout("push", str(empty), "--json")
    check(d, PUSH)


def test_status_json_busy_and_empty(rollout, queue):
    [d] = rollout("status", "--json", "--sample", "0")
    check(d, STATUS)
    assert d["empty"] is True
    configure(queue.redis, queue.keys, lease_s=10)
    produce(queue, 2, worker="w1")
    queue.push_groups(fresh(3, prefix="q"))
    claim(queue, "w2", 2)
    queue.redis.zadd(queue.keys.workers, {"w2": 0}, xx=True)
    queue.reap_expired()  # a departed record
    claim(queue, "w3", 1)
    queue.leave("w3")
    [held] = claim(queue, "w4", 1).groups
    write_checkpoint(queue, "w4", held, tokens=5)
    queue.redis.hset(queue.keys.inflight("ghost"), "ghost-group", "tok")  # an unregistered worker's hash
    [d] = rollout("status", "--json", "--sample", "0.2")
    check(d, STATUS)
    assert (d["checkpoints"]["groups"], d["checkpoints"]["tokens"], d["checkpoints"]["written"]) == (1, 10, 1)
    assert d["workers"] and d["departed"] and d["unregistered_inflight"] == ["ghost"] and d["claimed_repeatedly"]


def test_status_worker_json(rollout, queue):
    queue.push_groups(fresh(3))
    claim(queue, "host-1-ab#1", 2)
    claim(queue, "host-1-ab#2", 1)
    [d] = rollout("status", "--worker", "host-1-ab", "--json")
    check(d, STATUS_WORKER)
    assert [w["worker"] for w in d["workers"]] == ["host-1-ab#1", "host-1-ab#2"]


def test_inspect_json_in_every_place(rollout, queue, client):
    queue.push_groups(fresh(6))
    held = claim(queue, "w", 5).groups
    publish(queue, "w", held[0], group=finish(held[0].group))
    publish(queue, "w", held[1], Place.REQUEUE)
    publish(queue, "w", held[2], Place.DEAD, error="engine failed 3 times; last error: 503")
    publish(queue, "w", held[3], group=finish(held[3].group))
    consumer = Consumer(client, queue.keys.namespace)
    consumer.commit(consumer.next_batch(1, timeout=5))
    write_checkpoint(queue, "w", held[4], tokens=3)  # in flight, with what its holder saved of it
    places, checkpoints = set(), 0
    for gid in ("g0", "g1", "g2", "g3", "g4", "g5", "never"):
        [d] = rollout("inspect", gid, "--json", code=1 if gid == "never" else 0)  # an unknown id is an error
        check(d, INSPECT)
        places.add(d["place"])
        checkpoints += d["checkpoint"] is not None
    assert places == {"committed", "results", "requeue", "dead", "inflight", "prompts", "nowhere"}
    assert checkpoints == 1


def test_audit_configure_dead_and_consume_json(rollout, queue, tmp_path):
    produce(queue, 2)
    queue.push_groups(fresh(2, prefix="d"))
    for c in claim(queue, "w", 2).groups:
        publish(queue, "w", c, Place.DEAD, error="reward failed 3 times")
    queue.redis.xadd(queue.keys.dead, {"gid": "junk", "data": b"\x00not msgpack", "error": "bad"})
    [d] = rollout("audit", "--json", code=1)  # the hand-written junk entry was never pushed
    check(d, AUDIT)
    [d] = rollout("configure", "--json")
    check(d, CONFIGURE)
    [d] = rollout("dead", "list", "--json")
    check(d, DEAD_LIST)
    assert d["total"] == 3 and d["dead_letters"][2]["decode_error"]  # an undecodable one has the same keys
    for ident in ("d0", "junk"):
        [d] = rollout("dead", "show", ident, "--json")
        check(d, DEAD_SHOW)
    rows = rollout("consume", "--batch-size", "1", "--steps", "2", "--json")
    assert len(rows) == 2
    for row in rows:
        check(row, CONSUME)


def _help(*command: str) -> str:
    result = CliRunner().invoke(cli_main, [*command, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", list(SCHEMAS), ids=" ".join)
def test_help_and_docs_name_every_key(command):
    doc = (REPO / "docs" / "cli.md").read_text()
    section = doc.split(f"### `rollout {' '.join(command)}", 1)[1].split("\n### ", 1)[0]
    helped = _help(*command)
    # `dead show` names its own keys and refers to `dead list` for the rest.
    by_reference = set(DEAD_LETTER) if command == ("dead", "show") else set()
    for key in keys_of(SCHEMAS[command]) - by_reference:
        assert re.search(rf"\b{key}\b", section), f"docs/cli.md, rollout {' '.join(command)}: {key} not listed"
    for key in set(SCHEMAS[command]) - by_reference:  # --help names the top-level keys
        assert re.search(rf"\b{key}\b", helped), f"rollout {' '.join(command)} --help: {key} not listed"
    if command == ("demo",):
        for key in DEMO_TORCH_KEYS:
            assert key in section and key in helped, key


def test_status_worker_keys_are_in_the_help_and_docs():
    doc = (REPO / "docs" / "cli.md").read_text()
    section = doc.split("### `rollout status --worker W --json`", 1)[1].split("\n### ", 1)[0]
    helped = _help("status")
    for key in keys_of(STATUS_WORKER):
        assert re.search(rf"\b{key}\b", section), key
    for key in keys_of(STATUS_WORKER["workers"].item):
        assert re.search(rf"\b{key}\b", helped), key
