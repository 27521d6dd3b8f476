"""The slime adapter's evaluation passes (through `<ns>.eval`) and slime's rewards run by
the workers, with a live worker on the simulator."""
from __future__ import annotations

from pipeline.ops.audit import audit
from pipeline.trainers import slime_adapter as sa
from pipeline.types import Group, Sample
from tests import fake_slime
from tests.fake_slime import Sample as FakeSlimeSample
from tests.slime_helpers import (  # noqa: F401 (fixtures)
    N,
    clean_state,
    committed,
    fake_slime_installed,
    finished,
    make_args,
    sim,
)

# -- evaluation (item 8) ----------------------------------------------------------------------


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
