"""slime's own RolloutManager and default rollout (tests/fake_slime_rollout.py, step by step
as slime's code runs them) over RedisDataSource, driven as slime's train_async.py drives them:
the flags slime's rollout ignores there, groups sampled with other settings, groups of a run
slime abandoned when it went back to a checkpoint, and workers on engines slime does not update."""
from __future__ import annotations

import json
import re
import threading

import pytest

from pipeline.ops.audit import audit
from pipeline.queue import ClaimStatus, parse_history
from pipeline.trainers import slime_adapter as sa
from pipeline.types import Group, SamplingRecord
from tests.fake_slime_rollout import RolloutManager, slime_args, train_async
from tests.groups import claim, publish
from tests.helpers import wait_for
from tests.slime_helpers import N, SAMPLING, committed, finished, publish_results
from tests.slime_helpers import clean_state, fake_slime_installed  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("fake_slime_installed")

DATA_SOURCE = "pipeline.trainers.slime_adapter.RedisDataSource"


def rollout_args(redis_url: str, namespace: str, **kwargs) -> object:
    """slime's args for its default rollout over RedisDataSource, checkpoints every rollout. The
    workers keep the response texts (slime's rollout reads them; the test tokens are no text)."""
    return slime_args(**{"rollout_batch_size": 2, "n_samples_per_prompt": N, "rollout_redis_url": redis_url,
                         "rollout_namespace": namespace, "data_source_path": DATA_SOURCE,
                         "rollout_max_response_len": SAMPLING.max_new_tokens, "save": "/ckpt", "save_interval": 1,
                         "rollout_batch_timeout": 5, **kwargs})


def rows_trained(train_data: dict) -> list[int]:
    return sorted({s.group_index for s in train_data["samples"]})


def generate_again(queue, worker: str = "w2", sampling: SamplingRecord = SAMPLING, version: int = 0) -> list[str]:
    """Workers with the right settings generate every group waiting in the prompt list."""
    out = []
    while True:
        c = claim(queue, worker, 8)
        for x in c.groups:
            g = finished(int(x.group_id[1:]), version=version, sampling=sampling)
            g.admitted_version, g.worker = x.group.admitted_version, worker
            publish(queue, worker, x, group=g, keep_response_text=True)
            out.append(x.group_id)
        if not c.groups:
            return out


# -- flags slime's rollout ignores over the data source (failure 8) ---------------------------------


async def user_rm(args, sample):
    return 1.0


async def user_group_rm(args, samples):
    return [1.0] * len(samples)


async def user_generate(args, sample, sampling_params):
    raise AssertionError("slime never calls the generate function on a finished sample")


def user_hook(args, sample):
    raise AssertionError("slime never runs sample hooks on a finished sample")


def user_buffer_filter(args, rollout_id, buffer, num_samples):
    raise AssertionError("RedisDataSource has no buffer: slime's RolloutDataSourceWithBuffer calls this")


@pytest.mark.parametrize("flag, value", [
    ("custom_rm_path", f"{__name__}.user_rm"),
    ("rm_type", "math"),
    ("custom_generate_function_path", f"{__name__}.user_generate"),
    ("rollout_sample_hook_path", [f"{__name__}.user_hook"]),
    ("buffer_filter_path", f"{__name__}.user_buffer_filter"),
])
def test_flags_slimes_rollout_ignores_over_the_data_source_are_refused(queue, redis_url, namespace, flag, value):
    """Issue 30 (8): slime's generate_and_rm returns a finished sample that carries a reward
    before it would call the generate function, the hooks or the rm (sglang_rollout.py), and
    buffer_filter_path is read only by slime's own buffer: slime trained the workers' reward
    0.0 where the user's rm gives 1.0. RolloutManager's data source refuses them."""
    publish_results(queue, [0, 1], rewards=[0.0, 0.0], keep_response_text=True)
    cli_flag = "--" + flag.replace("_", "-")
    with pytest.raises(sa.SlimeConfigError, match=f"{re.escape(cli_flag)}: .*rollout worker"):
        RolloutManager(rollout_args(redis_url, namespace, **{flag: value}))
    assert audit(queue).ok


@pytest.mark.parametrize("rm", [{"custom_rm_path": f"{__name__}.user_group_rm"}, {"rm_type": "math"}])
def test_with_group_rm_slime_scores_again_and_the_rm_flags_are_allowed(queue, redis_url, namespace, rm):
    """With --group-rm slime scores every group again (generate_and_rm_group calls
    batched_async_rm): the rm flags do what they say, and slime trains its own scores."""
    publish_results(queue, [0, 1], rewards=[0.0, 0.0], keep_response_text=True)
    manager = RolloutManager(rollout_args(redis_url, namespace, group_rm=True, **rm))
    manager.load(-1)
    out = manager.generate(0)
    expected = [1.0] * 4 if "custom_rm_path" in rm else [int(s.response == s.label) for s in out["samples"]]
    assert out["raw_reward"] == expected and all(s.response for s in out["samples"])
    manager.save(0)
    assert committed(queue) == 2 and audit(queue).ok


# -- groups sampled with other settings (failure 9) ---------------------------------------------------


def test_a_sampling_mismatch_sends_every_mismatched_group_back_with_one_error(queue, redis_url, namespace):
    """Issue 30 (9): a worker sampled 6 groups at temperature 0.7. The trainer's first read
    refuses and regenerates all 6 at once (not only the batch it read) with one error; once
    the workers are fixed, the next trainer start trains without another."""
    publish_results(queue, list(range(6)), sampling=SamplingRecord(0.7, 1.0, -1, 64), keep_response_text=True)
    publish_results(queue, [6, 7], keep_response_text=True)
    args = rollout_args(redis_url, namespace, num_rollout=4)
    trained: list[list[int]] = []

    def run() -> None:
        train_async(args, train=lambda r, data: trained.append(rows_trained(data)), update_weights=lambda: None)

    with pytest.raises(sa.SamplingMismatch, match=r"g0 was sampled by worker w with temperature 0.7.*"
                                                  r"--temperature 1.0 \(and 5 more groups\)"):
        run()
    assert sorted(g.decode() for g in queue.redis.lrange(queue.keys.prompts, 0, -1)) == [f"g{i}" for i in range(6)]
    assert generate_again(queue) and trained == []
    args.start_rollout_id = None
    run()  # the trainer started again, after the workers were fixed
    assert sorted(r for rows in trained for r in rows) == list(range(8))
    assert committed(queue) == 8 and audit(queue).ok, audit(queue).summary()


# -- groups of a run slime abandoned (failure 10) -----------------------------------------------------


RUN_A, RUN_B = 100, 200  # engine weight labels: run A's version v is 100 + v, run B's 200 + v
ABANDONED = "admitted in a timeline the trainer left"  # the history's reason for such a regeneration


class Workers:
    """Workers generating all the time: each group is claimed at the queue's version (as
    admission allows) and published made with weights `label + version`; from version
    `hold_from` on they keep the first two they claim in flight (`held`)."""

    def __init__(self, queue, label: int):
        self.queue, self.label, self.hold_from = queue, label, None
        self.held: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            c = claim(self.queue, "w", 2)
            for x in c.groups:
                if self.hold_from is not None and x.group.admitted_version >= self.hold_from and len(self.held) < 2:
                    self.held.append(x)
                    continue
                g = finished(int(x.group_id[1:]), version=self.label + x.group.admitted_version)
                g.admitted_version = x.group.admitted_version
                publish(self.queue, "w", x, group=g, keep_response_text=True)
            if c.status != ClaimStatus.OK:
                self.stop.wait(0.005)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def test_groups_of_a_run_slime_went_back_from_are_regenerated_not_trained(queue, redis_url, namespace, monkeypatch):
    """Issue 30 (10): run A trains rollouts 0-5 at η = 1 (checkpoint at 1) and dies, leaving
    groups it admitted at versions up to 5: read and not committed, unread in the results
    stream, and in flight. Run B resumes from checkpoint 1 (rollout 2: the queue's clock goes
    back from 5 to 2). Groups run A admitted after version 2 were generated by weights run
    B never has: each is regenerated exactly once and never trained, also the ones read
    only once run B's clock has caught up with their version (their lag looks fresh), and
    the ones in flight, which run A's worker publishes after run B reached version 5."""
    queue.push_groups([Group.fresh(f"g{i}", f"prompt {i}", N, label=str(i), row=i) for i in range(80)])
    args = rollout_args(redis_url, namespace, rollout_max_staleness=1, save_interval=2)
    workers = Workers(queue, RUN_A)
    try:
        run_a = RolloutManager(args)
        run_a.load(-1)
        for rollout_id in range(6):
            if rollout_id == 5:
                workers.hold_from = 5
            run_a.generate(rollout_id)
            if rollout_id == 1:
                run_a.save(1)
        wait_for(lambda: len(workers.held) == 2, what="run A's worker holding groups admitted at 5")
    finally:
        workers.close()
    held = workers.held
    admitted = {gid.decode(): int(v) for gid, v in queue.redis.hgetall(queue.keys.admitted).items()}
    abandoned = {gid for gid, version in admitted.items() if version > 2}
    assert {x.group_id for x in held} <= abandoned and len(abandoned) > len(held)

    sa.reset_default_sources()
    args.start_rollout_id, args.num_rollout = None, 9
    trained: list[tuple[int, int, int]] = []  # (rollout, group row, the weights' label)

    def train(rollout_id: int, data: dict) -> None:
        trained.extend((rollout_id, s.group_index, int(s.weight_versions[0])) for s in data["samples"])
        if rollout_id == 4:  # run B's clock is at 5: run A's worker publishes what it held
            for x in held:
                g = finished(int(x.group_id[1:]), version=RUN_A + x.group.admitted_version)
                g.admitted_version = x.group.admitted_version
                publish(queue, "w", x, group=g, keep_response_text=True)

    read = sa.RedisDataSource.read_rollout
    logged: list[dict] = []  # the queue's metrics of each rollout (slime's own rollout logs only its own)

    def read_and_log(source, rollout_id: int, n: int) -> list:
        groups = read(source, rollout_id, n)
        logged.append(source.last_metrics)
        return groups

    monkeypatch.setattr(sa.RedisDataSource, "read_rollout", read_and_log)
    workers = Workers(queue, RUN_B)
    try:
        train_async(args, train=train, update_weights=lambda: None, start_rollout_id=2)
    finally:
        workers.close()
    from_a = [(r, row, w) for r, row, w in trained if w < RUN_B]
    assert all(w - RUN_A <= 2 for _, _, w in from_a), from_a  # admitted by run A up to the rewind point only
    histories = dict(zip(sorted(abandoned), queue.redis.hmget(queue.keys.history, sorted(abandoned))))
    regenerated = {gid: sum(detail == ABANDONED for _, event, _, detail in parse_history((h or b"").decode())
                            if event == "released") for gid, h in histories.items()}
    assert all(n == 1 for n in regenerated.values()), (regenerated, admitted, {g: h for g, h in histories.items() if regenerated[g] != 1})  # each once
    assert sum(m["rollout/queue/abandoned"] for m in logged) == len(abandoned), logged
    rows = [row for _, row, _ in trained]
    assert len(rows) == N * 2 * 7 and len(set(rows)) == len(rows) // N  # 7 rollouts, each group once
    assert audit(queue).ok, audit(queue).summary()


# -- workers on engines slime does not update (failure 11) ---------------------------------------------


def test_a_worker_on_a_foreign_engine_that_joins_after_the_start_has_its_groups_refused(queue, redis_url,
                                                                                       namespace):
    """Issue 30 (11): the engine check refused foreign-engine workers only when the trainer
    started. One that registers later is caught when its groups are read: they are sent
    back to be generated again, with one error naming the worker and its engine."""
    slimes = "127.0.0.1:9"  # nothing answers: slime's engines' versions are unknown, their addresses are not
    queue.register("w", json.dumps({"engines": [f"http://{slimes}"]}))
    publish_results(queue, [0, 1, 2], keep_response_text=True)
    args = rollout_args(redis_url, namespace, rollout_external_engine_addrs=[slimes])
    manager = RolloutManager(args)  # starts: every live worker is on slime's engines
    manager.load(-1)
    manager.generate(0)
    queue.register("rogue", json.dumps({"engines": ["http://10.1.2.3:30000"]}))
    queue.push_groups([Group.fresh(f"g{i}", f"prompt {i}", N, label=str(i), row=i) for i in (3, 4, 5)])
    for x in claim(queue, "rogue", 3).groups:
        g = finished(int(x.group_id[1:]))
        g.admitted_version, g.worker = x.group.admitted_version, "rogue"
        publish(queue, "rogue", x, group=g, keep_response_text=True)
    with pytest.raises(sa.SlimeConfigError, match=r"group g3 was generated by worker rogue on "
                                                  r"http://10.1.2.3:30000, an engine slime does not update.* "
                                                  r"\(and 2 more groups\)"):
        manager.generate(1)
    assert sorted(g.decode() for g in queue.redis.lrange(queue.keys.prompts, 0, -1)) == ["g3", "g4", "g5"]
    queue.leave("rogue")
    generate_again(queue, worker="w")
    assert rows_trained(manager.generate(1))[0] == 2  # read before the refusal, held: trained next
    manager.save(1)
    assert committed(queue) == 4 and audit(queue).ok, audit(queue).summary()
