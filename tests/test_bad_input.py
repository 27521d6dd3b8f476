"""The bad-input corpus (issue 9): each kind of bad input, the clear error it gets, and
proof that nothing else in the run was harmed.

One parametrized test per kind of input: dataset rows, dataset cursors, engine answers
and rewards (in one worker run), poison values in Redis, Redis URLs and credentials,
command-line options. Commands run through click's runner with exceptions let through,
so a traceback anywhere fails the test; the last test runs a sample of the corpus as
`python -m cli` processes.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from pipeline.ops.audit import audit
from pipeline.codec import decode_group
from pipeline.control import read_control
from pipeline.producer import PushOptions, push_dataset
from pipeline.queue import Queue
from pipeline.types import Group, Status
from tests.groups import claim
from tests.helpers import GenerateServer, WorkerThread, one_error_line, wait_for
from workers.engine_answers import parse_generate_response
from workers.engine_errors import EngineProtocolError
from workers.rewards import Reward
from workers.sampling import SamplingSettings
from workers.tokenizer import ByteTokenizer
from workers.worker import WorkerSettings

REPO = Path(__file__).resolve().parent.parent
GOOD = [{"input": f"What is {i} + 1?", "label": str(i + 1)} for i in range(3)]


def namespace_keys(queue: Queue) -> list[bytes]:
    return sorted(queue.redis.scan_iter(match=f"{{{queue.keys.namespace}}}:*"))


def queued(queue: Queue) -> list[str]:
    return [g.decode() for g in queue.redis.lrange(queue.keys.prompts, 0, -1)]


def assert_audit_ok(queue: Queue):
    report = audit(queue)
    assert report.ok, report.summary()
    return report


# -- dataset rows ----------------------------------------------------------------------------


@dataclass
class BadRow:
    line: str | bytes  # the row between two good rows (a JSON line; bytes when not UTF-8)
    error: str  # in the one-line error and in the dead letter
    args: tuple[str, ...] = ()  # extra push options


ROW_KINDS = {
    "malformed_json": BadRow('{"input": "unterminated', "invalid JSON"),
    "not_utf8": BadRow(b'{"input": "\xff\xfe"}', "invalid JSON"),
    "not_an_object": BadRow("[1, 2]", "expected a JSON object, got list"),
    "missing_key": BadRow('{"prompt": "q"}', "missing key 'input' (have: prompt)"),
    "wrong_type": BadRow('{"input": 42}', "'input' must be a non-empty string"),
    "label_nested_too_deep": BadRow('{"input": "q", "label": ' + "[" * 70 + "]" * 70 + "}",
                                    "nests deeper than 64 levels: a label must be a JSON value"),
    "label_nan": BadRow('{"input": "q", "label": NaN}', "invalid JSON: NaN is not JSON"),
    "label_infinity": BadRow('{"input": "q", "label": -Infinity}', "invalid JSON: -Infinity is not JSON"),
    "lone_surrogate": BadRow('{"input": "\\ud800"}', "not valid UTF-8 (a lone surrogate"),
    "lone_surrogate_in_a_metadata_key": BadRow('{"input": "q", "metadata": {"\\udfff": 1}}', "lone surrogate"),
    "nested_brackets": BadRow("[" * 100_000 + "]" * 100_000, "invalid JSON: nested too deeply"),
    "integer_beyond_64_bits": BadRow('{"input": "q", "metadata": {"n": 1' + "0" * 30 + "}}",
                                     "holds a value that cannot be stored"),
    "too_many_bytes": BadRow(json.dumps({"input": "x" * 5000}), "over the limit of 4,096 (--max-prompt-bytes)",
                             ("--max-prompt-bytes", "4096")),
    # 80 bytes, counted as text as the workers send them (the byte tokenizer's template only when asked)
    "longer_than_the_context": BadRow(json.dumps({"input": "y" * 80}), "prompt is 80 tokens",
                                      ("--tokenizer", "byte", "--context-length", "64")),
}


def write_rows(path: Path, bad: str | bytes) -> Path:
    good = [json.dumps(r).encode() for r in GOOD]
    line = bad if isinstance(bad, bytes) else bad.encode("utf-8")
    path.write_bytes(b"\n".join([good[0], line, good[1], good[2]]) + b"\n")
    return path


@pytest.mark.parametrize("kind", sorted(ROW_KINDS))
def test_bad_row_refuses_the_file_or_is_dead_lettered_alone(kind, run, queue, tmp_path):
    case = ROW_KINDS[kind]
    path = write_rows(tmp_path / "rows.jsonl", case.line)
    line = one_error_line(run("push", str(path), *case.args))
    assert line.startswith(f"Error: {path}:2: ") and case.error in line and "--skip-bad" in line, line
    assert namespace_keys(queue) == []  # refused before anything was written

    result = run("push", str(path), "--skip-bad", *case.args)
    assert result.exit_code == 0, result.output
    assert "pushed 3 groups of 1, 1 bad row dead-lettered" in result.output
    assert queued(queue) == ["rows.jsonl:0:0", "rows.jsonl:0:2", "rows.jsonl:0:3"]
    [dead] = queue.read_stream(queue.keys.dead)
    assert dead.group_id == "rows.jsonl:0:1" and case.error in dead.error
    raw = dead.decode().samples[0].metadata
    assert len(raw["raw"]) <= min(2000, raw["raw_bytes"])  # the dead letter keeps the first KBs and the size
    for gid, row in zip(queued(queue), GOOD):  # the good rows are whole
        assert decode_group(queue.redis.hget(queue.keys.payloads, gid)).samples[0].prompt == row["input"]
    assert run("dead", "show", dead.entry_id).exit_code == 0
    assert_audit_ok(queue)


def test_parquet_timestamp_inside_metadata_is_a_bad_row(run, queue, tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({
        "input": ["a?", "b?", "c?"],
        "metadata": [{"at": None}, {"at": pa.scalar(1_700_000_000_000, pa.timestamp("ms")).as_py()}, {"at": None}],
    }), path)
    line = one_error_line(run("push", str(path)))
    assert f"{path}:row 2: holds a value that cannot be stored" in line and "datetime" in line
    assert namespace_keys(queue) == []
    result = run("push", str(path), "--skip-bad")
    assert result.exit_code == 0 and "pushed 2 groups of 1, 1 bad row dead-lettered" in result.output
    assert queued(queue) == ["rows.parquet:0:0", "rows.parquet:0:2"]
    assert_audit_ok(queue)


def test_parquet_nan_label_is_a_bad_row(run, queue, tmp_path):
    path = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"input": ["a?", "b?"], "label": [1.0, math.nan]}), path)
    assert f"{path}:row 2: 'label' is nan, which JSON cannot hold: a label must be a JSON value" in \
        one_error_line(run("push", str(path)))
    assert namespace_keys(queue) == []


def test_empty_file_warns_and_writes_nothing(run, queue, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    result = run("push", str(path))
    assert result.exit_code == 0 and f"warning: {path} holds no rows: nothing pushed" in result.output
    assert namespace_keys(queue) == []


def test_max_queued_never_pushes_past_the_limit(queue, tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(500)))
    done = threading.Event()
    errors: list[BaseException] = []

    def produce():
        try:
            push_dataset(queue, path, PushOptions(max_queued=100))  # chunk_size stays 500
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=produce, daemon=True).start()
    claimed = 0
    while not done.is_set() or queue.redis.llen(queue.keys.prompts):
        assert queue.redis.llen(queue.keys.prompts) <= 100
        claimed += len(claim(queue, "w", 37).groups)
        time.sleep(0.01)
    assert not errors and claimed == 500
    assert_audit_ok(queue)


# -- dataset cursors ------------------------------------------------------------------------


@dataclass
class CursorChange:
    first: dict  # PushOptions of the interrupted first push
    then: tuple[str, ...]  # options of the push that must be refused
    difference: str
    edit: Callable[[Path], None] | None = None  # what happened to the file in between


def _prepend_row(path: Path) -> None:
    path.write_text(json.dumps({"input": "new first row"}) + "\n" + path.read_text())


def _replace_file(path: Path) -> None:
    path.write_text("".join(json.dumps({"input": f"other {i}"}) + "\n" for i in range(10)))


CURSOR_KINDS = {
    "another_seed": CursorChange({"shuffle": True, "seed": 1}, ("--shuffle", "--seed", "2"), "seed: 1 -> 2"),
    "shuffle_dropped": CursorChange({"shuffle": True}, (), "shuffle: True -> False"),
    "another_group_size": CursorChange({"n_samples_per_prompt": 2}, ("--n-samples", "4"), "n_samples: 2 -> 4"),
    "another_input_key": CursorChange({}, ("--input-key", "q"), "input_key: 'input' -> 'q'"),
    "row_inserted_at_the_top": CursorChange({}, (), "content: 10 rows", _prepend_row),
    "another_file_same_name": CursorChange({}, (), "content: 10 rows", _replace_file),
}


@pytest.mark.parametrize("kind", sorted(CURSOR_KINDS))
def test_resuming_a_cursor_differently_is_refused_with_the_ways_out(kind, run, queue, tmp_path):
    case = CURSOR_KINDS[kind]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input": f"q{i}", "q": f"q{i}"}) + "\n" for i in range(10)))

    class Interrupted(Exception):
        pass

    def interrupt(_n):
        raise Interrupted

    with pytest.raises(Interrupted):  # stopped after its first chunk, as by Ctrl-C
        push_dataset(queue, path, PushOptions(chunk_size=4, **case.first), progress=interrupt)
    before = (queued(queue), queue.stats())
    if case.edit:
        case.edit(path)
    line = one_error_line(run("push", str(path), *case.then))
    assert case.difference in line and "--dataset-name" in line and "--restart-cursor" in line, line
    assert "skip some rows and push others twice" in line
    assert (queued(queue), queue.stats()) == before  # nothing pushed by the refused push

    # The ways out: a new dataset name, or the same name started over under new group ids.
    assert run("push", str(path), *case.then, "--dataset-name", "data-v2").exit_code == 0
    result = run("push", str(path), *case.then, "--restart-cursor")
    assert result.exit_code == 0, result.output
    rows = len(path.read_text().splitlines())
    restarted = [g for g in queued(queue) if g.startswith("data.jsonl#1:")]
    assert len(restarted) == len(set(restarted)) == rows
    assert run("push", str(path), *case.then).exit_code == 0  # the new cursor resumes (nothing left)
    assert len(queued(queue)) == len(set(queued(queue))) == 4 + 2 * rows
    assert_audit_ok(queue)


def test_corrupt_cursor_and_fingerprint_are_one_line_errors(run, queue, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    assert run("push", str(path)).exit_code == 0
    queue.redis.hset(queue.keys.dataset, "c.jsonl:0", "garbage")
    line = one_error_line(run("push", str(path)))
    assert "cursor of epoch 0 holds b'garbage', not a position" in line and "--restart-cursor" in line
    queue.redis.hset(queue.keys.dataset, "c.jsonl:fingerprint", "{{{")
    line = one_error_line(run("push", str(path)))
    assert "recorded fingerprint is corrupt" in line and "--restart-cursor" in line
    assert run("push", str(path), "--restart-cursor").exit_code == 0
    assert len(queued(queue)) == 6
    assert_audit_ok(queue)


def test_a_fixed_bad_row_is_re_read_by_dead_retry(run, queue, tmp_path):
    path = write_rows(tmp_path / "fix.jsonl", '{"input": 42}')
    assert run("push", str(path), "--skip-bad").exit_code == 0
    [dead] = queue.read_stream(queue.keys.dead)
    line = one_error_line(run("dead", "retry", dead.entry_id))  # not fixed yet
    assert "bad dataset row" in line and f"still has it bad: {path}:2" in line
    path.write_text(path.read_text().replace('{"input": 42}', '{"input": "fixed prompt", "label": "7"}'))
    result = run("dead", "retry", "--all")
    assert result.exit_code == 0 and "retried 1 dead letter:" in result.output
    assert queued(queue)[0] == "fix.jsonl:0:1"
    group = decode_group(queue.redis.hget(queue.keys.payloads, "fix.jsonl:0:1"))
    assert (group.samples[0].prompt, group.samples[0].label, group.error) == ("fixed prompt", "7", None)
    # The fixed file is still the same dataset: pushing it again resumes (nothing left to push).
    again = run("push", str(path))
    assert again.exit_code == 0 and "pushed 0 groups" in again.output and "4 already pushed" in again.output
    assert_audit_ok(queue)


def test_dead_retry_refuses_a_row_whose_file_changed_beyond_it(run, queue, tmp_path):
    path = write_rows(tmp_path / "moved.jsonl", '{"input": 42}')
    assert run("push", str(path), "--skip-bad").exit_code == 0
    path.write_text(json.dumps({"input": "only row"}) + "\n")
    line = one_error_line(run("dead", "retry", "moved.jsonl:0:1"))
    assert "changed beyond its bad rows" in line
    assert queue.redis.xlen(queue.keys.dead) == 1
    assert_audit_ok(queue)


# -- engine answers and rewards: one worker run --------------------------------------------------


def _answer(ids=(104, 105), logprobs=(-0.5, -0.25), finish=None, **meta) -> dict:
    body = {"text": "hi", "output_ids": list(ids),
            "meta_info": {"id": "r", "finish_reason": finish or {"type": "stop", "matched": ids[-1]},
                          "prompt_tokens": 3, "completion_tokens": len(ids), "weight_version": "0",
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}}
    body["meta_info"].update(meta)
    return body


def _without_logprobs() -> dict:
    body = _answer()
    del body["meta_info"]["output_token_logprobs"]
    return body


# What a broken engine (or the wrong service) answers with 200, and what the error says.
ENGINE_KINDS: dict[str, tuple[bytes, str]] = {
    "stop_without_log_probs": (json.dumps(_without_logprobs()).encode(),
                               "finish_reason 'stop' without output_token_logprobs"),
    "nan_log_prob": (json.dumps(_answer(logprobs=(-0.5, math.nan))).encode(), "log-prob nan"),
    "infinite_log_prob": (json.dumps(_answer(logprobs=(-math.inf, -0.1))).encode(), "log-prob -inf"),
    "log_prob_beyond_float32": (json.dumps(_answer(logprobs=(-1e300, -0.1))).encode(), "not a finite float32"),
    "log_prob_a_string": (json.dumps(_answer(logprobs=("x", -0.1))).encode(), "log-probs that are not numbers"),
    # (a worker with the byte tokenizer knows its vocabulary: then that is the bound it names)
    "token_id_beyond_int32": (json.dumps(_answer(ids=(104, 2**31))).encode(), "token id 2147483648, outside"),
    "negative_token_id": (json.dumps(_answer(ids=(-1, 105))).encode(), "token id -1"),
    "float_token_id": (json.dumps(_answer(ids=(104.0, 105))).encode(), "not integers"),
    "completion_tokens_disagree": (json.dumps(_answer(completion_tokens=5)).encode(),
                                   "completion_tokens 5 but 2 output tokens"),
    "unknown_finish_reason": (json.dumps(_answer(finish={"type": "exploded"})).encode(), "unknown finish_reason"),
    "no_meta_info": (b'{"text": "hi"}', "no meta_info object"),
    "entry_not_a_list": (json.dumps(_answer() | {"meta_info": _answer()["meta_info"] | {
        "output_token_logprobs": [1, 2]}}).encode(), "not [logprob, token_id, text]"),
    "lone_surrogate_text": (json.dumps(_answer() | {"text": "\ud800"}).encode(), "text is not a UTF-8 string"),
    "weight_version_an_object": (json.dumps(_answer(weight_version={"v": 1})).encode(),
                                 "weight_version is not a UTF-8 string"),
    "html_from_the_wrong_service": (b"<html><body>It works!</body></html>", "expected a JSON object, got str"),
    "deeply_nested_json": (b"[" * 100_000, "expected a JSON object, got str"),
    "list_of_answers": (json.dumps([_answer(), _answer()]).encode(), "2 results; expected one"),
}

# What a broken reward returns, and what the dead letter says.
REWARD_KINDS: dict[str, tuple[object, str]] = {
    "nan_under_another_key": ({"score": 1.0, "aux": math.nan}, "returned nan under key 'aux'"),
    "string_under_a_key": ({"score": 1.0, "pred": "42"}, "returned str '42' under key 'pred'"),
    "numpy_bool_under_a_key": ({"score": np.True_}, "under key 'score'; expected a number"),
    "infinity": (math.inf, "returned inf, which is not a finite number"),
    "none": (None, "returned NoneType None; expected a number or a dict"),
    "raises": (ValueError("judge unreachable"), "ValueError: judge unreachable"),
}
GOOD_GROUPS = 6


class GarbageEngine(GenerateServer):
    """SGLang's /generate in a thread, answering by prompt: `engine:<kind>` gets that
    kind of garbage, any other prompt a good two-token answer."""

    def __init__(self):
        self.tokenizer = ByteTokenizer()
        super().__init__()

    async def generate(self, request: web.Request) -> web.Response:
        prompt = self.tokenizer.decode((await request.json())["input_ids"])
        body, _ = ENGINE_KINDS.get(prompt.removeprefix("engine:"), (json.dumps(_answer()).encode(), ""))
        return web.Response(body=body, content_type="application/json")


async def poisoned_reward(args, sample):
    value, _ = REWARD_KINDS.get(sample.prompt.removeprefix("reward:"),
                                ({"score": np.float32(1.0), "format": np.float64(0.5)}, ""))
    if isinstance(value, Exception):
        raise value
    return value


@dataclass
class WorkerRun:
    queue: Queue
    dead: dict[str, str]  # group id -> error
    results: list[Group]
    worker_state: str


@pytest.fixture(scope="module")
def worker_run(redis_server) -> WorkerRun:
    from pipeline.connection import connect

    client = connect(redis_server.url)
    queue = Queue(client, "bad-input-worker-run")
    prompts = ([f"engine:{k}" for k in ENGINE_KINDS] + [f"reward:{k}" for k in REWARD_KINDS]
               + [f"good:{i}" for i in range(GOOD_GROUPS)])
    queue.push_groups([Group.fresh(p, p, 2, label="1") for p in prompts])
    engine = GarbageEngine()
    worker = WorkerThread(WorkerSettings(
        redis_url=redis_server.url, engine_urls=[engine.url], namespace=queue.keys.namespace, max_attempts=2,
        backoff_s=0.01, backoff_max_s=0.05, engine_down_after=10_000, heartbeat_s=0.2,
        sampling=SamplingSettings(max_new_tokens=8)), reward=Reward(poisoned_reward))
    try:
        wait_for(lambda: client.xlen(queue.keys.results) + client.xlen(queue.keys.dead) == len(prompts),
                 timeout=60, what="every group published or dead-lettered")
        state = worker.worker.state()
    finally:
        worker.stop()
        engine.stop()
    yield WorkerRun(queue=queue, dead={e.group_id: e.error for e in queue.read_stream(queue.keys.dead, 1000)},
                    results=[e.decode() for e in queue.read_stream(queue.keys.results, 1000)], worker_state=state)
    client.close()


def assert_good_groups_unharmed(run_: WorkerRun) -> None:
    assert sorted(g.group_id for g in run_.results) == [f"good:{i}" for i in range(GOOD_GROUPS)]
    for g in run_.results:
        for s in g.samples:
            assert s.status == Status.COMPLETED and s.response_length == 2 == len(s.rollout_log_probs)
            assert s.reward == {"score": 1.0, "format": 0.5} and all(type(v) is float for v in s.reward.values())
    assert run_.worker_state not in ("stopping",) and not run_.worker_state.startswith("engine-down")
    assert_audit_ok(run_.queue)


@pytest.mark.parametrize("kind", sorted(ENGINE_KINDS))
def test_engine_answer_is_never_a_sample(kind, worker_run):
    error = worker_run.dead[f"engine:{kind}"]
    assert error.startswith("engine failed 2 times; last error: malformed /generate answer from")
    assert ENGINE_KINDS[kind][1] in error and "the answer began" in error
    assert_good_groups_unharmed(worker_run)


@pytest.mark.parametrize("kind", sorted(REWARD_KINDS))
def test_reward_value_is_never_published(kind, worker_run):
    error = worker_run.dead[f"reward:{kind}"]
    assert error.startswith("reward failed 2 times") and REWARD_KINDS[kind][1] in error, error
    assert_good_groups_unharmed(worker_run)


@pytest.mark.parametrize("kind", sorted(ENGINE_KINDS))
def test_engine_answer_parser_names_the_problem(kind):
    from workers.engine_answers import decode_body

    body, error = ENGINE_KINDS[kind]
    data = decode_body(body)
    if isinstance(data, list):
        return  # refused by the client before parsing (see the worker run)
    with pytest.raises(EngineProtocolError, match="malformed /generate answer") as info:
        parse_generate_response(data, "http://e")
    assert error in str(info.value) and 0 < len(info.value.head) <= 200  # the dead letter shows the answer


def test_token_ids_outside_the_vocabulary():
    with pytest.raises(EngineProtocolError, match="token id 300, outside the vocabulary of 259"):
        parse_generate_response(_answer(ids=(104, 300)), "http://e", vocab_size=259)
    assert parse_generate_response(_answer(ids=(104, 258)), "http://e", vocab_size=259).output_ids == [104, 258]


# -- poison data in Redis --------------------------------------------------------------------


def _poison_worker_name(q: Queue) -> None:
    q.redis.zadd(q.keys.workers, {b"\xffworker": time.time() * 1000 + 30_000})


def _poison_worker_info(q: Queue) -> None:
    q.redis.zadd(q.keys.workers, {"w-info": time.time() * 1000 + 30_000})
    q.redis.hset(q.keys.worker_info, "w-info", "[" * 100_000)


# Each writes one foreign or corrupt value; (commands, what the output says).
POISON_KINDS: dict[str, tuple[Callable[[Queue], None], list[tuple[tuple[str, ...], str]]]] = {
    "weight_version_not_a_number": (
        lambda q: q.redis.hset(q.keys.control, "weight_version", "abc"),
        [(("status", "--json", "--sample", "0"), "control field 'weight_version' holds 'abc', not a number")]),
    "max_staleness_not_a_number": (
        lambda q: q.redis.hset(q.keys.control, "max_staleness", "1.5x"),
        [(("status", "--json", "--sample", "0"), "control field 'max_staleness' holds '1.5x'")]),
    "release_policy_not_utf8": (
        lambda q: q.redis.hset(q.keys.control, "release_policy", b"\xff"),
        [(("status", "--sample", "0"), "prompts 3")]),
    "counter_not_a_number": (
        lambda q: q.redis.hset(q.keys.stats, "results", "many"),
        [(("status", "--json", "--sample", "0"), "stats field 'results' holds 'many', not a number")]),
    "non_utf8_gid_in_results": (
        lambda q: q.redis.xadd(q.keys.results, {b"gid": b"\xff\xfe", b"data": b""}),
        [(("status", "--json", "--sample", "0"), "1 waiting results do not decode")]),
    "non_utf8_gid_in_dead_letters": (
        lambda q: q.redis.xadd(q.keys.dead, {b"gid": b"\xffg", b"data": b"junk", b"error": b"\xfe"}),
        [(("dead", "list"), "\\xffg"), (("dead", "show", "\\xffg"), "does not decode"),
         (("dead", "drop", "--all"), "dropped 1 dead letter")]),
    "non_utf8_worker_name": (_poison_worker_name, [(("status", "--json", "--sample", "0"), "\\\\xffworker")]),
    "worker_info_nested_too_deeply": (_poison_worker_info, [(("status", "--json", "--sample", "0"),
                                                             "unreadable info")]),
}


@pytest.mark.parametrize("kind", sorted(POISON_KINDS))
def test_poison_value_in_redis_is_reported_not_a_traceback(kind, run, queue):
    queue.push_groups([Group.fresh(f"g{i}", f"q{i}", 1) for i in range(3)])
    poison, checks = POISON_KINDS[kind]
    poison(queue)
    for args, says in checks:
        result = run(*args)
        assert result.exit_code == 0, result.output
        assert says in result.output, result.output
    control = read_control(queue.redis, queue.keys)  # every reader of the control hash survives it
    assert control.release_policy in ("continue", "restart", "drop")
    assert queued(queue) == ["g0", "g1", "g2"]  # the rest of the namespace is untouched
    status = json.loads(run("status", "--json", "--sample", "0").output)
    assert status["prompts"] == 3


# -- Redis URLs and credentials --------------------------------------------------------------

SECRET = "s3cr3t-pw"


@pytest.fixture
def acl_user(client):
    name = f"noinfo-{os.getpid()}"
    client.execute_command("ACL", "SETUSER", name, "on", f">{SECRET}", "~*", "&*", "+@all", "-info")
    yield name
    client.execute_command("ACL", "DELUSER", name)


URL_KINDS: dict[str, tuple[str, str]] = {  # {port} is the test server's, {user} the ACL user without INFO
    "port_out_of_range": ("redis://127.0.0.1:99999", "the port must be a number from 1 to 65535"),
    "port_not_a_number": ("redis://127.0.0.1:63x9", "the port must be a number from 1 to 65535"),
    "port_zero": ("redis://127.0.0.1:0", "the port must be a number from 1 to 65535"),
    "unknown_query_parameter": ("redis://127.0.0.1:{port}?colour=blue", "unknown query parameter 'colour'"),
    "malformed_ipv6_host": ("redis://[::1:{port}", "malformed host"),
    "password_with_a_hash": (f"redis://:{SECRET}#x@127.0.0.1:{{port}}", "percent-encode them"),
    "password_with_a_slash": (f"redis://:{SECRET}/x@127.0.0.1:{{port}}", "percent-encode them"),
    "password_with_a_question_mark": (f"redis://:{SECRET}?x@127.0.0.1:{{port}}", "percent-encode them"),
    "password_in_the_user_slot": (f"redis://{SECRET}@127.0.0.1:1", "cannot reach Redis at redis://***@127.0.0.1:1"),
    "wrong_password": (f"redis://{{user}}:not-{SECRET}@127.0.0.1:{{port}}", "refused the credentials"),
    "user_without_info": (f"redis://{{user}}:{SECRET}@127.0.0.1:{{port}}",
                          "permission denied at Redis redis://***@127.0.0.1"),
    "tls_to_a_plain_server": ("rediss://127.0.0.1:{port}", "the server may not speak TLS"),
    "unreachable": ("redis://127.0.0.1:1", "cannot reach Redis at redis://127.0.0.1:1"),
    "not_redis": (f"http://u:{SECRET}@example", "unsupported Redis URL 'http://***@example'"),
}


@pytest.mark.parametrize("kind", sorted(URL_KINDS))
def test_bad_redis_url_is_one_line_without_the_password(kind, run, queue, redis_url, acl_user):
    url, says = URL_KINDS[kind]
    url = url.format(port=redis_url.rsplit(":", 1)[1], user=acl_user)
    started = time.monotonic()
    line = one_error_line(run("status", url=url))
    assert says in line, line
    assert SECRET not in line and acl_user not in line
    assert time.monotonic() - started < 15  # rediss to a plain server gives up in seconds
    assert namespace_keys(queue) == []


# -- command-line options ------------------------------------------------------------------


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _stops(n: int) -> tuple[str, ...]:
    return tuple(a for i in range(n) for a in ("--stop", f"<s{i}>"))


ENGINE = ("--engine-url", "http://127.0.0.1:1")
CLI_KINDS: dict[str, tuple[tuple[str, ...], str]] = {  # {busy} is a port something listens on
    "worker_engine_url_not_a_url": (("worker", "--engine-url", "notaurl"), "'notaurl' is not an engine URL"),
    "worker_top_k_zero": (("worker", *ENGINE, "--top-k", "0"), "top_k must be -1 (no limit) or at least 1, got 0"),
    "worker_33_stop_strings": (("worker", *ENGINE, *_stops(33)), "at most 32 stop strings"),
    "worker_empty_stop_string": (("worker", *ENGINE, "--stop", ""), "stop must be a list of non-empty strings"),
    "worker_temperature_nan": (("worker", *ENGINE, "--temperature", "nan"), "'nan' is not a finite number"),
    "worker_metrics_port_out_of_range": (("worker", *ENGINE, "--metrics-port", "99999"),
                                         "99999 is not in the range"),
    "worker_metrics_port_in_use": (("worker", *ENGINE, "--metrics-port", "{busy}"), "cannot listen on 127.0.0.1:"),
    "worker_request_timeout_zero": (("worker", *ENGINE, "--request-timeout", "0"), "--request-timeout"),
    "worker_generate_function_missing": (("worker", *ENGINE, "--generate-function", "tests.no_such:generate"),
                                         "generate function path 'tests.no_such:generate': cannot import module"),
    "worker_generate_function_not_async": (("worker", *ENGINE, "--generate-function", "tests.generate_functions:reset"),
                                           "must be an async function"),
    "sim_engine_port_in_use": (("sim-engine", "--port", "{busy}"), "cannot listen on 127.0.0.1:"),
    "sim_engine_port_out_of_range": (("sim-engine", "--port", "70000"), "70000 is not in the range"),
    "consume_metrics_port_in_use": (("consume", "--batch-size", "1", "--metrics-port", "{busy}"),
                                    "cannot listen on 127.0.0.1:"),
    "push_tokenizer_without_context_length": (("push", "x.jsonl", "--tokenizer", "byte"),
                                              "--tokenizer and --context-length go together"),
    "push_missing_file": (("push", "no-such.jsonl"), "no-such.jsonl: no such file"),
}
try:
    import transformers  # noqa: F401
except ImportError:
    CLI_KINDS["worker_tokenizer_without_transformers"] = (
        ("worker", *ENGINE, "--tokenizer", "org/model"), "needs the 'transformers' package")
    CLI_KINDS["push_tokenizer_without_transformers"] = (
        ("push", "x.jsonl", "--tokenizer", "org/model", "--context-length", "8"), "needs the 'transformers' package")


@pytest.mark.parametrize("kind", sorted(CLI_KINDS))
def test_bad_option_is_a_clear_error_and_nothing_runs(kind, run, queue, busy_port):
    queue.push_groups([Group.fresh(f"g{i}", f"q{i}", 1) for i in range(2)])
    args, says = CLI_KINDS[kind]
    result = run(*(a.format(busy=busy_port) for a in args))
    assert result.exit_code in (1, 2) and "Traceback" not in result.output
    assert says in result.output, result.output
    assert queued(queue) == ["g0", "g1"] and queue.redis.zcard(queue.keys.workers) == 0  # nobody claimed


def test_consume_on_a_namespace_that_does_not_exist_creates_nothing(run, queue):
    result = run("consume", "--batch-size", "1", "--timeout", "0.1")
    assert result.exit_code != 0 and "Traceback" not in result.output
    waiting, error = [line for line in result.output.splitlines() if line.strip()]  # it said it waits, then why it stopped
    assert "waiting up to 0.1s for the first push" in waiting
    assert error.startswith("Error: nothing pushed within --timeout 0.1s") and f"namespace '{queue.keys.namespace}' is empty" in error
    assert namespace_keys(queue) == []


# -- the same, as processes ----------------------------------------------------------------------


@pytest.mark.slow
def test_no_corpus_input_gives_a_traceback_as_a_process(redis_url, namespace, tmp_path, busy_port):
    rows = write_rows(tmp_path / "p.jsonl", "[" * 100_000 + "]" * 100_000)
    cases = [  # (arguments, exit code)
        (["push", str(rows)], 1),
        (["push", str(rows), "--skip-bad", "--dataset-name", "skipped"], 0),
        (["--redis-url", "redis://127.0.0.1:99999", "status"], 1),
        (["--redis-url", f"redis://:{SECRET}#x@127.0.0.1:1", "status"], 1),
        (["worker", *ENGINE, "--top-k", "0"], 1),
        (["worker", "--engine-url", "notaurl"], 2),
        (["sim-engine", "--port", str(busy_port)], 2),
        (["consume", "--batch-size", "1", "--timeout", "0.1"], 1),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(ROLLOUT_HOME=str(tmp_path / "home"), ROLLOUT_REDIS_URL=redis_url, ROLLOUT_NAMESPACE=namespace)
    procs = [subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args, _ in cases]
    for (args, code), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == code and "Traceback" not in out + err and SECRET not in out + err, (args, err)
        assert code == 0 or "Error: " in err, (args, err)
