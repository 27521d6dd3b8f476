"""What the slime adapter refuses: slime settings and groups it would train on wrongly.

Each check raises `SlimeConfigError` with one line that names the setting and the fix;
none of them lets a run start (or a batch reach slime) that would train on the wrong
data without an error.
"""
from __future__ import annotations

import math
from typing import Any

from pipeline.types import Group, SamplingRecord

#: slime's rollout function that calls `get_samples(1)` per group from a thread of its own.
FULLY_ASYNC_ROLLOUT = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
OUR_ROLLOUT = "pipeline.trainers.slime_adapter.generate_rollout"


class SlimeConfigError(ValueError):
    """A slime setting (or a group) the adapter cannot train on correctly."""


class SamplingMismatch(SlimeConfigError):
    """Groups were sampled with settings other than slime's."""


def _names(path: Any, *ours: str) -> bool:
    return isinstance(path, str) and path.replace(":", ".") in ours


def uses_our_rollout(args: Any) -> bool:
    return _names(getattr(args, "rollout_function_path", OUR_ROLLOUT), OUR_ROLLOUT)


def check_top_p(args: Any) -> None:
    """slime >= 0.3.1 asserts the top-p replay fields when --rollout-top-p != 1; the
    workers do not record them (nor would Megatron's loss match without them)."""
    top_p = getattr(args, "rollout_top_p", 1.0)
    if top_p is not None and top_p != 1.0:
        raise SlimeConfigError(
            f"--rollout-top-p {top_p}: the rollout queue's workers do not record the top-p replay "
            "(Sample.rollout_top_p_token_ids/offsets) slime needs to train with top-p sampling; run with "
            "--rollout-top-p 1.0 (and the workers with --top-p 1.0)")


def check_data_source_use(args: Any) -> None:
    """With slime's own rollout over RedisDataSource, each `get_samples` must be one
    step's batch, all of it trained: slime discards what it over-samples."""
    rollout = getattr(args, "rollout_function_path", OUR_ROLLOUT)
    if _names(rollout, FULLY_ASYNC_ROLLOUT):
        raise SlimeConfigError(
            f"--rollout-function-path {rollout} calls get_samples(1) per group from a thread and keeps its own "
            f"in-memory pool: it cannot run over RedisDataSource (nothing it holds would survive a restart, and "
            f"commits could not follow training); use --rollout-function-path {OUR_ROLLOUT}: the queue's "
            f"workers are the fully asynchronous rollout")
    if uses_our_rollout(args):
        return
    over = getattr(args, "over_sampling_batch_size", None)
    batch = getattr(args, "rollout_batch_size", None)
    if over is not None and batch is not None and over != batch:
        raise SlimeConfigError(
            f"--over-sampling-batch-size {over} != --rollout-batch-size {batch}: slime's rollout trains "
            f"{batch} of the groups it reads and drops the rest, which the queue would then count as trained; "
            f"set --over-sampling-batch-size {batch} (filtering happens in the queue's Consumer), or use "
            f"--rollout-function-path {OUR_ROLLOUT}")


def check_backlog(pending_groups: int, max_ready: int) -> None:
    """Commits follow checkpoints, so up to `pending_groups` stay in the results stream
    between two saves; they count toward max_ready, at which workers stop claiming."""
    if pending_groups > max_ready:
        raise SlimeConfigError(
            f"up to {pending_groups} groups stay uncommitted between two checkpoints (--save-interval + 2 "
            f"rollouts of --rollout-batch-size groups), more than the namespace's max_ready of {max_ready}, at "
            f"which workers stop claiming: raise it (`rollout configure --max-ready {pending_groups * 2}`) or "
            f"save more often")


def slime_sampling(args: Any) -> dict[str, Any]:
    """slime's sampling settings that a group's must equal (None: not set in slime)."""
    return {
        "temperature": getattr(args, "rollout_temperature", 1.0),
        "top_p": getattr(args, "rollout_top_p", 1.0),
        "top_k": getattr(args, "rollout_top_k", -1),
        "max_new_tokens": getattr(args, "rollout_max_response_len", None),
    }


_FLAGS = {"temperature": ("--rollout-temperature", "--temperature"), "top_p": ("--rollout-top-p", "--top-p"),
          "top_k": ("--rollout-top-k", "--top-k"),
          "max_new_tokens": ("--rollout-max-response-len", "--max-new-tokens")}


def _differs(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return not math.isclose(float(ours), float(theirs), rel_tol=1e-6, abs_tol=1e-9)
    return ours != theirs


def sampling_mismatches(args: Any, groups: list[Group]) -> list[tuple[Group, str]]:
    """(group, why) for each group not sampled with slime's settings. Megatron divides
    the logits by --rollout-temperature: tokens drawn at another temperature (or under
    another top-k) make the PPO ratio and importance weights wrong without an error."""
    wanted = slime_sampling(args)
    out = []
    for group in groups:
        record: SamplingRecord | None = group.sampling
        if record is None:
            why = (f"group {group.group_id} carries no sampling settings (a worker older than this check "
                   f"published it)")
            out.append((group, why))
            continue
        for name, theirs in wanted.items():
            ours = getattr(record, name)
            if theirs is not None and _differs(ours, theirs):
                slime_flag, worker_flag = _FLAGS[name]
                why = (f"group {group.group_id} was sampled by worker {group.worker} with {name} {ours}, slime "
                       f"trains with {slime_flag} {theirs}: start the workers with {worker_flag} {theirs}")
                out.append((group, why))
                break
    return out
