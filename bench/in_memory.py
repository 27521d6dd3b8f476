"""The design this project replaces, written for the benchmark: asynchronous RL
rollouts in one process's memory (as slime's fully_async worker, AReaL and verl's
fully-async policy keep them).

A fixed pool of sample slots in flight (a group of n takes n, and gives each back as
its request ends, the last one with the group, as workers/worker.py does), an
`asyncio.Queue` of finished groups, aborted groups put back in memory to continue
after the resume. Same engines, same rewards, same admission pacing
((η + version + 1)·B admitted), same staleness check at consumption (restart from
the prompt), same pause protocol (pause the engines, load the weights, continue).
With η = 0 the pacing admits exactly B groups per weight version and the trainer
waits for all of them: that is the synchronous loop, the "sync" row.
"""
from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

from pipeline.types import Group, Sample, Status
from workers.engine_set import EngineSet
from workers.rewards import Reward
from workers.tokenizer import ByteTokenizer, encode_prompt
from workers.sampling import SamplingSettings
from workers.group_run import FINISH_STATUS

from .rl_loop import Settings, TrainedBatch, make_group
from .waterfall import Waterfall, group_tokens

REWARD = "math_boxed"  # the workers' default
ABORT_SETTLE_S = 0.25  # as Controller.settle_s: requests that reached a paused engine wait there


class InMemoryRollout:
    """Implements rl_loop.BatchSource. Create and use inside one event loop."""

    def __init__(self, settings: Settings, engine_urls: list[str], eta: int, groups: list[Group]):
        self.settings = settings
        self.engines = EngineSet(engine_urls)
        self.eta = eta
        self.sampling = SamplingSettings(max_new_tokens=settings.max_new_tokens)
        self.tokenizer = ByteTokenizer()
        self.reward = Reward.from_path(REWARD)
        self.reward_args = SimpleNamespace(rm_url=None, reward_key=None, max_new_tokens=settings.max_new_tokens)
        self.prompts: deque[Group] = deque(groups)
        self.ready: asyncio.Queue[Group] = asyncio.Queue()
        self.requeued: list[Group] = []  # aborted mid-generation, continued after the resume
        self.live: dict[str, Group] = {}  # admitted and not yet trained or restarted
        self.free_slots = settings.capacity
        self.tasks: set[asyncio.Task] = set()
        self.version = 0
        self.committed = 0
        self.paused = False
        self.waterfall = Waterfall()
        self.error: BaseException | None = None
        self._wake = asyncio.Event()
        self._admitter = asyncio.create_task(self._admit_loop())

    # -- generation ----------------------------------------------------------------------

    def _budget_left(self) -> bool:
        limit = (self.eta + self.version + 1) * self.settings.batch_groups
        return self.committed + len(self.live) < limit

    async def _admit_loop(self) -> None:
        while True:
            while not self.paused and self.prompts and self.free_slots >= self.settings.n_samples:
                group = self.prompts[0]
                if group.group_id not in self.live:
                    if not self._budget_left():
                        break
                    self.live[group.group_id] = group
                    if group.admitted_version is None:
                        group.admitted_version = self.version
                self._start(self.prompts.popleft())
            self._wake.clear()
            await self._wake.wait()

    def _start(self, group: Group) -> None:
        pending = [s for s in group.samples if s.status in (Status.PENDING, Status.ABORTED)]
        slots = max(1, len(pending))
        self.free_slots -= slots
        task = asyncio.create_task(self._run_group(group, pending, slots))
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
        self._wake.set()

    async def _run_group(self, group: Group, pending: list[Sample], slots: int) -> None:
        held = [slots]
        try:
            if not group.prompt_ids:
                group.prompt_ids = encode_prompt(self.tokenizer, group.samples[0].prompt, False)
            await asyncio.gather(*(self._sample_in_slot(group, s, held) for s in pending))
            if any(s.status == Status.ABORTED for s in group.samples):
                self.requeued.append(group)
                return
            for sample, reward in zip(group.samples, await self.reward.score(self.reward_args, group.samples)):
                sample.reward = reward
            self.ready.put_nowait(group)
        finally:
            self.free_slots += held[0]

    async def _sample_in_slot(self, group: Group, sample: Sample, held: list[int]) -> None:
        try:
            await self._generate(group, sample)
        finally:
            if held[0] > 1:  # the group's last slot goes with the group
                held[0] -= 1
                self.free_slots += 1
                self._wake.set()

    async def _generate(self, group: Group, sample: Sample) -> None:
        if self.paused:  # as the worker: a request sent now would wait at the paused engine
            sample.status = Status.ABORTED
            return
        if not sample.tokens:
            sample.tokens = list(group.prompt_ids)
        remaining = self.sampling.max_new_tokens - sample.response_length
        result = await self.engines.generate(sample.tokens,
                                             self.sampling.params(remaining, group.sampling_seed(sample)))
        new = len(result.output_ids)
        self.waterfall.generated += new
        sample.tokens += result.output_ids
        sample.response_length += new
        sample.response += result.text
        sample.rollout_log_probs = (sample.rollout_log_probs or []) + result.output_log_probs
        if new:
            sample.weight_versions.append(result.weight_version)
        sample.status = FINISH_STATUS[result.finish_type]

    # -- the trainer's side ----------------------------------------------------------------

    async def next_batch(self, n: int) -> TrainedBatch:
        groups, restarted = [], 0
        while len(groups) < n:
            if self.error is not None:
                raise RuntimeError(f"in-memory rollout failed: {self.error!r}") from self.error
            try:
                group = await asyncio.wait_for(self.ready.get(), timeout=1.0)
            except asyncio.TimeoutError:
                continue
            lag = self.version - (group.oldest_version() or 0)
            if lag > self.eta:
                restarted += 1
                self.waterfall.discard_stale(group, lag)
                fresh = make_group(self.settings, group.row)
                fresh.restarts, fresh.admitted_version = group.restarts + 1, self.version
                self.live[group.group_id] = fresh
                self.prompts.appendleft(fresh)
                self._wake.set()
                continue
            groups.append(group)
        for group in groups:
            del self.live[group.group_id]
            self.waterfall.trained += group_tokens(group)
        self.committed += n
        self._wake.set()
        return TrainedBatch(groups, restarted)

    async def weight_update(self, version: int) -> None:
        self.paused = True
        await self.engines.pause_generation(self.settings.pause_mode)
        if self.settings.pause_mode == "abort" and self.tasks:
            await asyncio.wait(set(self.tasks), timeout=ABORT_SETTLE_S)
        await self.engines.update_weights_from_disk(f"/checkpoints/step-{version}", weight_version=str(version))
        self.version = version
        await self.engines.continue_generation()
        self.prompts.extendleft(reversed(self.requeued))
        self.requeued.clear()
        self.paused = False
        self._wake.set()

    async def finish(self) -> Waterfall:
        """Stop generating; account for every token. (Aborted output is always continued
        here and nothing crashes: those fates stay 0.)"""
        self._admitter.cancel()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(self._admitter, *self.tasks, return_exceptions=True)
        await self.engines.close()
        self.waterfall.left = sum(group_tokens(g) for g in self.live.values())
        return self.waterfall
