"""Streamed /generate (workers/engine_stream.py, EngineClient.generate_stream): both of
SGLang's chunk styles read to the same answer a whole one gives, every chunk checked as it
comes, and a stream cut anywhere leaves every token received before it."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from aiohttp import web

from engines.simulator import SimConfig, start_simulator
from pipeline.consumer import Consumer
from pipeline.ops.audit import audit
from pipeline.queue import Queue
from pipeline.redis_server import free_port
from pipeline.types import Group
from tests.helpers import RouterProcess, WorkerThread, consume_all, http_json, wait_for
from tests.test_engine_client import FakeEngine, engines, run
from workers.engine import EngineClient
from workers.engine_errors import (EngineError, EngineProtocolError, EngineRequestError, EngineStreamCut,
                                   EngineUnavailable)
from workers.engine_set import EngineSet
from workers.engine_stream import MAX_IDLE_CHUNKS, ChunkStyle, StreamAssembler
from workers.sampling import SamplingSettings
from workers.settings import WorkerSettings

PROMPT = list(b"What is 2 + 3?")
IDS = [40 + i for i in range(12)]
LPS = [-0.125 * (i + 1) for i in range(12)]


def chunk(upto: int, sent: int = 0, finish: dict | None = None, incremental: bool = False, version: str = "3",
          **meta_extra) -> dict:
    """A chunk of an answer of IDS that has produced `upto` tokens, `sent` of them in earlier chunks."""
    start = sent if incremental else 0
    meta = {"id": "r1", "finish_reason": finish, "prompt_tokens": len(PROMPT), "weight_version": version,
            "output_token_logprobs": [[LPS[i], IDS[i], None] for i in range(start, upto)],
            "completion_tokens": upto, "cached_tokens": 0}
    meta.update(meta_extra)
    text = "".join(chr(t) for t in IDS[start:upto])
    return {"text": text, "output_ids": IDS[start:upto], "meta_info": meta}


def answer_chunks(sizes: list[int], incremental: bool = False, finish: dict | None = None) -> list[dict]:
    """Chunks of one answer: after sizes[0] tokens, sizes[1], ...; the last one final."""
    out, sent = [], 0
    for i, upto in enumerate(sizes):
        last = i == len(sizes) - 1
        out.append(chunk(upto, sent, (finish or {"type": "length", "length": upto}) if last else None,
                         incremental))
        sent = upto
    return out


def events(chunks: list, separators=(",", ":"), done: bool = True, newline: bytes = b"\n") -> bytes:
    body = b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c, separators=separators).encode())
                    + newline + newline for c in chunks)
    return body + (b"data: [DONE]" + newline + newline if done else b"")


def streaming_engine(body: bytes, piece: int | None = None, cut: bool = False, content_type="text/event-stream",
                     status: int = 200) -> FakeEngine:
    """A fake engine answering /generate with `body` (in pieces of `piece` bytes, each sent on
    its own); `cut`: the connection is torn down after it instead of ending the body."""
    async def generate(request):
        resp = web.StreamResponse(status=status, headers={"Content-Type": content_type})
        await resp.prepare(request)
        step = piece or len(body) or 1
        for i in range(0, len(body), step):
            await resp.write(body[i:i + step])
            if piece:
                await asyncio.sleep(0)
        if cut:
            request.transport.abort()
            return resp
        await resp.write_eof()
        return resp

    return FakeEngine({("POST", "/generate"): generate})


async def read_stream(url: str, max_new_tokens: int = 64, vocab_size: int | None = None, **kw):
    """(every progress yielded, as (tokens so far, new tokens, result or None), the final progress or the error)."""
    client = EngineClient(url, vocab_size=vocab_size)
    seen = []
    try:
        async for p in client.generate_stream(PROMPT, {"max_new_tokens": max_new_tokens}, rid="r1", **kw):
            seen.append((list(p.output_ids), p.new_tokens, p.result))
        return seen, p
    except EngineError as exc:
        return seen, exc
    finally:
        await client.close()


def stream_of(body: bytes, **kw):
    """read_stream from a streaming_engine answering `body` (its options among `kw`)."""
    serving = {k: kw.pop(k) for k in ("piece", "cut", "content_type", "status") if k in kw}

    async def scenario():
        async with engines(streaming_engine(body, **serving)) as (url,):
            return await read_stream(url, **kw)
    return run(scenario())


# -- the answer a stream reads --------------------------------------------------------------


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_a_streamed_answer_is_the_answer_the_simulator_gives_whole(incremental):
    sim = start_simulator(SimConfig(seed=3, decode_tokens_per_s=400.0, length_median=120.0, length_p99=300.0,
                                    incremental_streaming_output=incremental))

    async def scenario():
        client = EngineClient(sim.url)
        try:
            params = {"max_new_tokens": 200, "sampling_seed": 11}
            whole = await client.generate(PROMPT, params, rid="whole")
            yielded = 0
            async for p in client.generate_stream(PROMPT, params, rid="streamed", stream_interval=1):
                yielded += 1
            return whole, p, yielded
        finally:
            await client.close()

    try:
        whole, progress, yielded = run(scenario())
    finally:
        sim.stop()
    result = progress.result
    assert yielded >= 2 and progress.style == (ChunkStyle.INCREMENTAL if incremental else ChunkStyle.CUMULATIVE)
    assert (result.output_ids, result.output_log_probs, result.finish_type, result.weight_version, result.text) == \
        (whole.output_ids, whole.output_log_probs, whole.finish_type, whole.weight_version, whole.text)
    assert result.rid == "streamed" and result.completion_tokens == len(whole.output_ids)


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")], ids=["compact", "spaced"])
def test_both_chunk_styles_of_one_answer_read_the_same_tokens(separators):
    sizes = [1, 4, 4, 9, 12]
    cumulative = stream_of(events(answer_chunks(sizes), separators))
    incremental = stream_of(events(answer_chunks(sizes, incremental=True), separators))
    for seen, p in (cumulative, incremental):
        assert [new for _, new, _ in seen] == [1, 3, 5, 3]  # the chunk of 4 again brought nothing: not yielded
        assert p.result.output_ids == IDS and p.result.output_log_probs == LPS
        assert p.result.text == "".join(chr(t) for t in IDS) and p.result.weight_version == "3"
    assert (cumulative[1].style, incremental[1].style) == (ChunkStyle.CUMULATIVE, ChunkStyle.INCREMENTAL)


def test_a_cumulative_chunk_is_read_from_where_the_last_one_ended():
    # The second chunk's first entry is damaged where the first chunk already delivered it: read
    # only after the entries received, it is never parsed again (taken as received), so the
    # work per chunk is its new tokens, not the whole answer again.
    # (A long text makes the chunks large enough to be cut: small ones are parsed whole.)
    first = json.dumps(chunk(3) | {"text": "y" * 5000}, separators=(",", ":")).encode()
    second = json.dumps(chunk(6, finish={"type": "length", "length": 6}) | {"text": "y" * 5000},
                        separators=(",", ":")).encode()
    damaged = second.replace(b"[-0.125,40,null]", b"[-0.125,4x,null]", 1)
    assert damaged != second
    seen, p = stream_of(events([first, damaged]))
    assert p.result.output_ids == IDS[:6]


def test_events_split_at_every_byte_with_crlf_lines_read_the_same():
    body = events(answer_chunks([2, 7, 12]), newline=b"\r\n")
    seen, p = stream_of(body, piece=1)
    assert p.result.output_ids == IDS and [new for _, new, _ in seen] == [2, 5, 5]


def test_output_ids_as_the_new_ids_or_the_last_id_of_an_aborted_stream_are_accepted():
    # Older releases' --stream-output: output_ids are each chunk's new ids, log-probs cumulative.
    delta_ids = answer_chunks([3, 8, 12])
    for c, before in zip(delta_ids, [0, 3, 8]):
        c["output_ids"] = c["output_ids"][before:]
    assert stream_of(events(delta_ids))[1].result.output_ids == IDS
    # SGLang's chunk for a request aborted in its waiting queue names only the last id.
    aborted = answer_chunks([3, 5], finish={"type": "abort", "message": "Abort in waiting queue"})
    aborted[-1]["output_ids"] = [IDS[4]]
    result = stream_of(events(aborted))[1].result
    assert result.finish_type == "abort" and result.output_ids == IDS[:5]


def test_an_abort_chunk_without_log_probs_is_zero_tokens():
    final = {"text": "", "output_ids": [], "meta_info": {"id": "r1", "finish_reason": {
        "type": "abort", "message": "Abort before prefill"}, "completion_tokens": 0}}
    result = stream_of(events([final]))[1].result
    assert (result.finish_type, result.output_ids) == ("abort", [])


def test_an_answer_that_did_not_stream_is_read_whole():
    body = json.dumps(chunk(12, finish={"type": "stop", "matched": 2})).encode()
    seen, p = stream_of(body, content_type="application/json")
    assert len(seen) == 1 and p.result.output_ids == IDS and p.result.finish_type == "stop"


# -- a stream that ends early keeps what came -----------------------------------------------------


def test_a_stream_cut_mid_way_keeps_every_token_received():
    body = events(answer_chunks([2, 5, 9, 12])[:3], done=False)
    seen, error = stream_of(body, cut=True)
    assert isinstance(error, EngineStreamCut) and "broke off after 9 tokens" in str(error)
    assert error.partial.output_ids == IDS[:9] and error.partial.output_log_probs == LPS[:9]
    assert error.partial.result is None and [s[0] for s in seen][-1] == IDS[:9]


def test_done_before_the_final_chunk_is_a_cut():
    seen, error = stream_of(events(answer_chunks([2, 5, 9, 12])[:2]))
    assert isinstance(error, EngineStreamCut) and "without its final chunk" in str(error)
    assert error.partial.output_ids == IDS[:5]


def test_a_final_chunk_without_done_is_a_whole_answer():
    seen, p = stream_of(events(answer_chunks([4, 12]), done=False))
    assert p.result.output_ids == IDS


@pytest.mark.slow
def test_an_engine_killed_mid_stream_leaves_the_tokens_it_sent(tmp_path):
    """A real simulator process, killed with SIGKILL while it streams: the tokens received
    are those the same seeded engine gives whole, up to the kill."""
    port = free_port()
    args = [sys.executable, "-m", "cli", "sim-engine", "--port", str(port), "--seed", "5", "--decode-rate", "40",
            "--median-tokens", "400", "--p99-tokens", "800"]
    log = open(tmp_path / "sim.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    twin = start_simulator(SimConfig(seed=5, decode_tokens_per_s=4000.0, length_median=400.0, length_p99=800.0))
    params = {"max_new_tokens": 300, "sampling_seed": 9}
    try:
        wait_for(lambda: _healthy(url), timeout=30, what="the simulator to answer /health")

        async def scenario():
            client = EngineClient(url)
            try:
                async for p in client.generate_stream(PROMPT, params, rid="doomed", stream_interval=1):
                    if len(p.output_ids) >= 10:
                        proc.send_signal(signal.SIGKILL)
                raise AssertionError("the stream outlived its engine")
            except EngineError as exc:
                return exc
            finally:
                await client.close()

        error = run(scenario())
        whole = run(_whole(twin.url, params))
    finally:
        proc.kill()
        proc.wait()
        log.close()
        twin.stop()
    assert isinstance(error, EngineUnavailable) and error.partial is not None
    got = error.partial.output_ids
    assert len(got) >= 10 and got == whole.output_ids[:len(got)]
    assert error.partial.output_log_probs == whole.output_log_probs[:len(got)]


def _healthy(url: str) -> bool:
    try:
        http_json(url + "/health")
        return True
    except Exception:
        return False


async def _whole(url: str, params: dict):
    client = EngineClient(url)
    try:
        return await client.generate(PROMPT, params, rid="twin")
    finally:
        await client.close()


def test_leaving_the_loop_early_ends_the_request_on_the_engine():
    sim = start_simulator(SimConfig(seed=1, decode_tokens_per_s=50.0, length_median=500.0, length_p99=900.0))

    async def scenario():
        client = EngineClient(sim.url)
        try:
            async for p in client.generate_stream(PROMPT, {"max_new_tokens": 600}, rid="left", stream_interval=1):
                break
            return p
        finally:
            await client.close()

    try:
        p = run(scenario())
        assert p.output_ids and p.result is None
        wait_for(lambda: http_json(sim.url + "/v1/loads")["aggregate"]["total_reqs"] == 0, timeout=10,
                 what="the engine to drop the request whose stream was left")
    finally:
        sim.stop()


# -- every chunk is checked ----------------------------------------------------------------------


def _bad(kind: str) -> list:
    chunks = answer_chunks([2, 5, 12])
    middle = chunks[1]
    if kind == "id outside the vocabulary":
        middle["meta_info"]["output_token_logprobs"][3][1] = 70_000
        middle["output_ids"][3] = 70_000
    elif kind == "log-prob not finite":
        middle["meta_info"]["output_token_logprobs"][3][0] = 1e39
    elif kind == "more than max_new_tokens":
        return answer_chunks([2, 5, 12])  # read with max_new_tokens 10
    elif kind == "completion_tokens off":
        middle["meta_info"]["completion_tokens"] = 6  # fits neither style (7 would read as incremental)
    elif kind == "output_ids disagree":
        middle["output_ids"] = [1, 2, 3, 4, 5]
    elif kind == "style switch":
        chunks = answer_chunks([2, 5, 12])
        chunks[2] = chunk(12, 5, {"type": "length", "length": 12}, incremental=True)
        chunks.insert(2, chunk(9))  # cumulative, then an incremental one
        chunks[3] = chunk(12, 9, {"type": "length", "length": 12}, incremental=True)
    elif kind == "no completion_tokens":
        del middle["meta_info"]["completion_tokens"]
    elif kind == "unknown finish reason":
        chunks[2]["meta_info"]["finish_reason"] = {"type": "exploded"}
    elif kind == "a chunk after the final one":
        chunks.append(chunk(12, finish={"type": "length", "length": 12}))
    elif kind == "not JSON":
        chunks[1] = b"{\"text\": \"ab"
    elif kind == "no log-probs before the end":
        del middle["meta_info"]["output_token_logprobs"]
    return chunks


BAD = {  # what is wrong -> (what the error says, the tokens kept: those of the chunks before the bad one)
    "id outside the vocabulary": ("token id 70000, outside the vocabulary of 256", 2),
    "log-prob not finite": ("not a finite float32", 2),
    "more than max_new_tokens": ("12 output tokens, more than the 10 asked for", 5),
    "completion_tokens off": ("neither all 6 tokens so far", 2),
    "output_ids disagree": ("output_ids .5 ids. disagree", 2),
    "style switch": ("a chunk of incremental tokens in a stream of cumulative ones", 9),
    "no completion_tokens": ("cannot be told", 2),
    "unknown finish reason": ("unknown finish_reason", 5),
    "a chunk after the final one": ("a chunk after the final one", 12),
    "not JSON": ("not JSON", 2),
    "no log-probs before the end": ("without output_token_logprobs", 2),
}


@pytest.mark.parametrize("large", [False, True], ids=["parsed-whole", "cut"])
@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_chunk_is_refused_and_the_tokens_before_it_are_kept(kind, large):
    max_new_tokens = 10 if kind == "more than max_new_tokens" else 20
    chunks = _bad(kind)
    if large:  # past the size from which a chunk's arrays are cut out of its text
        chunks = [c | {"text": "y" * 5000} if isinstance(c, dict) and "meta_info" in c else c for c in chunks]
    seen, error = stream_of(events(chunks), max_new_tokens=max_new_tokens, vocab_size=256)
    says, kept = BAD[kind]
    assert isinstance(error, EngineProtocolError), error
    assert re.search(says, str(error)), str(error)
    assert error.partial.output_ids == IDS[:kept] and error.partial.output_log_probs == LPS[:kept]
    assert (error.partial.result is None) == (kind != "a chunk after the final one")


@pytest.mark.parametrize("code, cls", [(None, EngineRequestError), (400, EngineRequestError),
                                       (503, EngineUnavailable)])
def test_an_error_chunk_is_the_status_it_names(code, cls):
    err = {"message": "Requested token count exceeds the context length"} | ({"code": code} if code else {})
    seen, error = stream_of(events([chunk(3), {"error": err}]))
    assert type(error) is cls and "exceeds the context length" in str(error)
    assert error.partial.output_ids == IDS[:3]


@pytest.mark.parametrize("status, cls", [(400, EngineRequestError), (503, EngineUnavailable)])
def test_an_http_error_before_the_stream_is_what_it_is_without_one(status, cls):
    body = json.dumps({"error": {"message": "nope"}}).encode()
    seen, error = stream_of(body, content_type="application/json", status=status)
    assert type(error) is cls and error.status == status and error.partial.output_ids == []


def test_an_event_larger_than_an_answer_is_refused_while_it_is_read():
    body = b"data: {\"text\": \"" + b"x" * (2 << 20) + b"\"}\n\n"
    seen, error = stream_of(body, max_new_tokens=8, piece=1 << 16)
    assert isinstance(error, EngineProtocolError) and "over" in str(error)


def test_endless_chunks_without_tokens_are_refused():
    chunks = [chunk(2)] * (MAX_IDLE_CHUNKS + 3)
    seen, error = stream_of(events(chunks))
    assert isinstance(error, EngineProtocolError) and "without a new token" in str(error)
    assert error.partial.output_ids == IDS[:2]


def test_an_engine_streaming_far_more_often_than_asked_is_named_once(caplog):
    # 23 chunks for 12 tokens: every count but the final one twice.
    chunks = [chunk(n) for n in range(1, 12) for _ in range(2)] + [chunk(12, finish={"type": "length", "length": 12})]
    body = events(chunks)

    async def scenario():
        async with engines(streaming_engine(body)) as (url,):
            client = EngineClient(url)
            try:
                for _ in range(2):
                    async for p in client.generate_stream(PROMPT, {"max_new_tokens": 64}, stream_interval=64):
                        pass
                return p
            finally:
                await client.close()

    with caplog.at_level("WARNING", logger="workers.engine"):
        p = run(scenario())
    assert p.result.output_ids == IDS
    said = [r.getMessage() for r in caplog.records if "streams a chunk every" in r.getMessage()]
    assert len(said) == 1 and "asked for every 64" in said[0] and "--stream-interval 64" in said[0]


def test_the_assembler_alone_reads_chunks_fed_one_by_one():
    a = StreamAssembler("http://e", "r1", max_new_tokens=12)
    for c in answer_chunks([3, 12]):
        a.feed(json.dumps(c).encode())
    assert a.progress.result.output_ids == IDS and a.progress.chunks == 2


# -- through EngineSet and the real router ---------------------------------------------------------


def test_an_engine_set_that_streams_returns_what_it_would_return_whole():
    sim = start_simulator(SimConfig(seed=2, decode_tokens_per_s=1000.0, length_median=80.0, length_p99=200.0))

    async def scenario():
        whole_set, streaming_set = EngineSet([sim.url]), EngineSet([sim.url], stream=True, stream_interval=4)
        try:
            params = {"max_new_tokens": 100, "sampling_seed": 4}
            return await whole_set.generate(PROMPT, params, rid="a"), await streaming_set.generate(PROMPT, params,
                                                                                                  rid="b")
        finally:
            await whole_set.close()
            await streaming_set.close()

    try:
        whole, streamed = run(scenario())
    finally:
        sim.stop()
    assert (streamed.output_ids, streamed.output_log_probs, streamed.finish_type) == \
        (whole.output_ids, whole.output_log_probs, whole.finish_type)


@pytest.mark.slow
def test_a_stream_through_the_real_router_reads_like_one_from_the_engine(tmp_path):
    sims = [start_simulator(SimConfig(seed=7, decode_tokens_per_s=300.0, length_median=64.0, length_p99=128.0))
            for _ in range(2)]  # the same seed: the router may pick either
    router = RouterProcess([s.url for s in sims], str(tmp_path / "router.log"), ["--policy", "round_robin"])
    try:
        router.wait_ready([s.url for s in sims])
        params = {"max_new_tokens": 60, "sampling_seed": 3, "ignore_eos": True}

        async def scenario():
            client = EngineClient(router.url)
            try:
                count = 0
                async for p in client.generate_stream(PROMPT, params, rid="routed"):
                    count += 1
                return p, count
            finally:
                await client.close()

        progress, yielded = run(scenario())
        whole = run(_whole(sims[0].url, params))
    finally:
        router.stop()
        for s in sims:
            s.stop()
    # sglang-router 0.3.x forwards the chunks as they come (it drops sampling_params.stream_interval:
    # behind a router the engines' --stream-interval decides).
    assert yielded >= 2 and progress.result.output_ids == whole.output_ids
    assert progress.result.output_log_probs == whole.output_log_probs and progress.result.rid == "routed"


# -- a worker that streams ---------------------------------------------------------------------


def test_a_worker_that_streams_trains_the_same_tokens_as_one_that_does_not(redis_url, client):
    sim = start_simulator(SimConfig(seed=4, decode_tokens_per_s=3000.0, length_median=40.0, length_p99=200.0,
                                    incremental_streaming_output=False))
    trained = {}
    try:
        for stream in (False, True):
            namespace = f"stream-{stream}-{os.getpid()}-{time.monotonic_ns()}"
            queue = Queue(client, namespace)
            queue.push_groups([Group.fresh(f"g{i}", f"What is {i} + 2?", 4, label=str(i + 2), dataset="d", row=i)
                               for i in range(12)])
            worker = WorkerThread(WorkerSettings(
                redis_url=redis_url, engine_urls=[sim.url], namespace=namespace, heartbeat_s=0.5,
                sampling=SamplingSettings(max_new_tokens=150), stream=stream, stream_interval=4))
            try:
                got = consume_all(Consumer(client, namespace), 12, 4)
            finally:
                worker.stop()
            assert audit(queue).ok
            trained[stream] = {g.group_id: [(s.tokens, s.rollout_log_probs, s.status) for s in g.samples]
                               for g in got}
    finally:
        sim.stop()
    assert trained[True] == trained[False]


def test_the_simulator_sends_a_chunk_every_stream_interval_tokens():
    sim = start_simulator(SimConfig(seed=6, decode_tokens_per_s=100.0, length_median=300.0, length_p99=600.0,
                                    stream_interval_s=0.005))

    async def counts(interval: int | None) -> list[int]:
        client = EngineClient(sim.url)
        try:
            return [len(p.output_ids) async for p in client.generate_stream(
                PROMPT, {"max_new_tokens": 60, "ignore_eos": True}, stream_interval=interval)]
        finally:
            await client.close()

    try:
        every_token, every_ten = run(counts(1)), run(counts(10))
    finally:
        sim.stop()
    assert every_token[-1] == every_ten[-1] == 60
    # As SGLang: the first tokens at once, then a chunk per `interval` tokens at least (the stream
    # is looked at on its pace, so a busy machine makes chunks larger, never smaller).
    assert every_ten[0] < 10 and all(b - a >= 10 for a, b in zip(every_ten[:-2], every_ten[1:-1]))
    assert len(every_ten) <= 8 < len(every_token)
