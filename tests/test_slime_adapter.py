"""pipeline.trainers.slime_adapter: slime's rollout function and data source over the queue
(types, the rollout function, commits that follow checkpoints, the data source), with the
stand-in types (slime not installed) and with the stand-in `slime` package
(tests/fake_slime.py) in sys.modules, against a real redis-server."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import fields
from types import SimpleNamespace

import pytest

from pipeline.codec import decode_group
from pipeline.consumer import BatchMetrics
from pipeline.control import configure, read_control
from pipeline.ops.audit import audit
from pipeline.trainers import slime_adapter as sa
from pipeline.trainers import slime_types as st
from pipeline.trainers.slime_checks import SlimeConfigError
from pipeline.trainers.slime_metrics import slime_metrics
from pipeline.types import Group, Sample, Status, VersionClock
from tests import fake_slime
from tests.fake_slime import Sample as FakeSlimeSample
from tests.fake_slime_rollout import RolloutManager, slime_args
from tests.slime_helpers import (  # noqa: F401 (fixtures)
    PROMPT,
    N,
    clean_state,
    committed,
    fake_slime_installed,
    finished,
    make_args,
    publish_results,
    read_records,
    rows_of,
    sim,
)

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
    return slime_args(rollout_batch_size=2, n_samples_per_prompt=N, rollout_redis_url=redis_url,
                      rollout_namespace=namespace, data_source_path="pipeline.trainers.slime_adapter.RedisDataSource",
                      dynamic_sampling_filter_path=f"{__name__}.drop_row_1_on_second_sight",
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
    manager = RolloutManager(args)  # slime's RolloutManager over RedisDataSource, its default rollout
    manager.load(-1)
    trained = []
    for rollout_id in range(3):
        out = manager.generate(rollout_id)
        trained.append(sorted({i // N for i in out["sample_indices"]}))
        manager.save(rollout_id)
        assert committed(queue) == 2 * (rollout_id + 1), trained
    assert trained == [[0, 2], [1, 3], [4, 5]]
    assert read_records(queue) == 0 and manager.data_source.pending_batches == 0
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
