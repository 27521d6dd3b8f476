"""The producer: JSONL and Parquet datasets, keys, samples per prompt, epochs, seeded
shuffle, a resumable cursor in Redis, and bad input reported or dead-lettered."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from pipeline.ops.audit import audit
from pipeline.codec import decode_group
from pipeline.connection import connect
from pipeline.producer import DatasetError, PushOptions, epoch_order, push_dataset
from pipeline.queue import Queue
from tests.conftest import CORE_REDIS_BINARIES
from tests.groups import claim, publish

REDIS7 = next((path for v, path in sorted(CORE_REDIS_BINARIES.items(), reverse=True)
               if int(v.split(".")[0]) >= 7), None)

ROWS = [
    {"input": "What is 1+1?", "label": "2", "metadata": {"source": "arith", "id": 0}},
    {"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
     "label": 4, "metadata": {"source": "chat"}},
    {"input": "Name a prime.", "label": None},
    {"input": "Spell cat.", "label": "c-a-t", "metadata": None, "extra": [1, 2]},
    {"input": "Last one", "label": 3.5, "metadata": {"nested": {"a": [1, {"b": None}]}}},
]


def write_jsonl(path: Path, rows: list, raw_lines: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    for at, text in (raw_lines or {}).items():
        lines.insert(at, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def queued(q: Queue) -> list[str]:
    return [g.decode() for g in q.redis.lrange(q.keys.prompts, 0, -1)]


def payload(q: Queue, gid: str):
    return decode_group(q.redis.hget(q.keys.payloads, gid))


def assert_audit_ok(q: Queue):
    report = audit(q)
    assert report.ok, report.summary()
    return report


def nothing_pushed(q: Queue) -> None:
    k = q.keys
    assert q.redis.llen(k.prompts) == 0
    assert q.redis.hlen(k.payloads) == 0
    assert q.redis.xlen(k.dead) == 0
    assert q.redis.hlen(k.dataset) == 0
    assert q.stats() == {}


def test_jsonl_rows_become_groups(queue, tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", ROWS)
    report = push_dataset(queue, path)
    assert (report.dataset, report.rows, report.pushed, report.dead, report.already) == ("math.jsonl", 5, 5, 0, 0)
    assert queued(queue) == [f"math.jsonl:0:{i}" for i in range(5)]
    g0 = payload(queue, "math.jsonl:0:0")
    assert (g0.dataset, g0.epoch, g0.row, g0.n_samples) == ("math.jsonl", 0, 0, 1)
    s = g0.samples[0]
    assert (s.prompt, s.label, s.metadata) == ("What is 1+1?", "2", {"source": "arith", "id": 0})
    chat = payload(queue, "math.jsonl:0:1").samples[0]
    assert chat.prompt == ROWS[1]["input"] and chat.label == 4  # as it is, as slime's Dataset keeps it
    assert payload(queue, "math.jsonl:0:2").samples[0].label is None
    assert payload(queue, "math.jsonl:0:3").samples[0].metadata == {}
    assert payload(queue, "math.jsonl:0:4").samples[0].label == 3.5
    assert payload(queue, "math.jsonl:0:4").samples[0].metadata == {"nested": {"a": [1, {"b": None}]}}
    assert queue.redis.hget(queue.keys.dataset, "math.jsonl:0") == b"5"
    assert assert_audit_ok(queue).pushed == 5


def test_blank_lines_are_skipped_and_rows_numbered_by_position(queue, tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('\n{"input": "a"}\n\n   \n{"input": "b"}\n')
    push_dataset(queue, path)
    assert queued(queue) == ["gaps.jsonl:0:0", "gaps.jsonl:0:1"]
    assert payload(queue, "gaps.jsonl:0:1").samples[0].prompt == "b"


def test_parquet(queue, tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({
        "question": ["a?", "b?", "c?"],
        "answer": ["1", "2", None],
        "info": [{"k": 1}, {"k": 2}, {"k": 3}],
    }), path)
    opts = PushOptions(input_key="question", label_key="answer", metadata_key="info", n_samples_per_prompt=3)
    report = push_dataset(queue, path, opts)
    assert (report.rows, report.pushed) == (3, 3)
    g = payload(queue, "data.parquet:0:1")
    assert g.n_samples == 3
    assert [(s.prompt, s.label, s.metadata) for s in g.samples] == [("b?", "2", {"k": 2})] * 3
    assert payload(queue, "data.parquet:0:2").samples[0].label is None
    assert_audit_ok(queue)


def test_parquet_bad_row(queue, tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"input": ["ok", ""]}), path)
    with pytest.raises(DatasetError, match=re.escape(f"{path}:row 2: 'input' must be a non-empty string")):
        push_dataset(queue, path)
    nothing_pushed(queue)


def test_broken_parquet_file(queue, tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        push_dataset(queue, path)


def test_custom_keys_and_samples_per_prompt(queue, tmp_path):
    rows = [{"q": "x?", "a": "y", "meta": {"d": 1}, "input": "ignored"}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    push_dataset(queue, path, PushOptions(input_key="q", label_key="a", metadata_key="meta",
                                          n_samples_per_prompt=4, dataset_name="custom"))
    g = payload(queue, "custom:0:0")
    assert g.n_samples == 4 and g.dataset == "custom"
    assert [s.index for s in g.samples] == [0, 1, 2, 3] and {s.group_index for s in g.samples} == {0}
    assert all((s.prompt, s.label, s.metadata) == ("x?", "y", {"d": 1}) for s in g.samples)


def test_label_and_metadata_keys_can_be_off(queue, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "x", "label": [1], "metadata": "not a dict"}])
    push_dataset(queue, path, PushOptions(label_key=None, metadata_key=None))
    s = payload(queue, "d.jsonl:0:0").samples[0]
    assert (s.label, s.metadata) == (None, {})


def test_epochs(queue, tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", ROWS[:3])
    report = push_dataset(queue, path, PushOptions(epochs=3))
    assert report.pushed == 9
    assert queued(queue) == [f"e.jsonl:{e}:{r}" for e in range(3) for r in range(3)]
    assert payload(queue, "e.jsonl:2:1").epoch == 2
    cursors = {k.decode(): v for k, v in queue.redis.hgetall(queue.keys.dataset).items()}
    assert json.loads(cursors.pop("e.jsonl:fingerprint"))["rows"] == 3
    assert {k: int(v) for k, v in cursors.items()} == {"e.jsonl:0": 3, "e.jsonl:1": 3, "e.jsonl:2": 3}


def test_shuffle_with_seed_is_deterministic(client, tmp_path):
    rows = [{"input": f"q{i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    orders = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        q = Queue(client, f"shuffle-{name}-{tmp_path.name}")
        push_dataset(q, path, PushOptions(shuffle=True, seed=seed, epochs=2))
        orders[name] = queued(q)
    rows_of = lambda ids, e: [int(g.split(":")[2]) for g in ids if g.split(":")[1] == str(e)]  # noqa: E731
    assert orders["a"] == orders["b"]
    assert orders["a"] != orders["c"]
    e0, e1 = rows_of(orders["a"], 0), rows_of(orders["a"], 1)
    assert sorted(e0) == sorted(e1) == list(range(40))
    assert e0 != list(range(40)) and e0 != e1  # shuffled, differently per epoch
    assert e0 == epoch_order(40, 0, PushOptions(shuffle=True, seed=7))
    # The payload still names the row it came from.
    q = Queue(client, f"shuffle-a-{tmp_path.name}")
    gid = orders["a"][0]
    assert payload(q, gid).samples[0].prompt == f"q{gid.split(':')[2]}"


def test_push_twice_does_not_duplicate(queue, tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", ROWS)
    push_dataset(queue, path, PushOptions(epochs=2))
    again = push_dataset(queue, path, PushOptions(epochs=2))
    assert (again.pushed, again.already) == (0, 10)
    assert len(queued(queue)) == 10 == len(set(queued(queue)))
    # A third epoch later on adds only the new epoch.
    more = push_dataset(queue, path, PushOptions(epochs=3))
    assert (more.pushed, more.already) == (5, 10)
    assert len(set(queued(queue))) == 15
    assert assert_audit_ok(queue).pushed == 15


class Interrupted(Exception):
    pass


def test_interrupted_push_resumes(queue, tmp_path):
    path = write_jsonl(tmp_path / "big.jsonl", [{"input": f"q{i}"} for i in range(23)])
    opts = PushOptions(chunk_size=5, shuffle=True, seed=3)
    chunks = []

    def die_after_two(n):
        chunks.append(n)
        if len(chunks) == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        push_dataset(queue, path, opts, progress=die_after_two)
    assert len(queued(queue)) == 10
    assert queue.redis.hget(queue.keys.dataset, "big.jsonl:0") == b"10"
    report = push_dataset(queue, path, opts)
    assert (report.already, report.pushed) == (10, 13)
    ids = queued(queue)
    assert len(ids) == 23 == len(set(ids))
    assert [int(g.split(":")[2]) for g in ids] == epoch_order(23, 0, opts)  # same order as one uninterrupted push
    assert_audit_ok(queue)


def test_two_producers_at_once_never_duplicate(queue, client, tmp_path):
    """Another producer pushes the same dataset while the first is between chunks:
    the cursor check in the push script makes the first skip what the second did."""
    path = write_jsonl(tmp_path / "race.jsonl", [{"input": f"q{i}"} for i in range(20)])
    other = Queue(client, queue.keys.namespace)
    calls = []

    def meanwhile(n):
        calls.append(n)
        if len(calls) == 1:
            r = push_dataset(other, path, PushOptions(chunk_size=3))
            assert (r.already, r.pushed) == (4, 16)

    report = push_dataset(queue, path, PushOptions(chunk_size=4), progress=meanwhile)
    assert report.pushed == 4
    ids = queued(queue)
    assert ids == [f"race.jsonl:0:{i}" for i in range(20)]
    assert queue.stats()["pushed"] == 20
    assert_audit_ok(queue)


# -- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("bad_line,reason", [
    ('{"input": "unterminated', "invalid JSON"),
    ("not json at all", "invalid JSON"),
    ('["input", "a list"]', "expected a JSON object, got list"),
    ('{"prompt": "wrong key"}', "missing key 'input' (have: prompt)"),
    ('{"input": 42}', "'input' must be a non-empty string or a list of {role, content} messages, got int"),
    ('{"input": ""}', "'input' must be a non-empty string"),
    ('{"input": [{"role": "user"}]}', "'input' must be a non-empty string or a list"),
    ('{"input": []}', "'input' must be a non-empty string or a list"),
    ('{"input": "x", "label": ' + "[" * 70 + "]" * 70 + "}", "'label'" + "[0]" * 64 + " nests deeper than 64 levels"),
    ('{"input": "x", "metadata": "m"}', "'metadata' must be an object, got str"),
    (b'{"input": "\xff\xfe"}'.decode("latin-1"), "invalid JSON"),
])
def test_bad_row_names_file_line_and_reason(queue, tmp_path, bad_line, reason):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in ROWS[:3]]
    lines.insert(2, bad_line)
    path.write_bytes(("\n".join(lines) + "\n").encode("latin-1" if "\xff" in bad_line else "utf-8"))
    with pytest.raises(DatasetError) as info:
        push_dataset(queue, path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: ")
    assert reason in msg
    assert "--skip-bad" in msg
    nothing_pushed(queue)


def test_error_counts_further_bad_rows(queue, tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", ROWS, raw_lines={1: "oops", 3: '{"x": 1}', 5: "{"})
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: invalid JSON")) as info:
        push_dataset(queue, path)
    assert "(and 2 more bad rows)" in str(info.value)
    nothing_pushed(queue)


def test_missing_file(queue, tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        push_dataset(queue, tmp_path / "nope.jsonl")


def test_bad_options(queue, tmp_path):
    path = write_jsonl(tmp_path / "o.jsonl", ROWS)
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        push_dataset(queue, path, PushOptions(n_samples_per_prompt=0))
    with pytest.raises(ValueError, match="epochs"):
        push_dataset(queue, path, PushOptions(epochs=0))
    nothing_pushed(queue)


def test_skip_bad_dead_letters_bad_rows(queue, tmp_path):
    path = write_jsonl(tmp_path / "sb.jsonl", ROWS,
                       raw_lines={1: "{broken", 4: '{"question": "x"}', 6: '{"input": 5}'})
    report = push_dataset(queue, path, PushOptions(skip_bad=True, epochs=2))
    assert (report.rows, report.pushed, report.dead) == (8, 10, 6)
    k = queue.keys
    assert len(queued(queue)) == 10
    dead = queue.read_stream(k.dead)
    assert len(dead) == 6
    by_epoch = [(e.group_id, e.error) for e in dead if e.group_id.startswith("sb.jsonl:0:")]
    assert [gid for gid, _ in by_epoch] == ["sb.jsonl:0:1", "sb.jsonl:0:4", "sb.jsonl:0:6"]
    assert by_epoch[0][1].startswith(f"{path}:2: invalid JSON")
    assert by_epoch[1][1] == f"{path}:5: missing key 'input' (have: question): pass --input-key question"
    assert by_epoch[2][1].startswith(f"{path}:7: 'input' must be a non-empty string")
    # The dead letter carries the raw line for whoever fixes it.
    g = dead[0].decode()
    assert g.error == dead[0].error
    assert g.samples[0].metadata["raw"].strip() == "{broken"
    stats = queue.stats()
    assert (stats["pushed"], stats["dead"]) == (16, 6)
    report_ = assert_audit_ok(queue)
    assert (report_.prompts, report_.dead) == (10, 6)
    # Resuming pushes nothing more and dead-letters nothing twice.
    again = push_dataset(queue, path, PushOptions(skip_bad=True, epochs=2))
    assert (again.pushed, again.dead, again.already) == (0, 0, 16)
    assert queue.redis.xlen(k.dead) == 6


def test_skip_bad_keeps_raw_line(queue, tmp_path):
    path = write_jsonl(tmp_path / "raw.jsonl", [], raw_lines={0: '{"input": 7, "label": "x"}'})
    push_dataset(queue, path, PushOptions(skip_bad=True))
    [dead] = queue.read_stream(queue.keys.dead)
    g = dead.decode()
    assert g.group_id == "raw.jsonl:0:0" and g.row == 0
    assert g.error.startswith(f"{path}:1: 'input' must be")
    assert json.loads(g.samples[0].metadata["raw"]) == {"input": 7, "label": "x"}


def test_full_cycle_audit_adds_up(queue, client, namespace, tmp_path):
    from pipeline.consumer import Consumer
    from pipeline.queue import Place

    path = write_jsonl(tmp_path / "cyc.jsonl", ROWS, raw_lines={2: "bad"})
    push_dataset(queue, path, PushOptions(skip_bad=True, n_samples_per_prompt=2))
    for c in claim(queue, "w", 10).groups:
        g = c.group
        for i, s in enumerate(g.samples):
            s.tokens, s.response_length, s.reward = [1, 2], 1, float(i)
        publish(queue, "w", g, Place.RESULTS)
    consumer = Consumer(client, namespace, block_s=0.2)
    consumer.commit(consumer.next_batch(5, timeout=5))
    report = assert_audit_ok(queue)
    assert (report.pushed, report.committed, report.dead) == (6, 5, 1)


# -- a push Redis refuses partway leaves nothing behind --------------------------------------------


def _nothing_placed(q: Queue) -> None:
    """No group of the refused push is anywhere, and the audit adds up."""
    k = q.keys
    assert (q.redis.llen(k.prompts), q.redis.hlen(k.payloads), q.redis.xlen(k.dead)) == (0, 0, 0)
    assert q.stats() == {} and not any(f.endswith(b":0") for f in q.redis.hkeys(k.dataset))  # no cursor moved
    assert_audit_ok(q)


@pytest.mark.parametrize("key", ["prompts", "payloads", "stats", "dead"])
def test_a_push_refused_for_a_key_of_the_wrong_type_leaves_nothing_behind(queue, tmp_path, key):
    """A key of the namespace holding another type (a hand-made key, another tool's) made the
    push script fail after it had stored payloads: orphans the audit could not place."""
    path = write_jsonl(tmp_path / "wt.jsonl", ROWS, raw_lines={2: "bad"})
    name = getattr(queue.keys, key)
    queue.redis.set(name, "not the pipeline's")
    with pytest.raises(redis.ResponseError, match=rf"WRONGTYPE {re.escape(name)} holds a string"):
        push_dataset(queue, path, PushOptions(skip_bad=True))
    queue.redis.delete(name)
    _nothing_placed(queue)
    report = push_dataset(queue, path, PushOptions(skip_bad=True))  # fixed: the same push goes through
    assert (report.pushed, report.dead) == (5, 1)
    assert_audit_ok(queue)


def test_a_push_refused_for_memory_leaves_nothing_behind(redis_factory, namespace, tmp_path):
    server = redis_factory("full", aof=False)
    client = connect(server.url)
    q = Queue(client, namespace)
    path = write_jsonl(tmp_path / "oom.jsonl", ROWS, raw_lines={2: "bad"})
    client.config_set("maxmemory", 1)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        push_dataset(q, path, PushOptions(skip_bad=True))
    client.config_set("maxmemory", 0)
    _nothing_placed(q)


@pytest.mark.skipif(REDIS7 is None, reason="redis.acl_check_cmd needs redis-server >= 7.0")
def test_a_push_refused_a_permission_partway_leaves_nothing_behind(redis_factory, namespace, tmp_path):
    """A user that may queue prompts but not dead-letter bad rows: the push used to store the
    good rows' payloads and prompts, then fail at the bad row's XADD, counted nowhere."""
    server = redis_factory("acl", aof=False, binary=REDIS7)
    admin = connect(server.url)
    admin.acl_setuser("pusher", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-xadd"])
    q = Queue(connect(f"redis://pusher:pw@127.0.0.1:{server.port}"), namespace)
    path = write_jsonl(tmp_path / "perm.jsonl", ROWS, raw_lines={2: "bad"})
    with pytest.raises(redis.exceptions.NoPermissionError, match="XADD"):
        push_dataset(q, path, PushOptions(skip_bad=True))
    _nothing_placed(Queue(admin, namespace))
