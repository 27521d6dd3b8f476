"""What the slime adapter refuses: slime settings and groups it would train on wrongly.

Each check raises `SlimeConfigError` with one line that names the setting and the fix;
none of them lets a run start (or a batch reach slime) that would train on the wrong
data without an error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipeline.consumer import Refusal
from pipeline.types import Group, SamplingRecord

#: slime's rollout function that calls `get_samples(1)` per group from a thread of its own.
FULLY_ASYNC_ROLLOUT = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
OUR_ROLLOUT = "pipeline.trainers.slime_adapter.generate_rollout"
#: The package of slime's own rollout functions.
SLIME_ROLLOUTS = "slime.rollout."
#: slime's --rollout-sample-filter-path: it is called with exactly the groups slime's rollout trains.
RECORD_TRAINED = "pipeline.trainers.slime_adapter.record_trained"


class SlimeConfigError(ValueError):
    """A slime setting (or a group) the adapter cannot train on correctly."""


class SamplingMismatch(SlimeConfigError):
    """Groups were sampled with settings other than slime's."""


#: The kind of a refusal of a group sampled with other settings (Refusal.kind, and its metric).
SAMPLING = "sampling"


def _names(path: Any, *ours: str) -> bool:
    return isinstance(path, str) and path.replace(":", ".") in ours


def uses_our_rollout(args: Any) -> bool:
    return _names(getattr(args, "rollout_function_path", OUR_ROLLOUT), OUR_ROLLOUT)


def uses_slimes_rollout(args: Any) -> bool:
    """slime's own rollout functions (its default, `slime.rollout.sglang_rollout.generate_rollout`),
    whose `generate_and_rm` reads the flags `check_ignored_flags` refuses; a rollout function of
    your own is trusted with them."""
    path = getattr(args, "rollout_function_path", OUR_ROLLOUT)
    return isinstance(path, str) and path.replace(":", ".").startswith(SLIME_ROLLOUTS)


def check_top_p(args: Any) -> None:
    """slime >= 0.3.1 asserts the top-p replay fields when --rollout-top-p != 1; the
    workers do not record them (nor would Megatron's loss match without them)."""
    top_p = getattr(args, "rollout_top_p", 1.0)
    if top_p is not None and top_p != 1.0:
        raise SlimeConfigError(
            f"--rollout-top-p {top_p}: the rollout queue's workers do not record the top-p replay "
            "(Sample.rollout_top_p_token_ids/offsets) slime needs to train with top-p sampling; run with "
            "--rollout-top-p 1.0 (and the workers with --top-p 1.0)")


def records_trained(args: Any) -> bool:
    """Whether slime tells the data source which groups its rollout trains."""
    return _names(getattr(args, "rollout_sample_filter_path", None), RECORD_TRAINED)


def check_data_source_use(args: Any) -> None:
    """With slime's own rollout over RedisDataSource, each `get_samples` must be one
    step's batch, all of it trained: slime discards what it over-samples. Its dynamic
    filter runs again after the Consumer's; when it drops a group (a random or stateful
    filter) slime reads again and trains only part of what it read, which only its
    --rollout-sample-filter-path call shows."""
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
    if _is_set(getattr(args, "dynamic_sampling_filter_path", None)) and not records_trained(args):
        raise SlimeConfigError(
            f"--dynamic-sampling-filter-path under slime's rollout over RedisDataSource: slime applies the filter "
            f"again after the queue's Consumer, and a group it then drops makes it read more and train only part "
            f"of what it read; set --rollout-sample-filter-path {RECORD_TRAINED} so the adapter commits only the "
            f"groups slime trains (a sample filter of your own can call record_trained(args, samples) itself)")


@dataclass(frozen=True)
class _Ignored:
    """A slime flag slime's rollout reads and the queue would not act on: what to do
    instead under the queue's rollout function (`ours`) and under slime's rollout over
    RedisDataSource (`slimes`; None: slime acts on it there)."""

    attr: str
    flag: str
    ours: str
    slimes: str | None = None
    with_group_rm: bool = False  # allowed over RedisDataSource with --group-rm (slime scores again)


#: Checked against slime main 624b824: slime/rollout/sglang_rollout.py (`generate_and_rm`
#: returns a completed or truncated sample before it would generate, run the sample hooks or
#: score; with --group-rm `generate_and_rm_group` scores every group again through
#: rm_hub.batched_async_rm, which reads --custom-rm-path or --rm-type), and
#: slime/rollout/data_source.py (only slime's buffer reads --buffer-filter-path).
_IGNORED = (
    _Ignored("custom_rm_path", "--custom-rm-path",
             "the workers score: start them with `rollout worker --reward {value}` (the same function)",
             "slime's rollout gets every sample finished and scored by the workers and never calls it: start "
             "the workers with `rollout worker --reward {value}`, or add --group-rm to have slime score every "
             "group again (in batch mode); for slime's own eval set custom_rm_path per dataset in --eval-config",
             with_group_rm=True),
    _Ignored("rm_type", "--rm-type",
             "the workers score: start them with `rollout worker --reward slime.rollout.rm_hub.async_rm "
             "--rm-type {value}`",
             "slime's rollout gets every sample finished and scored by the workers and never scores it: start "
             "the workers with `rollout worker --reward slime.rollout.rm_hub.async_rm --rm-type {value}`, or add "
             "--group-rm to have slime score every group again; for slime's own eval set rm_type per dataset in "
             "--eval-config", with_group_rm=True),
    _Ignored("group_rm", "--group-rm", "the workers score: start them with `rollout worker --reward <path> "
             "--group-reward`"),
    _Ignored("custom_generate_function_path", "--custom-generate-function-path",
             "the workers generate: start them with `rollout worker --generate-function {value}`",
             "slime's rollout gets every sample finished by the workers and never generates: start them with "
             "`rollout worker --generate-function {value}`; for slime's own eval set custom_generate_function_path "
             "per dataset in --eval-config"),
    _Ignored("rollout_sample_hook_path", "--rollout-sample-hook-path",
             "slime's rollout is not run: do the hook's work in the workers' --generate-function or --reward",
             "slime runs sample hooks only on samples it generated itself, never on the finished samples it gets "
             "here: do the hook's work in the workers' `rollout worker --generate-function` or `--reward`"),
    _Ignored("rollout_sample_filter_path", "--rollout-sample-filter-path",
             "filter groups in the queue with --dynamic-sampling-filter-path (its Consumer applies it)"),
    _Ignored("rollout_all_samples_process_path", "--rollout-all-samples-process-path",
             "slime's rollout is not run: process samples in the workers' --reward or a "
             "--dynamic-sampling-filter-path"),
    _Ignored("buffer_filter_path", "--buffer-filter-path",
             "the queue has no buffer filter: the results stream is read oldest first; drop groups with "
             "--dynamic-sampling-filter-path",
             "only slime's own buffer (RolloutDataSourceWithBuffer) calls it: RedisDataSource serves the results "
             "stream oldest first; drop groups with --dynamic-sampling-filter-path (the queue's Consumer applies "
             "it) or score them in the workers (`rollout worker --reward`)"),
    _Ignored("mask_offpolicy_in_partial_rollout", "--mask-offpolicy-in-partial-rollout",
             "the workers continue partial samples and know each token's version: start them with "
             "`rollout worker --mask-offpolicy-prefix` and drop this flag",
             "over RedisDataSource slime's rollout gets finished groups and would zero every loss mask: start the "
             "workers with `rollout worker --mask-offpolicy-prefix` and drop this flag"),
)


def _is_set(value: Any) -> bool:
    return value not in (None, False, "", [], ())


def check_ignored_flags(args: Any) -> None:
    """Refuse at start what slime would accept and the queue would silently not do. Under
    the queue's rollout function slime's own rollout never runs, so none of its rollout
    flags does anything. Over RedisDataSource slime's own rollout runs on finished, scored
    groups: it generates, hooks and scores nothing (but with --group-rm, which scores
    again), and it would zero the loss masks for off-policy masking."""
    ours, slimes = uses_our_rollout(args), uses_slimes_rollout(args)
    group_rm = _is_set(getattr(args, "group_rm", None))
    refused = [(f.flag, (f.ours if ours else f.slimes).format(value=getattr(args, f.attr)))
               for f in _IGNORED if _is_set(getattr(args, f.attr, None))
               and (ours or (slimes and f.slimes is not None and not (f.with_group_rm and group_rm)))]
    over, batch = getattr(args, "over_sampling_batch_size", None), getattr(args, "rollout_batch_size", None)
    if ours and over is not None and batch is not None and over != batch:
        refused.append(("--over-sampling-batch-size", f"the queue reads exactly --rollout-batch-size {batch} "
                        f"groups; the workers generate ahead on their own (max_ready) and the Consumer "
                        f"replaces filtered groups: drop the flag"))
    if refused:
        lines = "; ".join(f"{flag}: {todo}" for flag, todo in refused)
        raise SlimeConfigError(f"slime flags the rollout queue would ignore ({lines})")


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
    def listed(name: str) -> tuple | None:
        if not hasattr(args, name):
            return None
        return tuple(getattr(args, name) or ())

    return {
        "temperature": getattr(args, "rollout_temperature", 1.0),
        "top_p": getattr(args, "rollout_top_p", 1.0),
        "top_k": getattr(args, "rollout_top_k", -1),
        "max_new_tokens": getattr(args, "rollout_max_response_len", None),
        "stop": listed("rollout_stop"),
        "stop_token_ids": listed("rollout_stop_token_ids"),
        "skip_special_tokens": getattr(args, "rollout_skip_special_tokens", None),
    }


_FLAGS = {"temperature": ("--rollout-temperature", "--temperature"), "top_p": ("--rollout-top-p", "--top-p"),
          "top_k": ("--rollout-top-k", "--top-k"),
          "max_new_tokens": ("--rollout-max-response-len", "--max-new-tokens"),
          "stop": ("--rollout-stop", "--stop"), "stop_token_ids": ("--rollout-stop-token-ids", "--stop-token-id"),
          "skip_special_tokens": ("--rollout-skip-special-tokens", "--skip-special-tokens/--keep-special-tokens")}


def _differs(ours: Any, theirs: Any) -> bool:
    if ours is None:  # recorded by a worker that did not say: nothing to compare
        return False
    if isinstance(ours, tuple) or isinstance(theirs, tuple):  # stop lists: the order does not matter
        return sorted(ours) != sorted(theirs)
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return bool(ours) != bool(theirs)
    if isinstance(ours, float) or isinstance(theirs, float):
        return not math.isclose(float(ours), float(theirs), rel_tol=1e-6, abs_tol=1e-9)
    return ours != theirs


def _worker_flag(name: str, value: Any) -> str:
    """The `rollout worker` flags that sample with `value`."""
    flag = _FLAGS[name][1]
    if name == "skip_special_tokens":
        return "--skip-special-tokens" if value else "--keep-special-tokens"
    if isinstance(value, tuple):
        return " ".join(f"{flag} {v!r}" if isinstance(v, str) else f"{flag} {v}" for v in value) or f"no {flag}"
    return f"{flag} {value}"


def sampling_refusals(args: Any, groups: list[Group]) -> list[Refusal | None]:
    """For each group, a Refusal if it was not sampled with slime's settings. Megatron
    divides the logits by --rollout-temperature: tokens drawn at another temperature (or
    under another top-k) make the PPO ratio and importance weights wrong without an error."""
    wanted = slime_sampling(args)
    return [_sampling_refusal(group, wanted) for group in groups]


def _sampling_refusal(group: Group, wanted: dict[str, Any]) -> Refusal | None:
    record: SamplingRecord | None = group.sampling
    if record is None:
        return Refusal(SAMPLING, f"group {group.group_id} carries no sampling settings (a worker older than this "
                                 f"check published it)")
    for name, theirs in wanted.items():
        ours = getattr(record, name)
        if theirs is not None and _differs(ours, theirs):
            return Refusal(SAMPLING, f"group {group.group_id} was sampled by worker {group.worker} with {name} "
                                     f"{ours}, slime trains with {_FLAGS[name][0]} {theirs}: start the workers "
                                     f"with {_worker_flag(name, theirs)}")
    return None
