"""User generate functions (slime's `--custom-generate-function-path`) run in the worker.

A function written for slime runs unchanged:
``async def generate(args, sample, sampling_params[, evaluation=False]) -> Sample | list[Sample]``.
It makes its own engine calls (to ``http://{args.sglang_router_ip}:{args.sglang_router_port}``),
sets ``tokens``, ``response_length``, ``loss_mask`` (0 on tool and observation tokens),
``rollout_log_probs``, ``weight_versions`` and ``status`` (ABORTED when an answer came back
aborted), may set ``reward`` and any attribute of its own. It gets slime's `Sample` when slime
is installed on the worker, else ours (`pipeline.types.Sample`, which declares every field
slime's does and has its methods).

The worker hands each call a copy of its sample and keeps nothing user code holds: what
the function returns is snapshotted (deep-copied, every attribute) the moment it returns,
on the function's own event loop, and that snapshot is what is checked, scored, published
and trained on; a task the function left running cannot change it. The snapshot is held
to slime's rules and to its group (`output_problem`); anything else raises
`GenerateFunctionFailed` naming the rule and the sample.

Functions run on an event loop of their own, in a thread (`UserLoop`; slime runs them on
one background loop too): one that blocks its loop (retool's sandbox waits up to 120 s in
`subprocess.communicate`) holds up other calls of user code, never the worker's heartbeat.

`GenerateFunction.call` runs one call under a time limit; anything wrong raises
`GenerateFunctionFailed` with the error and the last frames of the traceback (for a hang:
where it hung). What happens next (requeue, retry, dead letter) is the worker's business
(workers/group_run.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import threading
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from pipeline.codec import EncodeError, check_sample
from pipeline.trainers.slime_types import from_slime_sample, slime_types, to_slime_sample
from pipeline.types import Sample, Status

from .settings import WorkerSettings
from .user_code import load_function

#: Traceback frames a dead letter keeps of a function that raised or hung.
TRACEBACK_FRAMES = 5


class GenerateFunctionFailed(Exception):
    """The function raised, hung, or returned something that is not a usable sample."""


class UserLoop:
    """One thread running one event loop, where every call of user generate functions runs.
    One loop, as slime's: module-level asyncio objects of the examples (retool's and
    search-r1's semaphores) and slime's shared HTTP client bind to the loop that first
    uses them."""

    def __init__(self, name: str = "generate-function"):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def submit(self, coro: Any) -> concurrent.futures.Future:
        """Run `coro` on the loop; cancelling the future cancels its task there."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True).start()
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self) -> None:
        """Cancel what still runs there and stop the thread (a call blocked in user code
        keeps its daemon thread until it returns)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return

        def stop() -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.call_soon(loop.stop)

        loop.call_soon_threadsafe(stop)


@dataclass
class GenerateFunction:
    fn: Any
    name: str
    takes_evaluation: bool  # slime passes `evaluation=` only to functions that declare it
    slime_samples: bool  # slime is installed: hand the function slime's Sample
    loop: UserLoop = field(default_factory=UserLoop)
    _slime_http_ready: bool = field(default=False, init=False)

    @classmethod
    def from_path(cls, path: str) -> GenerateFunction:
        fn = load_function(path, "generate function")
        if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
            raise ValueError(f"generate function {path!r} must be an async function "
                             f"(async def generate(args, sample, sampling_params))")
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            parameters = {}
        return cls(fn, path, "evaluation" in parameters, slime_types().real)

    async def call(self, args: Any, sample: Sample, sampling_params: dict, evaluation: bool,
                   timeout_s: float) -> list[Sample]:
        """The samples one call returned, as snapshots (our Samples, every attribute kept),
        checked on their own (`sample_problem`); `sample` itself is never handed out or changed."""
        given = to_slime_sample(snapshot(sample)) if self.slime_samples else snapshot(sample)
        kwargs = {"evaluation": evaluation} if self.takes_evaluation else {}
        coro = self._run(args, given, sampling_params, kwargs)
        future = asyncio.wrap_future(self.loop.submit(coro))
        try:
            done, _ = await asyncio.wait({future}, timeout=timeout_s)
        except asyncio.CancelledError:
            future.cancel()
            raise
        if not done:
            where = _format_stack(_awaiting_frames(coro)[-TRACEBACK_FRAMES:])
            future.cancel()
            raise GenerateFunctionFailed(f"generate function {self.name} did not return within {timeout_s:g}s "
                                         f"(--sample-timeout); it was at:\n{where}")
        if future.cancelled():
            raise GenerateFunctionFailed(f"generate function {self.name} was cancelled from inside")
        exc = future.exception()
        if isinstance(exc, GenerateFunctionFailed):
            raise exc
        if exc is not None:
            frames = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-TRACEBACK_FRAMES))
            raise GenerateFunctionFailed(f"generate function {self.name} raised {type(exc).__name__}: {exc}\n"
                                         f"{frames.rstrip()}")
        return [self._ours(s) for s in future.result()]

    async def _run(self, args: Any, given: Any, sampling_params: dict, kwargs: dict) -> list[Any]:
        """On the user loop: the call, then its snapshot before anything else there runs."""
        if self.slime_samples:
            self._init_slime_http(args)
        result = await self.fn(args, given, sampling_params, **kwargs)
        returned = list(result) if isinstance(result, (list, tuple)) and result else [result]
        if len({id(r) for r in returned}) != len(returned):
            raise GenerateFunctionFailed(f"generate function {self.name} returned one sample object several "
                                         f"times: each sample it returns must be an object of its own")
        sample_type = slime_types().sample
        for r in returned:
            if not isinstance(r, (Sample, sample_type)):
                raise GenerateFunctionFailed(f"generate function {self.name} returned {type(r).__name__} "
                                             f"{r!r:.200}, not a Sample or a list of Samples")
        try:
            return [snapshot(r) for r in returned]  # at return: what user code does with its objects later is its own
        except Exception as exc:
            raise GenerateFunctionFailed(f"generate function {self.name} returned a sample that cannot be copied "
                                         f"({type(exc).__name__}: {exc}); attributes must be JSON values") from None

    def _init_slime_http(self, args: Any) -> None:
        """slime's `post` (slime.utils.http_utils), which its examples call, needs the client
        slime's RolloutManager makes at startup: make it once, sized by `args`, on this loop."""
        if self._slime_http_ready:
            return
        try:
            from slime.utils.http_utils import init_http_client
        except ImportError:  # a slime without it: its functions post their own way
            init_http_client = None
        if init_http_client is not None:
            try:
                init_http_client(args)
            except Exception as exc:
                raise GenerateFunctionFailed(f"slime's init_http_client, which slime's post needs, failed: "
                                             f"{type(exc).__name__}: {exc}") from exc
        self._slime_http_ready = True

    def _ours(self, snapshot: Any) -> Sample:
        """The snapshot as our Sample (slime's carries its attributes along), checked alone."""
        if isinstance(snapshot, Sample):
            ours = snapshot
        else:
            try:
                ours = from_slime_sample(snapshot)
            except (ValueError, TypeError, AttributeError) as exc:
                raise GenerateFunctionFailed(f"generate function {self.name} returned sample "
                                             f"{getattr(snapshot, 'index', '?')} that is not slime's shape: "
                                             f"{type(exc).__name__}: {exc}") from None
        problem = sample_problem(ours)
        if problem:
            raise GenerateFunctionFailed(f"generate function {self.name} returned sample {ours.index} with {problem}")
        return ours


#: Sample fields whose lists hold numbers or strings: a copy of the list copies its values.
_FLAT_LISTS = frozenset({"tokens", "loss_mask", "rollout_log_probs", "weight_versions", "rollout_top_p_token_ids",
                         "rollout_top_p_token_offsets", "teacher_log_probs"})


def snapshot(sample: Any) -> Any:
    """A deep copy of a sample (ours or slime's), every attribute; the long lists of
    numbers copied as lists, their items being immutable (the deep copy's per-item work
    was most of a call's cost: bench/generate_call.py)."""
    copied = copy.copy(sample)
    memo = {id(sample): copied}
    for name, value in vars(sample).items():
        copied.__dict__[name] = list(value) if name in _FLAT_LISTS and type(value) is list else \
            copy.deepcopy(value, memo)
    return copied


def sample_problem(s: Sample) -> str | None:
    """What makes one returned sample unusable for training, or None: lengths that disagree
    (the trainer would fail far from the cause), or a field the wire format cannot carry."""
    problem = s.length_problem()
    if problem:
        return problem
    if s.loss_mask is not None and not set(s.loss_mask) <= {0, 1}:
        return "loss_mask values other than 0 and 1"
    try:
        check_sample(s)
    except EncodeError as exc:
        return str(exc)
    return None


def output_problem(given: Sample, produced: list[Sample]) -> str | None:
    """What makes one call's output not the sample it was called for, or None. slime's own
    rules: a list return turns the sample into siblings that keep its index and
    group_index and share a rollout_id (`validate_rollout_id_annotated`)."""
    for p in produced:
        if (p.index, p.group_index) != (given.index, given.group_index):
            return (f"sample {p.index} of group_index {p.group_index} for a call made for sample {given.index} of "
                    f"group_index {given.group_index}: each sample of the group is returned by its own call, "
                    f"under its own index")
    if len(produced) > 1 and (produced[0].rollout_id is None or
                              any(p.rollout_id != produced[0].rollout_id for p in produced)):
        return (f"{len(produced)} samples for sample {given.index} without one shared rollout_id "
                f"(slime's rule for a sample turned into several)")
    return None


def shared_prompt_ids(samples: list[Sample]) -> tuple[list[int], str | None]:
    """The prompt ids the group's finished samples start with, and what is wrong if they
    do not agree: each sample returned by a call of its own (not a fan-out) holds one
    prompt's tokenization before its response. Returns ([], None) when none is finished."""
    counts: dict[Any, int] = {}
    for s in samples:
        counts[s.index] = counts.get(s.index, 0) + 1
    shared: list[int] | None = None
    first = None
    for s in samples:
        if counts[s.index] > 1 or s.status in (Status.PENDING, Status.ABORTED):
            continue
        prompt_ids = s.tokens[:len(s.tokens) - s.response_length]
        if shared is None:
            shared, first = prompt_ids, s.index
        elif prompt_ids != shared:
            return [], (f"sample {s.index} whose tokens before its response ({len(prompt_ids)} ids) are not the "
                        f"prompt ids sample {first} of its group starts with ({len(shared)} ids): a group is one "
                        f"prompt, and response tokens must follow its ids")
    return shared or [], None


def _awaiting_frames(coro: Any) -> list:
    """The frames of a suspended coroutine and of each coroutine it awaits, outermost first
    (Task.get_stack gives only the outermost)."""
    frames = []
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        frames.append(coro.cr_frame)
        coro = coro.cr_await
    return frames


def _format_stack(frames: list) -> str:
    lines = [f"  {f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}" for f in frames]
    return "\n".join(lines) or "  (no frames: it was not started)"


def generate_args(settings: WorkerSettings, engine_url: str, n_samples: int, base: SimpleNamespace) -> SimpleNamespace:
    """slime's `args` for one call, a namespace of its own (a function may set attributes on
    it, or deep-copy it): the reward's args (the worker's settings under slime's names), the
    engine or router to call as `sglang_router_ip`/`sglang_router_port`, and the other
    values slime's generate functions and their helpers read."""
    parts = urlsplit(engine_url)
    sp = settings.sampling
    args = copy.deepcopy(base)
    args.__dict__.update(
        sglang_router_ip=parts.hostname, sglang_router_port=parts.port or (443 if parts.scheme == "https" else 80),
        hf_checkpoint=settings.tokenizer, n_samples_per_prompt=n_samples,
        rollout_max_response_len=sp.max_new_tokens, rollout_max_context_len=settings.max_context_len,
        sglang_server_concurrency=settings.concurrency_per_engine, rollout_num_engines=len(settings.engine_urls),
        # strands-sglang sizes its client from these (concurrency x gpus / gpus per engine)
        rollout_num_gpus=len(settings.engine_urls), rollout_num_gpus_per_engine=1,
        eval_max_context_len=settings.max_context_len,
        use_distributed_post=False,
        rollout_skip_special_tokens=False, rollout_seed=42, apply_chat_template=settings.apply_chat_template,
        apply_chat_template_kwargs=dict(settings.apply_chat_template_kwargs),
        custom_generate_function_path=settings.generate_function,
        # The truth: with --partial-rollout an aborted sample comes back to the function as it
        # left it; without, it starts again from its prompt (slime's examples assert it is off).
        partial_rollout=settings.partial_rollout, mask_offpolicy_in_partial_rollout=settings.mask_offpolicy_prefix,
        ci_test=False, use_rollout_routing_replay=False, sglang_enable_deterministic_inference=False,
        sglang_dp_size=None, sglang_speculative_algorithm=None, context_parallel_size=1,
        max_tokens_per_gpu=settings.max_context_len,
    )
    return args
