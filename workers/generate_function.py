"""User generate functions (slime's `--custom-generate-function-path`) run in the worker.

A function written for slime runs unchanged:
``async def generate(args, sample, sampling_params[, evaluation=False]) -> Sample | list[Sample]``.
It makes its own engine calls (to ``http://{args.sglang_router_ip}:{args.sglang_router_port}``),
sets ``tokens``, ``response_length``, ``loss_mask`` (0 on tool and observation tokens),
``rollout_log_probs``, ``weight_versions`` and ``status`` (ABORTED when an answer came back
aborted), and may set ``reward``. It gets slime's `Sample` when slime is installed on the
worker, else ours (`pipeline.types.Sample`, which has slime's `append_response_tokens` and
`Sample.Status`).

`GenerateFunction.call` runs one call under a time limit and checks what came back; anything
wrong raises `GenerateFunctionFailed` with the error and the last frames of the traceback
(for a hang: where it hung). What happens next (requeue, retry, dead letter) is the
worker's business (workers/group_run.py).
"""
from __future__ import annotations

import asyncio
import copy
import inspect
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from pipeline.trainers.slime_types import from_slime_sample, slime_types, to_slime_sample
from pipeline.types import Sample

from .settings import WorkerSettings
from .user_code import load_function

#: Traceback frames a dead letter keeps of a function that raised or hung.
TRACEBACK_FRAMES = 5


class GenerateFunctionFailed(Exception):
    """The function raised, hung, or returned something that is not a usable sample."""


@dataclass
class GenerateFunction:
    fn: Any
    name: str
    takes_evaluation: bool  # slime passes `evaluation=` only to functions that declare it
    slime_samples: bool  # slime is installed: hand the function slime's Sample
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
        """The samples one call produced (one, or several for a multi-agent function).
        `sample` is updated in place with what the function left in it, so an aborted
        call's partial output is kept even when the function returned a new object."""
        if self.slime_samples:
            self._init_slime_http(args)
        given = to_slime_sample(sample) if self.slime_samples else sample
        kwargs = {"evaluation": evaluation} if self.takes_evaluation else {}
        task = asyncio.ensure_future(self.fn(args, given, sampling_params, **kwargs))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            where = _format_stack(_awaiting_frames(task.get_coro())[-TRACEBACK_FRAMES:])
            task.cancel()
            raise GenerateFunctionFailed(f"generate function {self.name} did not return within {timeout_s:g}s "
                                         f"(--sample-timeout); it was at:\n{where}")
        if task.cancelled():
            raise GenerateFunctionFailed(f"generate function {self.name} was cancelled from inside")
        exc = task.exception()
        if exc is not None:
            frames = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-TRACEBACK_FRAMES))
            raise GenerateFunctionFailed(f"generate function {self.name} raised {type(exc).__name__}: {exc}\n"
                                         f"{frames.rstrip()}")
        if self.slime_samples and given is not sample:
            _update(sample, from_slime_sample(given))  # the partial output, whatever it returned
        return [self._checked(s) for s in self._as_list(task.result())]

    def _init_slime_http(self, args: Any) -> None:
        """slime's `post` (slime.utils.http_utils), which its examples call, needs the client
        slime's RolloutManager makes at startup: make it once, sized by `args`."""
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

    def _as_list(self, result: Any) -> list[Any]:
        if isinstance(result, (list, tuple)) and result:
            return list(result)
        return [result]

    def _checked(self, result: Any) -> Sample:
        sample_type = slime_types().sample
        if not isinstance(result, (Sample, sample_type)):
            raise GenerateFunctionFailed(f"generate function {self.name} returned {type(result).__name__} "
                                         f"{result!r:.200}, not a Sample or a list of Samples")
        ours = result if isinstance(result, Sample) else from_slime_sample(result)
        problem = _inconsistency(ours)
        if problem:
            raise GenerateFunctionFailed(f"generate function {self.name} returned sample {ours.index} with {problem}")
        return ours


def _inconsistency(s: Sample) -> str | None:
    """What makes a sample unusable for training, or None (the trainer would fail far from the cause)."""
    if not 0 <= s.response_length <= len(s.tokens):
        return f"response_length {s.response_length} for {len(s.tokens)} tokens"
    if s.loss_mask is not None and len(s.loss_mask) != s.response_length:
        return f"{len(s.loss_mask)} loss_mask entries for {s.response_length} response tokens"
    if s.rollout_log_probs is not None and len(s.rollout_log_probs) != s.response_length:
        return f"{len(s.rollout_log_probs)} rollout_log_probs for {s.response_length} response tokens"
    return None


def _update(sample: Sample, source: Sample) -> None:
    for name in Sample.__dataclass_fields__:
        setattr(sample, name, getattr(source, name))


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
    """slime's `args` for one call: the reward's args (the worker's settings under slime's
    names), the engine or router to call as `sglang_router_ip`/`sglang_router_port`, and
    the other values slime's generate functions and their helpers read."""
    parts = urlsplit(engine_url)
    sp = settings.sampling
    args = copy.copy(base)
    args.__dict__.update(
        sglang_router_ip=parts.hostname, sglang_router_port=parts.port or (443 if parts.scheme == "https" else 80),
        hf_checkpoint=settings.tokenizer, n_samples_per_prompt=n_samples,
        rollout_max_response_len=sp.max_new_tokens, rollout_max_context_len=settings.max_context_len,
        sglang_server_concurrency=settings.concurrency_per_engine, rollout_num_engines=len(settings.engine_urls),
        use_distributed_post=False,
        rollout_skip_special_tokens=False, rollout_seed=42, apply_chat_template=settings.apply_chat_template,
        custom_generate_function_path=settings.generate_function,
        # The queue continues aborted samples by calling the function again with its partial
        # sample; slime's flag means its own buffer does, and its examples refuse it: off.
        partial_rollout=False, mask_offpolicy_in_partial_rollout=settings.mask_offpolicy_prefix,
        ci_test=False, use_rollout_routing_replay=False, sglang_enable_deterministic_inference=False,
        sglang_dp_size=None, sglang_speculative_algorithm=None, context_parallel_size=1,
        max_tokens_per_gpu=settings.max_context_len,
    )
    return args
