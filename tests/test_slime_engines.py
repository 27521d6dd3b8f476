"""slime drives the engines the workers share (issue 27).

slime's weight updaters call each engine's `/pause_generation` with an empty body (mode
`abort`), flush the cache, `/update_weights_from_disk` with the next version, then
`/continue_generation`, without telling the queue (slime/ray/actor_group.py
`_reload_rollout_weights_from_disk`, slime/backends/sglang_utils/sglang_engine.py); its
default rollout ends every rollout with `/abort_request {"abort_all": true}` until
`/v1/loads` shows no request (slime/backends/sglang_utils/server_control.py). The
helpers below make exactly those calls, against a simulator and a torch engine that one
worker generates on, while the adapter is driven in train_async.py's order.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.ops.audit import audit
from pipeline.trainers import slime_adapter as sa
from pipeline.trainers import slime_engines as sa_engines
from pipeline.trainers import slime_types
from pipeline.types import Group, parse_version
from tests import fake_slime
from tests.fake_slime_rollout import num_requests_from_load
from tests.helpers import WorkerThread, http_call, wait_for
from workers.sampling import SamplingSettings
from workers.settings import WorkerSettings

torch = pytest.importorskip("torch")
from engines.byte_lm import ByteLM, ModelConfig, save_checkpoint  # noqa: E402
from engines.simulator import SimConfig, start_simulator  # noqa: E402
from engines.torch_engine import TorchEngineConfig, start_torch_engine  # noqa: E402

MAX_NEW = 48
#: slime/backends/sglang_utils/server_control.py ABORT_RETRY_INTERVAL_SECONDS
ABORT_RETRY_INTERVAL_S = 3.0
MODEL = ModelConfig(context_length=128)
# Requests that last long enough (~0.1-0.3 s) for a pause or an abort to land mid-generation.
SIM = dict(decode_tokens_per_s=200.0, length_median=30.0, length_p99=48.0, prefill_s=0.002)


def slime_update_weights(urls: list[str], version: int, model_path: str) -> None:
    """RayTrainGroup._reload_rollout_weights_from_disk, over HTTP."""
    for url in urls:
        assert http_call(url, "/pause_generation", {})[0] == 200  # SGLangEngine.pause_generation: json={}
    for url in urls:
        http_call(url, "/flush_cache", method="POST")  # slime flushes; SGLang may refuse while busy
    for url in urls:
        status, body = http_call(url, "/update_weights_from_disk",
                                 {"model_path": model_path, "weight_version": str(version)}, timeout=60)
        assert status == 200 and body["success"], body
    for url in urls:
        assert http_call(url, "/continue_generation", {})[0] == 200


def slime_abort_until_idle(urls: list[str]) -> None:
    """server_control.abort_server_until_idle: abort all, read the load, again until idle,
    ABORT_RETRY_INTERVAL_SECONDS apart (a faster loop than slime's aborts a resubmitted
    request before it could make progress, which no slime run does)."""
    def abort_once_and_idle(url: str) -> bool:
        http_call(url, "/abort_request", {"abort_all": True})
        return num_requests_from_load(http_call(url, "/v1/loads?include=core")[1]) == 0

    for url in urls:
        wait_for(lambda: abort_once_and_idle(url), interval=ABORT_RETRY_INTERVAL_S, what=f"{url} idle after abort_all")


def version_number(version: str) -> int:
    """slime numbers its weights 1, 2, ...; the engines start at "default" (before slime's first push)."""
    return 0 if version == "default" else parse_version(version)


@pytest.fixture
def engines(tmp_path):
    torch.set_num_threads(1)
    checkpoint = save_checkpoint(ByteLM(MODEL), tmp_path / "weights.pt")
    sim = start_simulator(SimConfig(seed=3, **SIM))
    with start_torch_engine(TorchEngineConfig(seed=0, model=MODEL, max_running_requests=8, min_step_s=0.005)) as te:
        try:
            yield [sim.url, te.url], str(checkpoint)
        finally:
            sim.stop()


def test_slime_weight_updates_and_rollout_aborts_are_preemptions_not_faults(engines, redis_url, queue, namespace,
                                                                            monkeypatch, caplog):
    """10 rollouts in train_async.py's order, slime's weight update after each and its
    abort_all at each rollout's end, on the engines the worker generates on: no dead
    letter, no engine error, every continued sample's tokens stamped with the versions
    that produced them (masked when off-policy masking is on), and the audit adds up."""
    fake_slime.install(monkeypatch)
    slime_types.slime_types.cache_clear()
    urls, checkpoint = engines
    batch, rollouts = 2, 10
    queue.push_groups([Group.fresh(f"g{i}", f"lower: {i} plus {i}", 2, label=str(2 * i), row=i)
                       for i in range((rollouts + 4) * batch)])
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=urls, namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=MAX_NEW), heartbeat_s=0.2,
                                         concurrency_per_engine=4, mask_offpolicy_prefix=True))
    args = SimpleNamespace(rollout_batch_size=batch, n_samples_per_prompt=2, reward_key=None,
                           rollout_redis_url=redis_url, rollout_namespace=namespace,
                           rollout_max_response_len=MAX_NEW, rollout_batch_timeout=120,
                           rollout_external_engine_addrs=[u.removeprefix("http://") for u in urls])
    read_at: list[tuple[int, list]] = []  # (slime's version when the rollout was read, its groups)
    lags = []
    try:
        source = sa.RedisDataSource(args)  # RolloutManager.__init__: load_function(args.data_source_path)(args)
        source.load(-1)  # placement_group.create_training_models: rollout_manager.load(start_rollout_id - 1)
        version = 1
        slime_update_weights(urls, version, checkpoint)  # train_async: actor_model.update_weights() first

        def generate(rollout_id: int) -> None:  # RolloutManager.generate
            fake_slime.set_current_rollout_id(rollout_id)
            out = sa.generate_rollout(args, rollout_id, source)
            read_at.append((version, out.samples))
            lags.append(out.metrics["rollout/queue/engine_version_lag"])
            assert out.metrics["rollout/queue/foreign_engine_workers"] == 0
            slime_abort_until_idle(urls)  # slime's default rollout ends each rollout so

        generate(0)
        for rollout_id in range(rollouts):
            if rollout_id + 1 < rollouts:
                generate(rollout_id + 1)  # the next rollout starts before this one trains
            # (train rollout_id; no --save-interval: no save)
            version += 1
            slime_update_weights(urls, version, checkpoint)  # --update-weights-interval 1
        source.commit_pending()
        counters = worker.worker.ctx.counters
        assert counters.engine_errors == 0 and counters.groups_dead == 0 and counters.preempted > 0, counters
    finally:
        worker.stop()
    assert queue.redis.xlen(queue.keys.dead) == 0
    continued = 0
    for slime_version, groups in read_at:
        for group in groups:
            for s in group:
                segments = s.metadata["rollout_segments"]
                assert len(segments) == len(s.weight_versions) and sum(segments) == s.response_length
                numbers = [version_number(v) for v in s.weight_versions]
                assert numbers == sorted(numbers) and numbers[-1] <= slime_version, (s.weight_versions,
                                                                                    slime_version)
                # --mask-offpolicy-in-partial-rollout: tokens of earlier weights are masked
                assert s.loss_mask == [int(v == s.weight_versions[-1]) for v, n in
                                       zip(s.weight_versions, segments) for _ in range(n)]
                continued += len(segments) > 1
    assert continued > 0  # some samples were preempted mid-generation and continued
    # The engines slime updates are the ones the samples came from: no lag alert.
    assert max(lags) <= sa_engines.DEFAULT_VERSION_LAG, lags
    assert "slime's engines are at" not in caplog.text
    report = audit(queue)
    assert report.ok, report


def slime_args(redis_url: str, namespace: str, engines: list[str], **kw) -> SimpleNamespace:
    return SimpleNamespace(rollout_batch_size=1, n_samples_per_prompt=2, reward_key=None, rollout_redis_url=redis_url,
                           rollout_namespace=namespace, rollout_max_response_len=MAX_NEW, rollout_batch_timeout=60,
                           rollout_external_engine_addrs=engines, **kw)


@pytest.fixture
def two_sims():
    sims = [start_simulator(SimConfig(seed=5 + i, **SIM)) for i in range(2)]
    try:
        yield [s.url for s in sims]
    finally:
        for s in sims:
            s.stop()


def test_workers_on_engines_slime_does_not_update_are_refused_at_start(two_sims, redis_url, queue, namespace,
                                                                        monkeypatch):
    fake_slime.install(monkeypatch)
    slime_types.slime_types.cache_clear()
    ours, slimes = two_sims
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[ours], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=MAX_NEW), heartbeat_s=0.2))
    try:
        with pytest.raises(sa.SlimeConfigError, match=f"worker {worker.worker.ctx.id} on {ours}.*slime updates "
                                                      f"{slimes}.*--engine-url"):
            sa.RedisDataSource(slime_args(redis_url, namespace, [slimes.removeprefix("http://")]))
        # On slime's engines (here the same simulator under another name), it starts.
        sa.RedisDataSource(slime_args(redis_url, namespace, [ours.replace("127.0.0.1", "localhost")]))
    finally:
        worker.stop()


def test_a_batch_far_behind_slimes_weight_version_is_reported(two_sims, redis_url, queue, namespace, monkeypatch,
                                                             caplog):
    """Workers that generated on engines slime never updated: their samples carry
    "default" while slime's engines are at version 20 (slime's router list is the check's
    only knowledge of them, and the workers are gone: only versions can tell)."""
    fake_slime.install(monkeypatch)
    slime_types.slime_types.cache_clear()
    ours, slimes = two_sims
    queue.push_groups([Group.fresh("g0", "lower: 1 plus 1", 2, label="2", row=0)])
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[ours], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=MAX_NEW), heartbeat_s=0.2))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.results) == 1, what="the group generated")
    finally:
        worker.stop()
    http_call(slimes, "/update_weight_version", {"new_version": "20"})
    source = sa.RedisDataSource(slime_args(redis_url, namespace, [slimes.removeprefix("http://")],
                                           rollout_max_staleness=2))
    out = sa.generate_rollout(source.args, 0, source)
    assert out.metrics["rollout/queue/engine_version_lag"] == 20
    assert "generated with weight version 0, slime's engines are at 20" in caplog.text


def test_slimes_engines_are_read_from_its_router(two_sims, redis_url, queue, namespace, monkeypatch, tmp_path):
    """Without --rollout-external-engine-addrs the adapter lists slime's engines behind
    --sglang-router-ip/port (the real sglang-router's /workers): workers on the router or
    on an engine behind it start; a worker on another engine is refused."""
    from tests.helpers import RouterProcess

    fake_slime.install(monkeypatch)
    slime_types.slime_types.cache_clear()
    behind, other = two_sims
    def worker_on(url: str) -> WorkerThread:
        return WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[url], namespace=namespace,
                                           sampling=SamplingSettings(max_new_tokens=MAX_NEW), heartbeat_s=0.2))

    router = RouterProcess([behind], str(tmp_path / "router.log"))
    workers: list[WorkerThread] = []
    try:
        router.wait_ready([behind])
        args = slime_args(redis_url, namespace, None, sglang_router_ip="127.0.0.1", sglang_router_port=router.port)
        assert sorted(sa_engines.slime_engine_urls(args)) == sorted([behind, router.url])
        workers += [worker_on(router.url), worker_on(behind)]
        sa.RedisDataSource(args)
        workers.append(worker_on(other))
        with pytest.raises(sa.SlimeConfigError, match=f"on {other}"):
            sa.RedisDataSource(args)
    finally:
        for w in workers:
            w.stop()
        router.stop()


def test_a_worker_on_a_namespace_slime_owns_says_what_is_wrong_not_rollout_resume(two_sims, redis_url, queue,
                                                                                 namespace, caplog):
    """Issue 30 (11): on the queue's clock the slime adapter owns the version. A worker on
    slime's engine (at its weight version 7, ahead of rollout 3) is not told to bump the
    queue's version with `rollout resume --weight-version`; a worker on an engine still on
    its initial weights past rollout 0 is told slime does not update it, and what to do."""
    from pipeline.control import configure, set_weight_version
    from pipeline.types import VersionClock

    slimes, foreign = two_sims
    http_call(slimes, "/update_weight_version", {"new_version": "7"})
    configure(queue.redis, queue.keys, version_clock=VersionClock.QUEUE)
    set_weight_version(queue.redis, queue.keys, 3)
    for i, url in enumerate((slimes, foreign)):
        queue.push_groups([Group.fresh(f"g{i}", f"lower: {i} plus {i}", 2, label=str(2 * i), row=i)])
        worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[url], namespace=namespace,
                                             sampling=SamplingSettings(max_new_tokens=MAX_NEW), heartbeat_s=0.2))
        try:
            wait_for(lambda: queue.redis.xlen(queue.keys.results) == i + 1, what=f"group g{i} generated on {url}")
        finally:
            worker.stop()
    assert "rollout resume --weight-version" not in caplog.text
    assert f"engine {foreign} still serves its initial weights (weight version 'default') while the slime " \
           f"adapter that owns this namespace's version is at rollout 3" in caplog.text
    assert f"engine {slimes} still serves" not in caplog.text


def test_a_sample_aborted_at_its_last_token_is_masked_when_it_is_continued(two_sims, redis_url, queue, namespace):
    """An abort that lands with the last allowed token: the sample comes back (a released
    partial group) with nothing left to generate and is truncated without a request. With
    off-policy masking its older segment must still be masked: it was trained unmasked
    (loss_mask None), which is how tests of slime's weight updates saw it now and then."""
    from pipeline.codec import decode_group
    from pipeline.types import SEGMENTS_KEY, Status

    sim, _ = two_sims
    group = Group.fresh("g0", "lower: 1 plus 1", 2, label="2", row=0)
    group.prompt_ids = [1, 2, 3]
    for s in group.samples:  # 3 tokens under version 1, then 5 under version 2: MAX_NEW in all
        s.tokens = [1, 2, 3] + [65] * MAX_NEW
        s.response_length, s.response = MAX_NEW, "A" * MAX_NEW
        s.rollout_log_probs = [-0.5] * MAX_NEW
        s.weight_versions, s.metadata[SEGMENTS_KEY] = ["1", "2"], [3, MAX_NEW - 3]
        s.status = Status.ABORTED
    queue.push_groups([group])
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=MAX_NEW), heartbeat_s=0.2,
                                         mask_offpolicy_prefix=True))
    try:
        wait_for(lambda: queue.redis.xlen(queue.keys.results) == 1, what="the group published")
    finally:
        worker.stop()
    entry = queue.read_stream(queue.keys.results)[0]
    for s in decode_group(entry.data).samples:
        assert s.status == Status.TRUNCATED and s.response_length == MAX_NEW
        assert s.loss_mask == [0] * 3 + [1] * (MAX_NEW - 3)
