"""pipeline.trainers.slime_adapter: slime's rollout function and data source over the queue,
with the stand-in types (slime not installed) and with the stand-in `slime` package
(tests/fake_slime.py) in sys.modules, against a real redis-server."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import fields
from types import SimpleNamespace

import pytest

from pipeline.trainers import slime_adapter as sa
from pipeline.trainers import slime_types as st
from pipeline.ops.audit import audit
from pipeline.codec import decode_group
from pipeline.consumer import BatchMetrics
from pipeline.control import configure, read_control
from pipeline.filters import DynamicFilterOutput
from pipeline.queue import ClaimStatus, Place
from pipeline.trainers.slime_checks import SamplingMismatch, SlimeConfigError
from pipeline.trainers.slime_metrics import slime_metrics
from pipeline.types import Group, Sample, SamplingRecord, Status, VersionClock
from tests import fake_slime
from tests.fake_slime import Sample as FakeSlimeSample
from tests.groups import claim, publish

N = 2  # samples per group
PROMPT = [1, 2, 3]
SAMPLING = SamplingRecord(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=64)


@pytest.fixture
def fake_slime_installed(monkeypatch):
    fake_slime.install(monkeypatch)
    st.slime_types.cache_clear()
    yield
    st.slime_types.cache_clear()


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)  # not importable unless a test installs the stand-in
    st.slime_types.cache_clear()
    sa.reset_default_sources()
    yield
    sa.reset_default_sources()
    st.slime_types.cache_clear()


# -- helpers ------------------------------------------------------------------------------


def finished(row: int, rewards: list | None = None, version: int = 0, sampling: SamplingRecord | None = SAMPLING,
             prefix: str = "g") -> Group:
    """Group `g<row>`: sample i has 1 + i + row % 3 response tokens 100*row + 10*i + k."""
    group = Group.fresh(f"{prefix}{row}", f"prompt {row}", N, label=str(row), row=row)
    group.prompt_ids = list(PROMPT)
    group.sampling, group.worker = sampling, "w"
    for i, s in enumerate(group.samples):
        n = 1 + i + row % 3
        s.tokens = PROMPT + [100 * row + 10 * i + k for k in range(n)]
        s.response_length = n
        s.response = "x" * n
        s.rollout_log_probs = [-(k + 1) / 4 for k in range(n)]
        s.loss_mask = [1] * n
        s.weight_versions = [str(version)]
        s.reward = (rewards or [float(i)] * N)[i]
        s.status = Status.TRUNCATED if i == N - 1 else Status.COMPLETED
    return group


def publish_results(queue, rows: list[int], keep_response_text: bool = False, **kwargs) -> list[Group]:
    """Push, claim and publish finished groups, in the order given."""
    groups = [finished(r, **kwargs) for r in rows]
    queue.push_groups([Group.fresh(g.group_id, g.samples[0].prompt, N, row=g.row) for g in groups])
    claimed = claim(queue, "w", len(groups))
    assert [c.group_id for c in claimed.groups] == [g.group_id for g in groups]
    for c, g in zip(claimed.groups, groups):
        g.admitted_version = c.group.admitted_version
        assert publish(queue, "w", g, Place.RESULTS, keep_response_text=keep_response_text)
    return groups


def make_args(redis_url: str, namespace: str, **kwargs) -> SimpleNamespace:
    return SimpleNamespace(rollout_batch_size=2, n_samples_per_prompt=N, rollout_redis_url=redis_url,
                           rollout_namespace=namespace, reward_key=None, **kwargs)


def rows_of(groups: list[list]) -> list[int]:
    return [g[0].group_index for g in groups]


def committed(queue) -> int:
    return queue.stats().get("committed", 0)


def read_records(queue) -> int:
    """Entries the adapter recorded as read and not committed (not the checkpoint records)."""
    checkpoint = sa.CHECKPOINT_FIELD.encode()
    return sum(1 for k in queue.redis.hkeys(queue.keys.slime_rollouts) if not k.startswith(checkpoint))


# -- types (item 6) -------------------------------------------------------------------------


def test_stand_in_types_without_slime():
    t = st.slime_types()
    assert not t.real and t.version is None
    assert (t.sample, t.train_output, t.eval_output) == (Sample, st.RolloutFnTrainOutput, st.RolloutFnEvalOutput)
    assert [f.name for f in fields(st.RolloutFnTrainOutput)] == ["samples", "metrics"]
    assert [f.name for f in fields(st.RolloutFnEvalOutput)] == ["data", "metrics"]
    s = finished(1).samples[0]
    assert st.to_slime_sample(s) is s


def test_slime_types_are_used_and_convert_both_ways(fake_slime_installed):
    t = st.slime_types()
    assert t.real and t.sample is FakeSlimeSample and t.train_output is fake_slime.RolloutFnTrainOutput
    assert t.version == st.MIN_DATA_SOURCE  # a source checkout: told by its modules
    ours = finished(4).samples[1]
    theirs = st.to_slime_sample(ours)
    assert isinstance(theirs, FakeSlimeSample) and theirs.status is FakeSlimeSample.Status.TRUNCATED
    assert theirs.rollout_id is None and theirs.rollout_top_p_token_ids is None  # slime's defaults
    for name in ("group_index", "index", "prompt", "label", "tokens", "response_length", "response",
                 "reward", "loss_mask", "rollout_log_probs", "weight_versions", "metadata"):
        assert getattr(theirs, name) == getattr(ours, name), name
    back = st.from_slime_sample(theirs)
    assert back == ours and back.status is Status.TRUNCATED


def test_a_broken_slime_import_is_raised_not_replaced(monkeypatch):
    fake_slime.install(monkeypatch)
    del sys.modules["slime.rollout.base_types"].RolloutFnTrainOutput  # a slime older than 0.2.0
    st.slime_types.cache_clear()
    with pytest.raises(st.SlimeImportError, match="slime >= 0.2.0.*RolloutFnTrainOutput|RolloutFnTrainOutput"):
        st.slime_types()


def test_slime_too_old_for_the_data_source_is_refused(monkeypatch, redis_url, namespace):
    fake_slime.install(monkeypatch)
    monkeypatch.setattr(st, "_version", lambda: (0, 2, 0))
    st.slime_types.cache_clear()
    args = make_args(redis_url, namespace, rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
                     over_sampling_batch_size=2)
    with pytest.raises(RuntimeError, match="needs slime >= 0.2.1; this is slime 0.2.0"):
        sa.RedisDataSource(args)
    assert sa.RedisDataSource(make_args(redis_url, namespace)).types.version == (0, 2, 0)  # our rollout: 0.2.0


def test_metrics_have_slime_style_keys():
    m = BatchMetrics(kept=6, dropped={"all rewards equal": 3, "stale": 1}, restarted=2, dead=1, duplicates=0,
                     kept_insufficient=1, wait_s=1.5, staleness={0: 4, 2: 2})
    out = slime_metrics(m, weight_version=7)
    assert out["rollout/queue/kept"] == 6 and out["rollout/queue/dropped"] == 4
    assert out["rollout/queue/drop_ratio"] == pytest.approx(0.4)
    assert out["rollout/dynamic_filter/drop_all_rewards_equal"] == 3
    assert out["rollout/queue/drop_stale"] == 1 and out["rollout/queue/kept_when_insufficient"] == 1
    assert out["rollout/queue/restarted"] == 2 and out["rollout/queue/dead"] == 1
    assert out["rollout/queue/wait_time"] == 1.5 and out["rollout/queue/weight_version"] == 7
    assert out["rollout/queue/staleness/0"] == 4 and out["rollout/queue/staleness/2"] == 2
    assert out["rollout/queue/staleness_mean"] == pytest.approx(4 / 6) and out["rollout/queue/staleness_max"] == 2


def test_settings_from_args_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLOUT_REDIS_URL", "redis://env-host:6379")
    monkeypatch.setenv("ROLLOUT_NAMESPACE", "envns")
    s = sa.QueueSettings.from_args(SimpleNamespace())
    assert (s.redis_url, s.namespace, s.consumer, s.timeout, s.max_staleness) == (
        "redis://env-host:6379", "envns", "trainer", None, None)
    s = sa.QueueSettings.from_args(SimpleNamespace(rollout_redis_url="redis://args:1", rollout_namespace="a",
                                                   rollout_consumer="t2", rollout_batch_timeout=5,
                                                   rollout_max_staleness=1, rollout_filter_fallback_wait=2,
                                                   rollout_replicas=1))
    assert (s.redis_url, s.namespace, s.consumer, s.timeout, s.max_staleness, s.fallback_wait_s, s.replicas) == (
        "redis://args:1", "a", "t2", 5, 1, 2.0, 1)
    with pytest.raises(ValueError, match="rollout_commit_lag is gone"):
        sa.QueueSettings.from_args(SimpleNamespace(rollout_commit_lag=2))
    monkeypatch.delenv("ROLLOUT_REDIS_URL")
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path))  # no local stack registered there
    with pytest.raises(ValueError, match="ROLLOUT_REDIS_URL"):
        sa.QueueSettings.from_args(SimpleNamespace())


# -- the rollout function ----------------------------------------------------------------------


def test_generate_rollout_with_slime(fake_slime_installed, queue, redis_url, namespace):
    published = {g.row: g for g in publish_results(queue, [3, 1, 4, 0, 5, 2])}
    args = make_args(redis_url, namespace)

    out = sa.generate_rollout(args, 0, data_source=None)
    assert isinstance(out, fake_slime.RolloutFnTrainOutput)
    assert rows_of(out.samples) == [1, 3]  # stream order was 3, 1: sorted by index
    assert [s.index for g in out.samples for s in g] == [2, 3, 6, 7]
    for group in out.samples:
        ours = published[group[0].group_index]
        for theirs, mine in zip(group, ours.samples):
            assert isinstance(theirs, FakeSlimeSample)
            assert theirs.tokens == mine.tokens and theirs.tokens[:3] == PROMPT
            assert theirs.response_length == mine.response_length == len(theirs.tokens) - 3
            assert (theirs.rollout_log_probs, theirs.loss_mask, theirs.reward) == (
                mine.rollout_log_probs, mine.loss_mask, mine.reward)
            assert theirs.weight_versions == ["0"] and theirs.prompt == mine.prompt
        assert [s.status for s in group] == [FakeSlimeSample.Status.COMPLETED, FakeSlimeSample.Status.TRUNCATED]
    fake_slime.convert_samples_to_train_data(args, [s for g in out.samples for s in g])
    assert out.metrics["rollout/queue/kept"] == 2 and out.metrics["rollout/queue/staleness/0"] == 2
    control = read_control(queue.redis, queue.keys)
    assert control.version_clock == VersionClock.QUEUE and control.weight_version == 0

    # No checkpoints: a batch is committed two rollouts later (its step ran, train_async.py too).
    assert rows_of(sa.generate_rollout(args, 1, None).samples) == [0, 4]
    assert committed(queue) == 0 and read_control(queue.redis, queue.keys).weight_version == 1
    assert rows_of(sa.generate_rollout(args, 2, None).samples) == [2, 5]
    assert committed(queue) == 2
    assert audit(queue).ok, audit(queue).summary()


def test_generate_rollout_with_stand_in_types(queue, redis_url, namespace):
    publish_results(queue, [2, 1])
    out = sa.generate_rollout(make_args(redis_url, namespace), 0, data_source=None)
    assert isinstance(out, st.RolloutFnTrainOutput) and rows_of(out.samples) == [1, 2]
    sample = out.samples[0][1]
    assert isinstance(sample, Sample) and sample.status is Status.TRUNCATED
    assert sample.tokens == finished(1).samples[1].tokens


def test_checkpoints_need_our_data_source(redis_url, namespace):
    args = make_args(redis_url, namespace, save="/ckpt", save_interval=5)
    with pytest.raises(SlimeConfigError, match="--data-source-path pipeline.trainers.slime_adapter.RedisDataSource"):
        sa.generate_rollout(args, 0, data_source=object())


def test_rollout_replicas_makes_the_source_wait_for_replicas(redis_url, namespace):
    """Behind Sentinel: the data source's consumer (commits, deliveries, session starts,
    weight versions) waits for the replica (tests/test_sentinel.py tests the waiting)."""
    assert sa.RedisDataSource(make_args(redis_url, namespace)).consumer.durability.replicas == 0
    assert sa.RedisDataSource(make_args(redis_url, namespace, rollout_replicas=1)).consumer.durability.replicas == 1


def test_commits_follow_checkpoints_in_train_async_order(queue, redis_url, namespace):
    """train_async.py reads rollout k+1 before training k, and saves k after: save(k)
    commits rollouts up to k only."""
    publish_results(queue, list(range(8)))
    args = make_args(redis_url, namespace, save="/ckpt", save_interval=1)
    source = sa.RedisDataSource(args)
    source.load(-1)
    sa.generate_rollout(args, 0, source)
    sa.generate_rollout(args, 1, source)  # read before step 0 trains
    assert committed(queue) == 0
    source.save(0)
    assert committed(queue) == 2 and source.pending_batches == 1
    sa.generate_rollout(args, 2, source)
    source.save(1)
    assert committed(queue) == 4
    assert read_records(queue) == 2  # rollout 2's entries, until committed
    assert source.commit_pending() == 2 and read_records(queue) == 0
    assert audit(queue).ok, audit(queue).summary()


def test_async_save_commits_a_checkpoint_once_megatron_has_finished_writing_it(queue, redis_url, namespace):
    """Issue 27: with --async-save, slime's save_model finalizes the previous checkpoint
    before it starts writing this one, and writes the last one synchronously: save(k)
    commits the batches of the previous save, and the last save its own."""
    publish_results(queue, list(range(8)))
    args = make_args(redis_url, namespace, save="/ckpt", save_interval=1, async_save=True, num_rollout=4)
    source = sa.RedisDataSource(args)
    source.load(-1)
    done = []
    for rollout_id in range(4):
        sa.generate_rollout(args, rollout_id, source)
        source.save(rollout_id)
        done.append(committed(queue))
    assert done == [0, 2, 4, 8] and audit(queue).ok, audit(queue).summary()


def test_without_checkpoints_the_user_chooses_when_batches_are_committed(queue, redis_url, namespace):
    """Issue 27: without --save-interval a batch is committed two rollouts later (its step
    has run under train.py and train_async.py alike), so a run's last two batches stay
    for the next run; with rollout_commit_on_read each batch is committed as it is read."""
    publish_results(queue, list(range(12)))
    default = sa.RedisDataSource(make_args(redis_url, namespace))
    for rollout_id in range(3):
        default.read_rollout(rollout_id, 2)
    assert committed(queue) == 2 and default.pending_batches == 2
    default.close()
    args = make_args(redis_url, namespace, rollout_commit_on_read=True, rollout_consumer="second")
    on_read = sa.RedisDataSource(args)
    on_read.read_rollout(0, 2)  # the first session's batches come first
    assert on_read.pending_batches == 0 and committed(queue) == 4
    with pytest.raises(SlimeConfigError, match="rollout_commit_on_read is for runs without checkpoints"):
        sa.RedisDataSource(make_args(redis_url, namespace, rollout_commit_on_read=True, save="/c", save_interval=1))


#: group_index -> how often a filter saw it (drop_row_1_on_second_sight)
SIGHTS: dict[int, int] = {}


def drop_row_1_on_second_sight(args, samples):
    """A stateful filter, as a random one can be: the Consumer (first sight) keeps group 1,
    slime's own pass over the same group (second sight) drops it."""
    row = samples[0].group_index
    SIGHTS[row] = SIGHTS.get(row, 0) + 1
    return fake_slime.DynamicFilterOutput(keep=not (row == 1 and SIGHTS[row] == 2), reason="second_sight")


def slimes_rollout_args(redis_url, namespace, **kwargs):
    return make_args(redis_url, namespace, rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
                     over_sampling_batch_size=2, dynamic_sampling_filter_path=f"{__name__}.drop_row_1_on_second_sight",
                     rollout_sample_filter_path="pipeline.trainers.slime_adapter.record_trained", save="/ckpt",
                     save_interval=1, **kwargs)


@pytest.mark.parametrize("partial_rollout", [False, True])
def test_a_refill_within_a_rollout_commits_only_the_groups_slimes_rollout_trains(
        fake_slime_installed, queue, redis_url, namespace, monkeypatch, partial_rollout):
    """Issue 27: slime's own filter drops group 1 the queue kept, so slime's rollout reads
    again within rollout 0 (groups 2 and 3), trains 0 and 2 and leaves 3 out. save(0)
    commits those two only; 1 and 3 go back to the queue, are trained in rollout 1 and
    committed by save(1), and batches follow slime's rollout id, not get_samples calls."""
    monkeypatch.setattr(sys.modules[__name__], "SIGHTS", {})
    publish_results(queue, list(range(8)), keep_response_text=True)
    args = slimes_rollout_args(redis_url, namespace, partial_rollout=partial_rollout)
    source = sa.RedisDataSource(args)
    source.load(-1)
    trained = []
    for rollout_id in range(3):
        fake_slime.set_current_rollout_id(rollout_id)
        out = fake_slime.generate_rollout(args, rollout_id, source)
        trained.append(rows_of(out.samples))
        source.save(rollout_id)
        assert committed(queue) == 2 * (rollout_id + 1), trained
    assert trained == [[0, 2], [1, 3], [4, 5]]
    assert read_records(queue) == 0 and source.pending_batches == 0
    assert queue.redis.xlen(queue.keys.results) == 2 and queue.redis.llen(queue.keys.prompts) == 0
    assert audit(queue).ok, audit(queue).summary()


def test_slimes_rollout_with_a_dynamic_filter_needs_the_record_of_what_it_trains(fake_slime_installed, queue,
                                                                                redis_url, namespace):
    """Without record_trained nothing says which groups slime's rollout trains after a
    refill: refused at start, and a refill by another rollout is refused, not committed."""
    args = slimes_rollout_args(redis_url, namespace)
    args.rollout_sample_filter_path = None
    with pytest.raises(SlimeConfigError, match="--rollout-sample-filter-path pipeline.trainers.slime_adapter"):
        sa.RedisDataSource(args)
    publish_results(queue, list(range(4)))
    source = sa.RedisDataSource(make_args(redis_url, namespace, save="/ckpt", save_interval=1))
    source.load(-1)
    fake_slime.set_current_rollout_id(0)
    source.get_samples(2)
    with pytest.raises(SlimeConfigError, match="called again within rollout 0"):
        source.get_samples(2)
    assert committed(queue) == 0 and audit(queue).ok, audit(queue).summary()


def test_load_commits_what_the_saved_checkpoint_trained(queue, redis_url, namespace):
    """The trainer died after saving the model of rollout 1 and before save(1) reached the
    queue: on load(1) the batches of rollouts 0 and 1 are committed, rollout 2's comes back."""
    publish_results(queue, list(range(6)))
    args = make_args(redis_url, namespace, save="/ckpt", save_interval=1)
    source = sa.RedisDataSource(args)
    source.load(-1)
    read = [rows_of(sa.generate_rollout(args, r, source).samples) for r in range(3)]
    assert read == [[0, 1], [2, 3], [4, 5]] and committed(queue) == 0
    source.close()
    restarted = sa.RedisDataSource(args)
    restarted.load(1)
    assert committed(queue) == 4
    assert rows_of(sa.generate_rollout(args, 2, restarted).samples) == [4, 5]
    restarted.save(2)
    assert committed(queue) == 6 and audit(queue).ok, audit(queue).summary()


def test_load_trusts_only_the_run_that_saved_the_checkpoint(queue, redis_url, namespace):
    """Issue 27: a run read rollouts 0 and 1 and died without a checkpoint. Another run
    in the namespace resumes from its own checkpoint 5: the dead run's reads are in no
    checkpoint of it, so they are trained (delivered again), not committed by load(5)."""
    publish_results(queue, list(range(6)))
    args = make_args(redis_url, namespace, save="/ckpt", save_interval=1)
    dead = sa.RedisDataSource(args)
    dead.load(-1)
    assert [rows_of(sa.generate_rollout(args, r, dead).samples) for r in range(2)] == [[0, 1], [2, 3]]
    dead.close()
    other = sa.RedisDataSource(args)
    other.load(5)
    assert committed(queue) == 0
    assert [rows_of(sa.generate_rollout(args, r, other).samples) for r in (6, 7, 8)] == [[0, 1], [2, 3], [4, 5]]
    other.save(8)
    assert committed(queue) == 6 and audit(queue).ok, audit(queue).summary()


def test_wrong_group_size_is_refused(queue, redis_url, namespace):
    publish_results(queue, [0, 1])
    args = make_args(redis_url, namespace)
    args.n_samples_per_prompt = 4
    with pytest.raises(ValueError, match="n_samples_per_prompt=4"):
        sa.generate_rollout(args, 0, None)


def test_timeout_says_why(redis_url, namespace):
    args = make_args(redis_url, namespace, rollout_batch_timeout=0.3)
    with pytest.raises(TimeoutError, match="next_batch\\(2\\) timed out.*prompt list is empty"):
        sa.generate_rollout(args, 0, None)


# -- staleness (item 1) ---------------------------------------------------------------------------


class SlimeEngines:
    """Workers generating against engines whose weights slime updates: slime's updater
    numbers the weights of every run from 1 (π_r is "r + 1" in a run started at 0)."""

    def __init__(self, queue, namespace: str):
        self.queue, self.version, self.rows = queue, 1, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.queue.push_groups([Group.fresh(f"p{self.rows + i}", "p", N, row=self.rows + i) for i in range(2)])
            self.rows += 2
            c = claim(self.queue, "w", 2)
            for x in c.groups:
                g = finished(int(x.group_id[1:]), version=self.version, prefix="p")
                g.admitted_version = x.group.admitted_version
                publish(self.queue, "w", x, group=g)
            if c.status in (ClaimStatus.BUDGET, ClaimStatus.BACKLOG):
                self.stop.wait(0.005)


def test_staleness_follows_slime_for_20_rollouts(fake_slime_installed, queue, redis_url, namespace):
    """η = 1 under slime's train.py loop: generate r, train, update the engines' weights.
    Never blocks, never delivers a group whose tokens come from weights older than π_{r-1}."""
    args = make_args(redis_url, namespace, rollout_max_staleness=1, rollout_batch_timeout=20)
    engines = SlimeEngines(queue, namespace)
    engines.thread.start()
    try:
        source = sa.RedisDataSource(args)
        control = read_control(queue.redis, queue.keys)
        assert (control.max_staleness, control.batch_size) == (1, 2)
        lags = []
        for r in range(20):
            out = sa.generate_rollout(args, r, source)
            generated = [int(s.weight_versions[0]) - 1 for g in out.samples for s in g]  # π index
            lags += [r - pi for pi in generated]
            assert min(out.metrics[k] for k in out.metrics if k.startswith("rollout/queue/staleness/")) >= 0
            engines.version += 1  # update_weights after the step: π_{r+1}
    finally:
        engines.stop.set()
        engines.thread.join()
    assert max(lags) <= 1 and min(lags) >= 0, lags
    assert read_control(queue.redis, queue.keys).weight_version == 19


# -- what slime must not train on (items 3, 5, 9) ---------------------------------------------------


@pytest.mark.parametrize("slime, recorded, flag", [
    ({"rollout_stop": ["</answer>"]}, {}, "--stop '</answer>'"),
    ({"rollout_stop_token_ids": [7, 9]}, {"stop_token_ids": (9,)}, "--stop-token-id 7 --stop-token-id 9"),
    ({"rollout_skip_special_tokens": False}, {"skip_special_tokens": True}, "--keep-special-tokens"),
])
def test_stop_strings_stop_ids_and_special_tokens_are_compared_with_slimes(queue, redis_url, namespace, slime,
                                                                             recorded, flag):
    """Issue 27: stop strings, stop token ids and skip_special_tokens shape what a sample
    is (where it ends, the text its reward reads), and were not compared."""
    publish_results(queue, [0, 1], sampling=SamplingRecord(1.0, 1.0, -1, 64, **recorded))
    with pytest.raises(sa.SamplingMismatch, match=f"start the workers with {re.escape(flag)}"):
        sa.generate_rollout(make_args(redis_url, namespace, **slime), 0, None)


def test_stop_settings_that_match_are_accepted_in_any_order(queue, redis_url, namespace):
    publish_results(queue, [0, 1], sampling=SamplingRecord(1.0, 1.0, -1, 64, ("b", "a"), (9, 7), False))
    args = make_args(redis_url, namespace, rollout_stop=["a", "b"], rollout_stop_token_ids=[7, 9],
                     rollout_skip_special_tokens=False)
    assert len(sa.generate_rollout(args, 0, None).samples) == 2


def test_top_p_other_than_one_is_refused(redis_url, namespace):
    with pytest.raises(SlimeConfigError, match="--rollout-top-p 0.9.*rollout_top_p_token_ids"):
        sa.RedisDataSource(make_args(redis_url, namespace, rollout_top_p=0.9))


def test_over_sampling_with_slimes_rollout_is_refused(redis_url, namespace):
    args = make_args(redis_url, namespace, rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
                     over_sampling_batch_size=6)
    with pytest.raises(SlimeConfigError, match="--over-sampling-batch-size 6 != --rollout-batch-size 2"):
        sa.RedisDataSource(args)
    args.over_sampling_batch_size = 2
    source = sa.RedisDataSource(args)
    with pytest.raises(SlimeConfigError, match="get_samples\\(6\\) but --rollout-batch-size is 2"):
        source.get_samples(6)


@pytest.mark.parametrize("flag, value, advice", [
    ("custom_rm_path", "my.rm", "rollout worker --reward my.rm"),
    ("rm_type", "math", "--reward slime.rollout.rm_hub.async_rm --rm-type math"),
    ("group_rm", True, "--group-reward"),
    ("custom_generate_function_path", "my.gen", "rollout worker --generate-function my.gen"),
    ("rollout_sample_hook_path", ["my.hook"], "--generate-function or --reward"),
    ("rollout_sample_filter_path", "my.filter", "--dynamic-sampling-filter-path"),
    ("rollout_all_samples_process_path", "my.process", "--reward"),
    ("buffer_filter_path", "my.buffer", "--dynamic-sampling-filter-path"),
    ("mask_offpolicy_in_partial_rollout", True, "rollout worker --mask-offpolicy-prefix"),
    ("over_sampling_batch_size", 6, "reads exactly --rollout-batch-size 2"),
])
def test_slime_flags_the_queues_rollout_would_ignore_are_refused_with_what_to_do(redis_url, namespace, flag,
                                                                                 value, advice):
    """Issue 27: accepted and silently ignored under the queue's rollout function."""
    cli_flag = "--" + flag.replace("_", "-")
    with pytest.raises(SlimeConfigError, match=f"{cli_flag}: .*{re.escape(advice)}"):
        sa.RedisDataSource(make_args(redis_url, namespace, **{flag: value}))
    # slime's defaults pass
    sa.RedisDataSource(make_args(redis_url, namespace, rollout_sample_hook_path=[], group_rm=False,
                                 over_sampling_batch_size=2, partial_rollout=True))


def test_offpolicy_masking_by_slimes_rollout_over_the_data_source_is_refused(redis_url, namespace):
    """slime's rollout masks the previous off-policy output of samples it continues; over
    RedisDataSource every sample is finished, and every loss mask came out zero."""
    args = make_args(redis_url, namespace, rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
                     partial_rollout=True, mask_offpolicy_in_partial_rollout=True, hf_checkpoint="bytes")
    with pytest.raises(SlimeConfigError, match="would zero every loss mask.*--mask-offpolicy-prefix"):
        sa.RedisDataSource(args)


def test_fully_async_rollout_is_refused(redis_url, namespace):
    args = make_args(redis_url, namespace,
                     rollout_function_path="slime.rollout.fully_async_rollout.generate_rollout_fully_async")
    with pytest.raises(SlimeConfigError, match="get_samples\\(1\\) per group from a thread"):
        sa.RedisDataSource(args)


def test_groups_sampled_otherwise_are_refused_and_regenerated(queue, redis_url, namespace):
    publish_results(queue, [0], sampling=SamplingRecord(0.7, 1.0, -1, 64))
    publish_results(queue, [1])
    args = make_args(redis_url, namespace, rollout_temperature=1.0, rollout_max_response_len=64)
    with pytest.raises(SamplingMismatch, match="g0 was sampled by worker w with temperature 0.7, slime trains "
                                               "with --rollout-temperature 1.0: start the workers with "
                                               "--temperature 1.0"):
        sa.generate_rollout(args, 0, None)
    assert queue.redis.lrange(queue.keys.prompts, 0, -1) == [b"g0"]  # to be generated again
    assert decode_group(queue.redis.hget(queue.keys.payloads, "g0")).samples[0].tokens == []
    publish_results(queue, [0])  # a worker with the right settings generates it again
    assert rows_of(sa.generate_rollout(args, 0, None).samples) == [0, 1]  # g1 came back first
    publish_results(queue, [2], sampling=None)
    publish_results(queue, [3])
    with pytest.raises(SamplingMismatch, match="g2 carries no sampling settings"):
        sa.generate_rollout(args, 1, None)
    publish_results(queue, [2])
    assert rows_of(sa.generate_rollout(args, 1, None).samples) == [2, 3]
    assert audit(queue).ok, audit(queue).summary()


# -- filters (item 7) --------------------------------------------------------------------------------


def nonzero_std(args, samples, **kwargs):
    """A slime-style filter: calls slime's Sample method, returns slime's output type."""
    rewards = [s.get_reward_value(args) for s in samples]
    keep = len(set(rewards)) > 1
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{rewards[0]}")


def test_slime_dynamic_filter_gets_slime_samples(fake_slime_installed, queue, redis_url, namespace):
    publish_results(queue, [0, 1], rewards=[1.0, 1.0])
    publish_results(queue, [2, 3, 4])
    args = make_args(redis_url, namespace, dynamic_sampling_filter_path=f"{__name__}.nonzero_std")
    out = sa.generate_rollout(args, 0, None)
    assert rows_of(out.samples) == [2, 3]
    assert out.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == 2
    assert out.metrics["rollout/queue/dropped"] == 2 and out.metrics["rollout/queue/drop_ratio"] == pytest.approx(0.5)


def text_filter(args, samples):
    """A slime filter that reads the response text."""
    assert all(s.response for s in samples), [s.response for s in samples]
    return True


def test_a_slime_filter_sees_the_response_text(fake_slime_installed, queue, redis_url, namespace):
    """Issue 27: results carry tokens, not text; a filter reading Sample.response saw ""."""
    publish_results(queue, [0, 1])
    args = make_args(redis_url, namespace, dynamic_sampling_filter_path=f"{__name__}.text_filter",
                     hf_checkpoint="bytes", rollout_batch_timeout=5)
    out = sa.generate_rollout(args, 0, None)
    assert rows_of(out.samples) == [0, 1] and all(s.response for g in out.samples for s in g)


def test_keep_when_insufficient_groups_are_kept_at_once_as_slime_does(fake_slime_installed, queue, redis_url,
                                                                       namespace):
    """Issue 27: slime keeps them as soon as what it read cannot fill the batch; the
    adapter waited 30 s per batch (here the batch would have timed out first)."""
    path = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
    publish_results(queue, [0, 1, 2], rewards=[1.0, 1.0])
    publish_results(queue, [3])
    args = make_args(redis_url, namespace, dynamic_sampling_filter_path=path, rollout_batch_timeout=5)
    out = sa.generate_rollout(args, 0, None)
    assert rows_of(out.samples) == [0, 3] and out.metrics["rollout/queue/kept_when_insufficient"] == 1


def test_keep_when_insufficient_fills_a_batch_that_cannot_fill(fake_slime_installed, queue, redis_url, namespace):
    path = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback"
    publish_results(queue, [0, 1, 2], rewards=[1.0, 1.0])
    publish_results(queue, [3])
    args = make_args(redis_url, namespace, dynamic_sampling_filter_path=path, rollout_filter_fallback_wait=0.3)
    out = sa.generate_rollout(args, 0, None)
    assert rows_of(out.samples) == [0, 3]  # one passed; the oldest rejected group filled the batch
    assert out.metrics["rollout/queue/kept_when_insufficient"] == 1
    assert out.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == 2  # the others, once the batch was full
    publish_results(queue, [4, 5, 6], rewards=[0.0, 1.0])
    publish_results(queue, [7], rewards=[1.0, 1.0])
    out = sa.generate_rollout(args, 1, None)
    assert rows_of(out.samples) == [4, 5] and out.metrics["rollout/queue/kept_when_insufficient"] == 0
    assert audit(queue).ok, audit(queue).summary()


# -- the data source ---------------------------------------------------------------------------------


def test_data_source_interface(fake_slime_installed, queue, redis_url, namespace):
    publish_results(queue, [0, 1, 2, 3, 4, 5])
    args = make_args(redis_url, namespace, rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
                     over_sampling_batch_size=2, save="/ckpt", save_interval=1, hf_checkpoint="bytes")
    source = sa.RedisDataSource(args)
    source.load(4)  # resumes after the checkpoint of rollout 4
    assert len(source) == 6
    first = source.get_samples(2)
    assert rows_of(first) == [0, 1] and len(source) == 4
    assert read_control(queue.redis, queue.keys).weight_version == 5
    source.add_samples([first[1]])  # slime's partial-rollout abort gives one back
    source.save(5)
    assert committed(queue) == 1  # group 1 was not trained
    second = source.get_samples(2)
    assert rows_of(second) == [1, 2] and second[0][0].tokens == first[1][0].tokens
    source.save(6)
    assert committed(queue) == 3 and source.pending_batches == 0
    assert audit(queue).ok, audit(queue).summary()


def test_foreign_groups_are_pushed_as_prompts(fake_slime_installed, queue, redis_url, namespace):
    source = sa.RedisDataSource(make_args(redis_url, namespace))
    partial = [FakeSlimeSample(group_index=9, index=18 + i, prompt="p9", label="9", tokens=[1, 2, 3, 40 + i],
                               response_length=1, rollout_log_probs=[-0.5], weight_versions=["3"],
                               status=FakeSlimeSample.Status.ABORTED) for i in range(N)]
    source.add_samples([partial])
    gid = queue.redis.lindex(queue.keys.prompts, 0).decode()
    assert gid.startswith("slime:")
    group = decode_group(queue.redis.hget(queue.keys.payloads, gid))
    assert [s.tokens for s in group.samples] == [[1, 2, 3, 40], [1, 2, 3, 41]]
    assert [s.status for s in group.samples] == [Status.ABORTED, Status.ABORTED]
    with pytest.raises(ValueError, match="n_samples_per_prompt=2"):
        source.add_samples([partial[:1]])
    assert audit(queue).ok, audit(queue).summary()


def test_given_back_group_too_stale_is_restarted(queue, redis_url, namespace):
    publish_results(queue, [0, 1, 2, 3])
    configure(queue.redis, queue.keys, max_staleness=0)
    source = sa.RedisDataSource(make_args(redis_url, namespace))
    groups = source.read_rollout(0, 2)
    source.add_samples([groups[1]])
    assert read_records(queue) == 1  # g1's entry: given back, not trained
    with pytest.raises(TimeoutError):
        source.settings.timeout = 0.2
        source.read_rollout(1, 2)  # admitted at version 0, now 1 behind: all restarted from their prompts
    assert sorted(g.decode() for g in queue.redis.lrange(queue.keys.prompts, 0, -1)) == ["g1", "g2", "g3"]
    assert committed(queue) == 0  # without checkpoints, rollout 0 is committed at rollout 2
    assert audit(queue).ok, audit(queue).summary()


# -- commits follow checkpoints, across kills (item 4) ----------------------------------------


@pytest.mark.slow
def test_every_group_trained_exactly_once_across_kills(queue, redis_url, namespace, tmp_path):
    """20 rollouts of slime's loop in processes killed before a checkpoint, between the
    model's save and the data source's, and after both: the ledger (the checkpoints'
    contents) holds every group once, and nothing is left uncommitted."""
    batch, rollouts = 3, 20
    publish_results(queue, list(range(batch * rollouts + 4)))  # 4 more than the run trains
    env = dict(os.environ, REDIS_URL=redis_url, NAMESPACE=namespace, LEDGER_DIR=str(tmp_path),
               NUM_ROLLOUT=str(rollouts), BATCH=str(batch), SAVE_INTERVAL="3",
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    kills = ["4:trained", "5:model_saved", "8:saved", "13:trained", "17:model_saved", ""]
    for kill_at in kills:
        done = subprocess.run([sys.executable, "-m", "tests.slime_loop"], env=dict(env, KILL_AT=kill_at),
                              capture_output=True, text=True, timeout=120, check=False)
        expected = -signal.SIGKILL if kill_at else 0
        assert done.returncode == expected, (kill_at, done.stderr[-3000:])
    lines = (tmp_path / "trained").read_text().split()
    rows = [int(r) for r in lines[1::2]]
    assert sorted(int(r) for r in lines[0::2]) == sorted(r for r in range(rollouts) for _ in range(batch))
    assert len(rows) == len(set(rows)) == batch * rollouts
    assert committed(queue) == batch * rollouts
    assert queue.redis.xlen(queue.keys.results) == 4 and read_records(queue) == 0
    assert audit(queue).ok, audit(queue).summary()


@pytest.mark.slow
def test_a_trainer_resumed_from_an_older_checkpoint_with_evals_and_a_staleness_bound_finishes(
        queue, redis_url, namespace, tmp_path, sim):
    """Issue 27: slime's loop with a live worker, η = 1 and an eval every 2 rollouts is
    killed at rollout 6 and resumed from checkpoint 1 (an older one): the queue's
    version goes back from 6 to 2 (the budget restarts), the evals of rollouts 3 and 5
    run again (their passes were read already), and the run finishes."""
    from tests.helpers import WorkerThread
    from workers.worker import SamplingSettings, WorkerSettings

    queue.push_groups([Group.fresh(f"t{i}", f"What is {i} + 2?", N, label=str(i + 2), row=i) for i in range(40)])
    eval_file = tmp_path / "math.jsonl"
    eval_file.write_text("".join(f'{{"input": "What is {i} + 3?", "label": "{i + 3}"}}\n' for i in range(3)))
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    env = dict(os.environ, REDIS_URL=redis_url, NAMESPACE=namespace, LEDGER_DIR=str(ledger), NUM_ROLLOUT="8",
               BATCH="2", SAVE_INTERVAL="2", EVAL_INTERVAL="2", EVAL_FILE=str(eval_file), MAX_STALENESS="1",
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=64), heartbeat_s=0.5))
    try:
        for extra in ({"KILL_AT": "6:trained"}, {"RESUME_FROM": "1"}):
            done = subprocess.run([sys.executable, "-m", "tests.slime_loop"], env=dict(env, **extra),
                                  capture_output=True, text=True, timeout=240, check=False)
            assert done.returncode == (-signal.SIGKILL if "KILL_AT" in extra else 0), done.stderr[-3000:]
    finally:
        worker.stop()
    evals = [line.split() for line in (ledger / "evals").read_text().splitlines()]
    assert [e[0] for e in evals] == ["0", "1", "3", "5", "3", "5", "7"]
    assert all(e[1:] == ["6", "0"] for e in evals)  # every pass: 3 prompts x 2 samples, none failed
    assert audit(queue).ok, audit(queue).summary()


# -- evaluation (item 8) ----------------------------------------------------------------------


@pytest.fixture
def sim():
    from engines.simulator import SimConfig, start_simulator

    handle = start_simulator(SimConfig(seed=1, decode_tokens_per_s=20000.0, length_median=24, length_p99=240,
                                       prefill_s=0.001))
    yield handle
    handle.stop()


def test_evaluation_runs_through_the_eval_namespace(fake_slime_installed, queue, redis_url, namespace, sim,
                                                     tmp_path):
    from pipeline.keys import eval_namespace
    from pipeline.queue import Queue
    from tests.helpers import WorkerThread
    from workers.worker import SamplingSettings, WorkerSettings

    queue.push_groups([Group.fresh(f"t{i}", f"What is {i} + 2?", N, label=str(i + 2), row=i) for i in range(40)])
    eval_file = tmp_path / "math.jsonl"
    eval_file.write_text("".join(f'{{"input": "What is {i} + 3?", "label": "{i + 3}"}}\n' for i in range(5)))
    args = make_args(redis_url, namespace, rollout_temperature=1.0, rollout_max_response_len=128,
                     eval_prompt_data=["math", str(eval_file)], n_samples_per_eval_prompt=3, label_key="label",
                     rollout_batch_timeout=60)
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=128), heartbeat_s=0.5,
                                         concurrency_per_engine=8))
    try:
        train = sa.generate_rollout(args, 0, None)
        out = sa.generate_rollout(args, 0, None, evaluation=True)
        after = sa.generate_rollout(args, 1, None)  # training goes on after the pass
    finally:
        worker.stop()
    assert isinstance(out, fake_slime.RolloutFnEvalOutput) and list(out.data) == ["math"]
    math = out.data["math"]
    assert len(math["rewards"]) == len(math["truncated"]) == len(math["samples"]) == 15
    assert all(isinstance(s, FakeSlimeSample) for s in math["samples"])
    assert [s.index for s in math["samples"]] == list(range(15))
    assert all(r in (0.0, 1.0) for r in math["rewards"]) and math["truncated"] == [
        s.status is FakeSlimeSample.Status.TRUNCATED for s in math["samples"]]
    assert {s.label for s in math["samples"]} == {str(i + 3) for i in range(5)}
    assert all(s.response for s in math["samples"])  # eval samples keep their text
    trained = [g[0].prompt for g in train.samples + after.samples]
    assert all(p.startswith("What is") and "+ 2?" in p for p in trained)  # training groups only
    eval_queue = Queue(queue.redis, eval_namespace(namespace))
    eval_books, train_books = audit(eval_queue), audit(queue)
    assert eval_books.ok and eval_books.committed == 5, eval_books.summary()
    assert train_books.ok and train_books.pushed == 40, train_books.summary()


def test_staleness_budget_restarts_with_a_trainer_that_goes_back_in_rollout_ids(fake_slime_installed, queue,
                                                                                 redis_url, namespace, sim):
    """Issue 27: the budget counted the namespace's lifetime commits against slime's
    rollout id, so a new run in a used namespace (or a resume from an older checkpoint)
    found it spent for good. It restarts at each trainer's first rollout."""
    from pipeline.control import read_control
    from tests.helpers import WorkerThread
    from workers.worker import SamplingSettings, WorkerSettings

    queue.push_groups([Group.fresh(f"t{i}", f"What is {i} + 2?", N, label=str(i + 2), row=i) for i in range(12)])
    args = make_args(redis_url, namespace, rollout_max_staleness=1, rollout_max_response_len=64,
                     rollout_batch_timeout=20)
    queue.redis.hset(queue.keys.stats, "committed", 1000)  # a long earlier run in this namespace
    source = sa.RedisDataSource(args)  # a new run: rollout ids from 0 again
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=64), heartbeat_s=0.5))
    try:
        for rollout_id in range(4):  # admission goes on (the lifetime count kept it blocked until version 500)
            source.read_rollout(rollout_id, 2)
        assert read_control(queue.redis, queue.keys).budget_base == 1000
    finally:
        worker.stop()


def test_eval_always_returns_with_failures_named_and_again_after_a_resume(fake_slime_installed, queue, redis_url,
                                                                         namespace, sim, tmp_path, caplog):
    """Issue 27: one eval group dead-lettered (a row without a label, under a reward that
    needs one) does not hold the pass: the finished groups come back, the dead one is
    named. slime resumed from an older checkpoint re-runs the eval of a rollout id whose
    pass was read and committed: it is pushed again and read, not waited on forever."""
    from tests.helpers import WorkerThread
    from workers.worker import SamplingSettings, WorkerSettings

    eval_file = tmp_path / "math.jsonl"
    eval_file.write_text("".join(f'{{"input": "What is {i} + 3?", "label": "{i + 3}"}}\n' for i in range(3))
                         + '{"input": "What is unlabeled?"}\n')
    args = make_args(redis_url, namespace, rollout_temperature=1.0, rollout_max_response_len=64,
                     eval_prompt_data=["math", str(eval_file)], n_samples_per_eval_prompt=2, label_key="label",
                     rollout_batch_timeout=60)
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=64), heartbeat_s=0.5))
    try:
        first = sa.generate_rollout(args, 0, None, evaluation=True)
        sa.reset_default_sources()  # the trainer dies; slime resumes and evaluates rollout 0 again
        again = sa.generate_rollout(args, 0, None, evaluation=True)
    finally:
        worker.stop()
    for out in (first, again):
        assert len(out.data["math"]["samples"]) == 6  # the three labeled prompts, two samples each
        assert out.metrics == {"eval/math/failed_groups": 1}
    assert "1 of 4 groups could not be evaluated (math@rollout0:0:3: dead-lettered:" in caplog.text
    assert "math@rollout0~1:0:3: dead-lettered:" in caplog.text  # the re-run is a pass of its own


# -- rewards (items 2, 9) -------------------------------------------------------------------------


def test_slimes_rescoring_gives_the_workers_rewards(fake_slime_installed, queue, redis_url, namespace, sim):
    """slime's own rollout over RedisDataSource with --group-rm scores each group again
    from Sample.response; results carry no text, so the data source decodes it with
    slime's tokenizer, and the scores come out as the workers' (f1, slime's rm_type)."""
    from tests.helpers import WorkerThread
    from workers.rewards import f1_score
    from workers.worker import SamplingSettings, WorkerSettings

    queue.push_groups([Group.fresh(f"t{i}", f"What is {i} + 2?", N, label=f"the answer is {i + 2}", row=i)
                       for i in range(6)])
    args = make_args(redis_url, namespace, rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
                     over_sampling_batch_size=2, hf_checkpoint="bytes", rollout_max_response_len=128,
                     group_rm=True, rm_type="f1", rollout_batch_timeout=60)
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=128), heartbeat_s=0.5,
                                         reward="f1"))
    try:
        source = sa.RedisDataSource(args)
        source.load(-1)
        groups = [g for _ in range(3) for g in source.get_samples(2)]
    finally:
        worker.stop()
    samples = [s for g in groups for s in g]
    assert all(s.response for s in samples)
    assert [f1_score(s.response, s.label) for s in samples] == [s.reward for s in samples]
    assert any(s.reward > 0 for s in samples)


def slime_rm(args, sample):
    """A slime custom reward: slime's Sample and the args slime's rewards read."""
    assert isinstance(sample, FakeSlimeSample) and sample.rollout_id is None
    return float(args.rm_type == "custom" and args.rollout_temperature == 0.5 and sample.response == sample.label)


def test_a_slime_custom_reward_gets_slimes_sample_and_args(fake_slime_installed):
    import asyncio

    from workers.rewards import Reward
    from workers.worker import SamplingSettings, WorkerSettings, reward_args

    settings = WorkerSettings(redis_url="redis://unused", engine_urls=[], rm_type="custom",
                              reward=f"{__name__}.slime_rm", sampling=SamplingSettings(temperature=0.5))
    reward = Reward.from_path(settings.reward)
    samples = [Sample(response="4", label="4"), Sample(response="5", label="4")]
    assert asyncio.run(reward.score(reward_args(settings), samples)) == [1.0, 0.0]
    assert not Reward.from_path("f1").slime_samples  # built-ins take ours


def test_slimes_async_rm_with_an_rm_type_scores_without_calling_itself(fake_slime_installed):
    """Issue 27: the documented port of slime's rewards, `--reward slime.rollout.rm_hub.async_rm
    --rm-type math`, named async_rm as args.custom_rm_path, which async_rm dispatches to
    first: it called itself until RecursionError."""
    import asyncio

    from workers.rewards import Reward
    from workers.worker import WorkerSettings, reward_args

    settings = WorkerSettings(redis_url="redis://unused", engine_urls=[], rm_type="math",
                              reward="slime.rollout.rm_hub.async_rm")
    samples = [Sample(response="4", label="4"), Sample(response="5", label="4")]
    assert asyncio.run(Reward.from_path(settings.reward).score(reward_args(settings), samples)) == [1, 0]
