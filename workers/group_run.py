"""Running claimed groups: their sample slots, the engine requests, scoring, and publishing where each group goes."""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from pipeline import metrics
from pipeline.codec import EncodeError, encode_group
from pipeline.permissions import PermissionDenied
from pipeline.queue import ClaimedGroup, Place, Publish, Published, Queue
from pipeline.types import SEGMENTS_KEY, DeadReason, Group, Sample, Status, VersionClock, parse_version

from .context import Halt, WorkerContext
from .engine_answers import GenerateResult
from .engine_errors import EngineError, EngineProtocolError, EngineRequestError
from .engine_set import EngineSet
from .engine_health import EngineHealth
from .generate_function import (GenerateFunction, GenerateFunctionFailed, generate_args, output_problem,
                                shared_prompt_ids)
from .publisher import Publisher
from .rewards import MissingLabel, Reward, RewardError, RewardsHung, validate_reward
from .sample_budget import SampleBudget
from .tokenizer import encode_prompt, render_prompt

log = logging.getLogger("workers.worker")  # the worker's log: its lines read as they always did

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
#: Wait before continuing a preempted sample (jittered): long enough for slime's idle
#: check after an abort_all to find the engine idle.
PREEMPTED_RETRY_S = 0.5


class GroupFailed(Exception):
    """A group cannot be finished; it goes to dead letters with this message."""

    def __init__(self, message: str, reason: DeadReason):
        super().__init__(message)
        self.reason = reason


@dataclass(eq=False)
class Running:
    """A group this worker works on, with the token of the claim that took it."""

    group: Group
    token: str
    payload: bytes  # as claimed: what a dead letter keeps if the group cannot be encoded
    serial: int  # unique in this process; request ids start with "<worker id>/<serial>/"
    slots: int
    queue: Queue  # the namespace it was claimed from (training, or its eval companion)
    task: asyncio.Task | None = None
    publishing: bool = False


class GroupRunner:
    """One task per claimed group, a sample slot per sample still to generate: tokenize,
    call /generate for every unfinished sample, then requeue, score and publish, or
    dead-letter. One bad group never stops the others."""

    def __init__(self, ctx: WorkerContext, engines: EngineSet, engine_health: EngineHealth, tokenizer: Any,
                 reward: Reward | Any, reward_args: Any, generate_function: GenerateFunction | None = None):
        self.ctx = ctx
        self.settings = ctx.settings
        self.engines = engines
        self.engine_health = engine_health
        self.tokenizer = tokenizer
        self.reward = reward
        self.reward_args = reward_args
        # A user's function makes each sample's engine calls; it holds the sample's slot
        # from its first turn to its last.
        self.generate_function = generate_function
        self.publisher = Publisher(ctx)
        self.running: dict[tuple[str, str], Running] = {}  # (namespace, group id) -> what works on it
        self.inflight_samples = 0
        self._serial = 0
        # Samples per group, to size claims; unknown until the first claim, so that one
        # takes a single group (slime over-prefetched n-fold by guessing 1).
        self.group_size = ctx.capacity
        self.outstanding = 0  # engine requests in flight
        self.last_answer = time.monotonic()
        self._warned: set[str] = set()  # weight versions (engine clock) or engines (queue clock) warned about
        self.aborts: set[asyncio.Task] = set()
        self._abort_slots = asyncio.Semaphore(16)  # aborts in flight at once

    # -- slots and tasks -------------------------------------------------------------

    def start(self, claimed: ClaimedGroup, queue: Queue) -> None:
        group = claimed.group
        if group is None:
            return  # malformed: the queue dead-lettered it
        key = (queue.keys.namespace, group.group_id)  # one id may be in the training and the eval namespace
        old = self.running.get(key)
        if old is not None:  # claimed again while an old task lingers: that one's token is stale
            old.task.cancel()
            self._release_slots(old)
        group.worker = self.ctx.id
        group.claimed_at = time.time()
        self.ctx.counters.groups_claimed += 1
        if group.n_samples > self.ctx.capacity:
            log.warning("group %s has %d samples, more than this worker's capacity of %d: running it alone",
                        group.group_id, group.n_samples, self.ctx.capacity)
        self.group_size = max(1, group.n_samples)
        # A slot per sample to generate, given back as each request finishes: a group
        # waiting on its slowest sample holds one slot, not n (the engine sees the rest free).
        slots = max(1, sum(s.status in (Status.PENDING, Status.ABORTED) for s in group.samples))
        self._serial += 1
        run = Running(group, claimed.token, claimed.payload, self._serial, slots, queue)
        self.running[key] = run
        self.inflight_samples += slots
        run.task = asyncio.create_task(self._process(run))
        # A done callback, not a finally: it also runs for a task cancelled before it started.
        run.task.add_done_callback(lambda _t, r=run: self._finished(r))

    def close(self) -> None:
        """Stop the thread user generate functions run on (after cancel_all)."""
        if self.generate_function is not None:
            self.generate_function.loop.close()

    def _release_slots(self, run: Running) -> None:
        self.inflight_samples -= run.slots
        run.slots = 0

    def _finished(self, run: Running) -> None:
        self._release_slots(run)
        key = (run.queue.keys.namespace, run.group.group_id)
        if self.running.get(key) is run:
            del self.running[key]
        self.ctx.wake.set()

    async def cancel_all(self, why: str) -> None:
        """Cancel every group task (each aborts its requests on the engines)."""
        runs = list(self.running.values())
        if not runs:
            return
        log.info("%s: cancelling %d group tasks", why, len(runs))
        for run in runs:
            run.task.cancel()
        await asyncio.gather(*(r.task for r in runs), return_exceptions=True)

    def _abort_request(self, rid: str) -> None:
        """Best effort, in the background: a request the engines would otherwise finish
        for nobody. (SGLang only aborts a rid it knows, so one at a time, every engine:
        behind a router nobody knows which engine has it.)"""
        async def abort() -> None:
            async with self._abort_slots:
                try:
                    await self.engines.abort(rid=rid)
                except Exception as exc:
                    log.debug("abort of request %s failed: %s", rid, exc)

        task = asyncio.create_task(abort())
        self.aborts.add(task)
        task.add_done_callback(self.aborts.discard)

    # -- one group -------------------------------------------------------------------

    async def _process(self, run: Running) -> None:
        group = run.group
        try:
            place, failure = await self._generate_group(run)
            group.finished_at = time.time()
            group.error = None if failure is None else str(failure)
            await self._publish(run, place, failure)
        except asyncio.CancelledError:
            self.ctx.counters.cancelled += 1
            raise
        except PermissionDenied as exc:  # the worker's ACL, not the group: it stays held and is handed back
            self.ctx.refused(exc)
        except RewardsHung as exc:  # the reward function, not the group: the same
            self.ctx.halt(Halt("reward-hung", str(exc), "fix the reward function; restarting the worker frees "
                                                        "the threads of the stuck calls"))
        except Exception as exc:  # one bad group must never take the worker down
            log.exception("group %s: unexpected error; dead-lettering it", group.group_id)
            metrics.DEAD_LETTERS.labels(DeadReason.WORKER_ERROR).inc()
            # What was claimed, not the group as generated: that may be what cannot be stored.
            # If even this fails, the group stays held in Redis with no task, and the next
            # reconciliation gives it back (and max_claims ends a group that keeps doing it).
            run.publishing = True
            try:
                outcome = await self.publisher.publish(run.queue, Publish(
                    group.group_id, run.token, run.payload, Place.DEAD, f"worker error: {type(exc).__name__}: {exc}",
                    DeadReason.WORKER_ERROR))
            except Exception as again:
                log.error("group %s: could not dead-letter it either (%s); reconciliation gives it back",
                          group.group_id, again)
                return
            if outcome != Published.REFUSED:
                self.ctx.counters.groups_dead += 1

    async def _publish(self, run: Running, place: Place, failure: GroupFailed | None) -> None:
        group = run.group
        try:
            # Eval results keep their text (slime logs and scores eval samples from it).
            keep_text = self.settings.keep_response_text or place != Place.RESULTS or run.queue is not self.ctx.queue
            payload = encode_group(group, keep_text)
        except EncodeError as exc:
            # What was generated breaks the schema: it must not reach the trainer.
            log.error("group %s: cannot store it as generated (%s); dead-lettering it as claimed",
                      group.group_id, exc)
            place, payload = Place.DEAD, run.payload
            failure = GroupFailed(f"cannot store the generated group: {exc}", DeadReason.ENCODE)
        if failure is not None:
            metrics.DEAD_LETTERS.labels(failure.reason).inc()
        error, reason = (None, "") if failure is None else (str(failure), failure.reason)
        run.publishing = True
        outcome = await self.publisher.publish(run.queue, Publish(group.group_id, run.token, payload, place, error,
                                                                  reason))
        metrics.GROUPS_PUBLISHED.labels(place.value if outcome != Published.REFUSED else "lost").inc()
        counters = self.ctx.counters
        if outcome == Published.REFUSED:
            counters.groups_lost += 1
        elif place == Place.RESULTS:
            counters.groups_completed += 1
            counters.samples_completed += len(group.samples)
        elif place == Place.REQUEUE:
            counters.groups_requeued += 1
            # One per group on a pause: the progress line counts them (INFO shows by default).
            log.debug("group %s: unfinished (paused or engines down); partial output requeued", group.group_id)
        else:
            counters.groups_dead += 1
            log.error("group %s: dead-lettered: %s", group.group_id, error)

    async def _generate_group(self, run: Running) -> tuple[Place, GroupFailed | None]:
        """Returns where the group goes and, for dead letters, why."""
        group = run.group
        try:
            if not group.samples:
                raise GroupFailed("group has no samples", DeadReason.INPUT)
            self._stamp_sampling(group)
            self._render_prompts(group)
            if self.generate_function is not None:
                await self._generate_with_function(run)
            else:
                if not group.prompt_ids:  # rendered already under --apply-chat-template: a list still needs it
                    s0 = group.samples[0]
                    group.prompt_ids = encode_prompt(self.tokenizer, s0.prompt, False, _tools(s0),
                                                     self.settings.apply_chat_template_kwargs)
                await asyncio.gather(*(self._generate_sample_in_slot(run, s, self._generate_sample)
                                       for s in group.samples if s.status in (Status.PENDING, Status.ABORTED)))
            if any(s.status in (Status.PENDING, Status.ABORTED) for s in group.samples):
                return Place.REQUEUE, None
            await self._score(group)
            return Place.RESULTS, None
        except GroupFailed as exc:
            return Place.DEAD, exc
        except ValueError as exc:  # the tokenizer or the chat template refused the prompt
            return Place.DEAD, GroupFailed(f"bad prompt: {exc}", DeadReason.INPUT)

    def _render_prompts(self, group: Group) -> None:
        """--apply-chat-template: each prompt rendered into sample.prompt once, as slime's
        Dataset renders it before anything sees it (the built-in path, generate functions and
        rewards alike); the pushed prompt is kept on the group for a restart."""
        if not self.settings.apply_chat_template or group.pushed_prompt is not None:
            return
        pushed = group.samples[0].prompt
        rendered: dict[int, str] = {}  # by prompt object: the samples of a group share theirs
        for s in group.samples:
            if id(s.prompt) not in rendered:
                rendered[id(s.prompt)] = render_prompt(self.tokenizer, s.prompt, _tools(s),
                                                       self.settings.apply_chat_template_kwargs)
            s.prompt = rendered[id(s.prompt)]
        group.pushed_prompt = pushed

    def _stamp_sampling(self, group: Group) -> None:
        """Record the settings this worker samples with. A group continued here after a
        worker with other settings started it starts over: one sample's tokens must come
        from one distribution, the one the trainer computes probabilities with."""
        mine = self.settings.sampling.record()
        if group.sampling is not None and group.sampling != mine:
            log.warning("group %s: started with %s, this worker samples with %s; generating it again from its "
                        "prompt", group.group_id, group.sampling, mine)
            group.reset()
        group.sampling = mine

    async def _generate_sample_in_slot(self, run: Running, sample: Sample, generate: Any) -> Any:
        try:
            return await generate(run, sample)
        finally:
            if run.slots > 1:  # the group's last slot goes with the group
                run.slots -= 1
                self.inflight_samples -= 1
                self.ctx.wake.set()

    async def _generate_sample(self, run: Running, sample: Sample) -> None:
        s, group = self.settings, run.group
        if not sample.tokens:
            sample.tokens = list(group.prompt_ids)
        failures = group.attempts  # carried over from earlier claims of this group
        attempt = 0
        budget = self._budget()
        while True:
            remaining = budget.tokens_left(sample.response_length)
            if remaining <= 0:
                sample.status = Status.TRUNCATED  # nothing left to generate (aborted at its last token): no request
                self._mask_offpolicy(sample)
                return
            if self.ctx.paused or self.engine_health.down is not None:
                # A weight update is under way (a request sent now would wait at the paused
                # engine where an abort cannot reach it), or the engines are down: leave the
                # sample as it is; the group is requeued and continues later, maybe elsewhere.
                return
            attempt += 1
            # A new request id per attempt: an engine still holding the first would refuse a
            # duplicate.
            rid = f"{self.ctx.id}/{run.serial}/{sample.index}/{attempt}"
            try:
                # The sample's own seed: a continued request draws from the same stream.
                params = s.sampling.params(remaining, group.sampling_seed(sample))
                result = await self._request(rid, sample.tokens, params)
                self._append(sample, result)
                budget.observe(result.weight_version)
                if result.finish_type != "abort":
                    self.engine_health.ok()
                    return
                if await self.engine_health.pause_explains_abort():
                    return  # requeued with its partial output; continues after the resume
                if self.engine_health.drained(result.url):
                    self.ctx.counters.drained += 1
                    continue  # a rolling weight update took that engine out: the next request goes elsewhere
                problem = budget.charge(progressed=bool(result.output_ids))
                if problem is None:
                    await self._preempted(sample, bool(result.output_ids))
                    continue
                error = EngineError(f"engine aborted request {rid} while nothing was paused: {problem} "
                                    f"({(result.finish_reason or {}).get('message', 'no message')})")
            except EngineRequestError as exc:
                metrics.ENGINE_ERRORS.labels("bad_request").inc()
                raise GroupFailed(f"engine rejected the request: {exc}", DeadReason.BAD_REQUEST) from None
            except EngineError as exc:  # unavailable, timed out, or an answer that breaks the protocol
                error = exc
            self.engine_health.failed(error)
            if self.engine_health.down is not None:
                return  # not this group's fault: it is requeued for a worker with engines
            # Attempts count per sample: the n samples of a group failing in the same
            # moment are one bad moment, not n. The group keeps its worst count.
            failures += 1
            group.attempts = max(group.attempts, failures)
            if failures >= s.max_attempts:
                raise GroupFailed(f"engine failed {failures} times; last error: {error}", DeadReason.ENGINE) from None
            delay = min(s.backoff_max_s, s.backoff_s * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)
            log.debug("group %s: engine error (%s); retry %d in %.1fs", group.group_id, error, failures, delay)
            await asyncio.sleep(delay)

    # -- samples made by a user's generate function -----------------------------------

    async def _generate_with_function(self, run: Running) -> None:
        """Every unfinished sample through the function, each in its slot. A sample the
        function turned into several (multi-agent) is replaced by them once they are all
        finished; a failure in one sample cancels the others (the group is dead-lettered)."""
        group = run.group
        todo = [s for s in group.samples if s.status in (Status.PENDING, Status.ABORTED)]
        if not todo:
            return
        tasks = [asyncio.ensure_future(self._generate_sample_in_slot(run, s, self._call_function)) for s in todo]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done():
                    task.result()  # the first GroupFailed
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        produced = {id(s): t.result() for s, t in zip(todo, tasks)}
        group.samples = [p for s in group.samples for p in produced.get(id(s), [s])]
        prompt_ids, problem = shared_prompt_ids(group.samples)
        if problem:
            self.ctx.counters.function_errors += 1
            raise GroupFailed(f"generate function {self.generate_function.name} returned {problem}",
                              DeadReason.GENERATE_FUNCTION)
        if prompt_ids:
            group.prompt_ids = prompt_ids  # stored once for the group (the wire format shares it)

    async def _call_function(self, run: Running, sample: Sample) -> list[Sample]:
        """What the function made of `sample`: finished samples, or the sample to store when
        a pause aborted it (or the engines are down): requeued. That is what the function
        left (--partial-rollout: it gets it back), or `sample` as it was: started again."""
        s, group = self.settings, run.group
        failures = group.attempts
        budget = self._budget()
        if not s.partial_rollout and sample.status == Status.ABORTED:
            sample.reset()  # left partial by a worker with --partial-rollout: it starts again here
        while True:
            if self.ctx.paused or self.engine_health.down is not None:
                return [sample]  # as in _generate_sample: requeued, continued later
            left = budget.tokens_left(sample.response_length)
            if left <= 0:  # the token budget holds across calls, as on the built-in path
                sample.status = Status.TRUNCATED
                return [sample]
            if s.partial_rollout and s.mask_offpolicy_prefix and sample.status == Status.ABORTED \
                    and sample.response_length:
                sample.loss_mask = [0] * sample.response_length  # slime's generate_and_rm does the same
            self.ctx.counters.function_calls += 1
            with self.engines.next_url() as i:  # the address the call is given, as for a request
                url = self.engines.urls[i]
                try:
                    produced = await self.generate_function.call(
                        generate_args(s, url, group.n_samples, self.reward_args), sample,
                        s.sampling.params(left), evaluation=run.queue is self.ctx.eval_queue,
                        timeout_s=s.sample_timeout_s)
                    problem = output_problem(sample, produced)
                    if problem:
                        raise GenerateFunctionFailed(f"generate function {self.generate_function.name} returned "
                                                     f"{problem}")
                except GenerateFunctionFailed as exc:
                    self.ctx.counters.function_errors += 1
                    raise GroupFailed(str(exc), DeadReason.GENERATE_FUNCTION) from None
            self.last_answer = time.monotonic()
            progressed = any(p.response_length > sample.response_length
                             or len(p.weight_versions) > len(sample.weight_versions) for p in produced)
            for p in produced:  # newer weights in an answer explain the aborts before it
                for version in p.weight_versions[len(sample.weight_versions):]:
                    budget.observe(version)
            if not any(p.status == Status.ABORTED for p in produced):
                for p in produced:
                    await self._stamp_versions(p, url, sample)
                    if p.status == Status.PENDING:
                        p.status = Status.COMPLETED  # a function that set no status: slime trains it as it is
                self.engine_health.ok()
                return produced
            metrics.SAMPLES_ABORTED.inc()
            if s.partial_rollout and len(produced) == 1:
                await self._stamp_versions(produced[0], url, sample)
                sample = produced[0]  # continued: the function gets it back as it left it
            else:
                # slime without --partial-rollout: what the old weights began is dropped and
                # the sample starts again from its prompt (a fan-out is never continued).
                self.ctx.counters.restarted += 1
            if await self.engine_health.pause_explains_abort():
                return [sample]
            if self.engine_health.drained(url):
                self.ctx.counters.drained += 1
                continue  # a rolling weight update took that engine out: the next call goes elsewhere
            # Unannounced (slime's updaters, an abort_all): a preemption when the engine made
            # something since the last call, as in _generate_sample; called again.
            problem = budget.charge(progressed)
            if problem is None:
                await self._preempted(sample, progressed)
                continue
            failures += 1
            group.attempts = max(group.attempts, failures)
            if failures >= s.max_attempts:
                raise GroupFailed(f"generate function {self.generate_function.name} returned an aborted sample "
                                  f"while nothing was paused: {problem} ({failures} failures)", DeadReason.ENGINE)
            delay = min(s.backoff_max_s, s.backoff_s * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)
            log.debug("group %s: aborted while nothing was paused; calling the function again in %.1fs",
                      group.group_id, delay)
            await asyncio.sleep(delay)

    async def _stamp_versions(self, sample: Sample, url: str, given: Sample) -> None:
        """A function that recorded no weight version for what it generated gets the one
        its engine reports now, so staleness checks see every generated segment. What it
        continued from `given` (--partial-rollout) was stamped before."""
        continued = sample.weight_versions[:len(given.weight_versions)] == given.weight_versions and \
            sample.response_length >= given.response_length
        known_versions, known_length = ((len(given.weight_versions), given.response_length) if continued else (0, 0))
        new = sample.weight_versions[known_versions:]
        if sample.response_length and sample.response_length != known_length and not new:
            try:
                version = await self.engines.weight_version_at(url)
            except EngineError as exc:
                raise GroupFailed(f"cannot read the weight version of {url} for a sample whose generate function "
                                  f"recorded none: {exc}", DeadReason.ENGINE) from None
            sample.weight_versions.append(version)
            new = [version]
        for version in new:
            self._check_version(version, url)
        segments = sample.metadata.get(SEGMENTS_KEY)
        if segments is not None and (len(segments) != len(sample.weight_versions)
                                     or sum(segments) != sample.response_length):
            del sample.metadata[SEGMENTS_KEY]  # the function's own bookkeeping: which call made what is unknown

    def _budget(self) -> SampleBudget:
        """One sample's budget of tokens and unexplained aborts (workers/sample_budget.py),
        the same on both paths."""
        s = self.settings
        return SampleBudget(s.sampling.max_new_tokens, s.max_preemptions, s.preemption_budget_s)

    async def _preempted(self, sample: Sample, progressed: bool) -> None:
        """An abort the sample's budget covers (workers/sample_budget.py): slime's weight
        updates pause the engines with mode abort, unannounced (the next answer's newer
        version refunds it), an `abort_all` (slime ends each of its rollouts so), a request
        aborted while it waited in the engine's queue. The sample keeps its tokens and
        continues, stamped with the versions that made them."""
        self.ctx.counters.preempted += 1
        if progressed:
            self.engine_health.ok()
        # A beat before continuing: slime reads /v1/loads right after its abort_all and
        # aborts again until the engine is idle. A paused engine holds the next request
        # until /continue_generation anyway.
        await asyncio.sleep(PREEMPTED_RETRY_S * random.uniform(0.8, 1.2))

    async def _request(self, rid: str, tokens: list[int], params: dict) -> GenerateResult:
        self.ctx.counters.requests += 1
        self.outstanding += 1
        started = time.monotonic()
        try:
            result = await self.engines.generate(tokens, params, rid=rid)
        except asyncio.CancelledError:  # reaped, shutting down, or the group is no longer ours
            self._abort_request(rid)
            raise
        except EngineError as exc:
            if exc.status is None and not isinstance(exc, EngineProtocolError):
                self._abort_request(rid)  # timed out or cut off: the engine may still be generating it
            raise
        finally:
            self.outstanding -= 1
        self.last_answer = time.monotonic()
        metrics.GENERATION_LATENCY.observe(self.last_answer - started)
        metrics.OUTPUT_TOKENS.observe(len(result.output_ids))
        return result

    def _append(self, sample: Sample, result: GenerateResult) -> None:
        """Add one engine answer to a sample; a continuation extends the previous one.

        The response text is decoded here from the response tokens, never taken from the
        engine's `text`: the reward must score what the trainer trains on, and an engine
        whose text says something its tokens do not would otherwise buy rewards."""
        n_new = len(result.output_ids)
        if n_new:
            self._refuse_unusable_version(result)
        previous_mask = sample.loss_mask
        sample.tokens += result.output_ids
        sample.response_length += n_new
        sample.response = self.tokenizer.decode(sample.response_tokens)
        sample.rollout_log_probs = (sample.rollout_log_probs or []) + result.output_log_probs
        segments = sample.metadata.setdefault(SEGMENTS_KEY, [])
        if n_new:  # a call that produced nothing (aborted while queued) adds no version
            sample.weight_versions.append(result.weight_version)
            segments.append(n_new)
            self._check_version(result.weight_version, result.url)
        sample.status = FINISH_STATUS[result.finish_type]
        if sample.status == Status.ABORTED:
            metrics.SAMPLES_ABORTED.inc()
        if previous_mask is not None:
            sample.loss_mask = previous_mask + [1] * n_new
        self._mask_offpolicy(sample)

    def _mask_offpolicy(self, sample: Sample) -> None:
        """With --mask-offpolicy-prefix, a finished sample's tokens from earlier weights get
        loss_mask 0, however it finished (an answer, or nothing left to generate)."""
        if self.settings.mask_offpolicy_prefix and sample.status != Status.ABORTED:
            sample.loss_mask = offpolicy_mask(sample.weight_versions, sample.metadata.get(SEGMENTS_KEY, []))

    def _refuse_unusable_version(self, result: GenerateResult) -> None:
        """Staleness on the engines' clock needs integer versions; SGLang allows any string.
        Read as 0, "v3" would make every group look stale and restart it forever: refuse
        the answer as an engine fault (retried, then engine-down in status) saying why."""
        version = result.weight_version
        if self.ctx.version_clock != VersionClock.ENGINE or version == "default" or _is_integer(version):
            return
        raise EngineProtocolError(
            f"engine {result.url or '(unknown)'} generates with weight version {version!r:.50}, not an integer: "
            "staleness is measured on the engines' versions here (version clock 'engine'); give the engines "
            "integer versions (update_weights ... weight_version=str(step)), or measure on the queue's clock "
            "(configure(version_clock='queue'), as the slime adapter does)", url=result.url)

    def _check_version(self, version: str, url: str | None) -> None:
        """An engine ahead of the queue's weight version means the trainer updates the
        engines without telling the queue: staleness checks would be off. Say so. On the
        queue's clock the slime adapter owns the version (slime's rollout id; slime numbers
        its engines' weights its own way) and bumps it itself: there, say what is wrong
        instead when an engine still has its initial weights."""
        if self.ctx.version_clock == VersionClock.QUEUE:
            self._check_slime_engine(version, url)
            return
        v = parse_version(version)
        if v is None or v <= self.ctx.queue_version:
            return
        self.ctx.counters.versions_ahead += 1
        if version not in self._warned:
            self._warned.add(version)
            log.warning("worker %s: an engine generates with weight version %s, ahead of the queue's %d: bump "
                        "the queue's version with every weight update (Controller.resume(weight_version=...), "
                        "`rollout resume --weight-version`); under slime nothing is to do: its adapter owns the "
                        "version once it reads this namespace", self.ctx.id, version, self.ctx.queue_version)

    def _check_slime_engine(self, version: str, url: str | None) -> None:
        """slime pushes its weights to its engines before its first rollout: past rollout 0,
        an engine still on its initial weights ("default") is one slime does not update."""
        engine = url or "(unknown)"
        if version != "default" or self.ctx.queue_version < 1 or engine in self._warned:
            return
        self._warned.add(engine)
        log.warning("worker %s: engine %s still serves its initial weights (weight version 'default') while the "
                    "slime adapter that owns this namespace's version is at rollout %d: slime updates only its own "
                    "engines, so this worker samples a policy nobody trains and the adapter refuses its groups; "
                    "start it with --engine-url on slime's engines or its router (docs/trainers.md, 'One set of "
                    "engines')", self.ctx.id, engine, self.ctx.queue_version)

    async def _score(self, group: Group) -> None:
        # slime's rule: a sample whose generate function set its reward is not scored again.
        # A group reward scores the whole group unless every sample has one (slime's --group-rm).
        for s in group.samples:
            if s.reward is not None:
                try:  # set by the generate function: held to the rules a reward's value is
                    s.reward = validate_reward(s.reward, getattr(self.reward_args, "reward_key", None),
                                               name=f"set by the generate function on sample {s.index}")
                except RewardError as exc:
                    raise GroupFailed(str(exc), DeadReason.REWARD) from None
        unscored = [s for s in group.samples if s.reward is None]
        if not unscored:
            return
        to_score = group.samples if getattr(self.reward, "group", False) else unscored
        for attempt in range(1, self.settings.max_attempts + 1):
            try:
                rewards = await asyncio.wait_for(self.reward.score(self.reward_args, to_score),
                                                 self.settings.reward_timeout_s)
                for s, r in zip(to_score, rewards):
                    s.reward = r
                return
            except MissingLabel as exc:
                self.ctx.counters.reward_errors += 1
                raise GroupFailed(f"{exc}; not retried: give the rows a label (push --label-key), or use a reward "
                                  f"that needs none", DeadReason.MISSING_LABEL) from None
            except (RewardError, asyncio.TimeoutError) as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    # A synchronous reward still running is abandoned on its thread, which
                    # gives its place back (RewardThreads): the group is retried meanwhile.
                    exc = RewardError(f"reward took longer than {self.settings.reward_timeout_s:g}s "
                                      f"(--reward-timeout); abandoned")
                self.ctx.counters.reward_errors += 1
                if attempt == self.settings.max_attempts:
                    raise GroupFailed(f"reward failed {attempt} times; last error: {exc}", DeadReason.REWARD) from None
                log.warning("group %s: reward error (%s); retry %d", group.group_id, exc, attempt)
                await asyncio.sleep(min(self.settings.backoff_max_s, self.settings.backoff_s * 2 ** (attempt - 1)))


def _tools(sample: Sample) -> list | None:
    """The tools slime's Dataset passes to the chat template (its --tool-key column, which it
    also keeps in metadata["tools"])."""
    tools = sample.metadata.get("tools") if isinstance(sample.metadata, dict) else None
    return tools if isinstance(tools, list) else None


def _is_integer(text: str) -> bool:
    return text.lstrip("-").isdigit() and text.isascii()


def offpolicy_mask(weight_versions: list[str], segment_lengths: list[int]) -> list[int]:
    """loss_mask 0 for tokens from engine calls whose weight version is not the one that
    finished the sample (slime's --mask-offpolicy-in-partial-rollout)."""
    final = weight_versions[-1]
    mask: list[int] = []
    for version, n in zip(weight_versions, segment_lengths):
        mask += [1 if version == final else 0] * n
    return mask
