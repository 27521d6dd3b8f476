"""The data that moves through the pipeline: samples, groups and their status.

Field names follow slime's `Sample` (see shared/SLIME_CONTRACT.md) so a slime
Sample can be built from ours without loss.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from typing import Any


class Status(StrEnum):
    """slime's sample status values; a StrEnum, so they serialize as their value."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class PauseMode(StrEnum):
    """How SGLang's /pause_generation treats running requests (SGLANG_API.md)."""

    ABORT = "abort"  # running requests return at once with finish_reason abort
    RETRACT = "retract"  # requests go back to the engine's waiting queue, KV cache dropped
    IN_PLACE = "in_place"  # requests freeze where they are and continue on resume


class ReleasePolicy(StrEnum):
    """What happens to an aborted (requeued) group when admission reopens."""

    CONTINUE = "continue"  # back to the prompt list with its partial output
    RESTART = "restart"  # back to the prompt list from its prompt
    DROP = "drop"  # dropped, logged


class VersionClock(StrEnum):
    """What a group's age in weight versions is measured with (control `version_clock`)."""

    # The engines' weight_version in each answer (Sample.weight_versions): for trainers that
    # bump the queue's version with every weight update they push (Controller.resume).
    ENGINE = "engine"
    # The queue's version when the group was first claimed (Group.admitted_version): for
    # trainers whose engines count versions their own way, like slime (its updater numbers
    # weights from 1 in every run; the queue's version is slime's rollout id).
    QUEUE = "queue"


class DeadReason(StrEnum):
    """A dead letter's category (its stream entry's `reason`, the `dead_<reason>` counter,
    `dead list`): why a group failed for good, in a word."""

    ENGINE = "engine"  # engine failures past the attempt limit
    BAD_REQUEST = "bad_request"  # the engine refused the request (4xx)
    REWARD = "reward"  # the reward failed past the attempt limit
    MISSING_LABEL = "missing_label"  # the reward needs a label the row does not have
    INPUT = "input"  # a prompt the worker cannot tokenize or send
    ENCODE = "encode"  # the generated group cannot be stored
    GENERATE_FUNCTION = "generate_function"  # the user's generate function failed
    WORKER_ERROR = "worker_error"  # a bug in the worker itself
    MALFORMED = "malformed"  # an entry or payload that does not decode
    MAX_CLAIMS = "max_claims"  # claimed again and again without finishing (it kills its workers)
    BAD_ROW = "bad_row"  # a dataset row pushed with --skip-bad
    STALE = "stale"  # too stale at consumption, restarted from its prompt max_restarts times already
    FILTER = "filter"  # the trainer's filter raised on it
    DELIVERIES = "deliveries"  # delivered to the trainer max_deliveries times without a commit


def choices(enum: type[Enum]) -> list[str]:
    """The values of a closed vocabulary, for click.Choice and error messages."""
    return [m.value for m in enum]


def member(enum: type[Enum], value: object, what: str) -> Enum:
    """`value` as a member of `enum`, or a ValueError that names `what` and the choices."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(choices(enum))}") from None


# sample.metadata key: tokens produced by each engine call, in order (one entry per
# weight_versions entry), for masking off-policy prefixes.
SEGMENTS_KEY = "rollout_segments"
_SEED_MASK = 2**63 - 1  #: sampling seeds are non-negative int64, as torch generators take


@dataclass(eq=False)
class Sample:
    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict] = ""
    label: str | None = None
    metadata: dict = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)  # prompt + response ids
    response_length: int = 0  # how many of `tokens` at the end are the response
    response: str = ""
    reward: float | dict | None = None
    loss_mask: list[int] | None = None  # None means all ones
    rollout_log_probs: list[float] | None = None
    weight_versions: list[str] = field(default_factory=list)
    status: Status = Status.PENDING

    def __eq__(self, other: object) -> bool:
        # Field by field, so a codec.PackedSample equals the Sample it was encoded from.
        if not isinstance(other, Sample):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(Sample))

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length:] if self.response_length else []

    def reset(self) -> None:
        """Forget everything generated: the sample as it was pushed."""
        self.tokens, self.response_length, self.response = [], 0, ""
        self.reward, self.loss_mask, self.rollout_log_probs = None, None, None
        self.weight_versions, self.status = [], Status.PENDING
        self.metadata.pop(SEGMENTS_KEY, None)

    def append_response_tokens(self, args: Any = None, *, tokens: list[int] | None = None,
                               log_probs: list[float] | None = None, trainable: bool = True,
                               meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """slime's method, for generate functions written for slime: engine tokens
        (`trainable`, with their log-probs and the answer's `meta_info`) or tool and
        observation tokens (loss mask 0, log-prob 0.0). An answer's meta_info adds its
        weight version (one per engine call, as slime) and sets the status from its finish
        reason; an engine call's tokens and the tool tokens after them are one segment
        (`SEGMENTS_KEY`)."""
        tokens = [int(t) for t in tokens or []]
        log_probs = None if log_probs is None else [float(lp) for lp in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        previous = self.response_length
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            self.loss_mask = ([1] * previous if self.loss_mask is None else self.loss_mask) + \
                [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and previous:
                    raise ValueError("cannot append trainable log probabilities to a sample with response tokens "
                                     "but no rollout_log_probs")
                self.rollout_log_probs = [0.0] * previous
            self.rollout_log_probs += log_probs
        segments = self.metadata.setdefault(SEGMENTS_KEY, [])
        if meta_info and update_terminal_info and "finish_reason" in meta_info and "weight_version" in meta_info:
            self.weight_versions.append(str(meta_info["weight_version"]))
            segments.append(len(tokens))
        elif segments:
            segments[-1] += len(tokens)  # tool output counts with the engine call before it
        if meta_info and update_terminal_info and "finish_reason" in meta_info:
            finish = (meta_info["finish_reason"] or {}).get("type")
            self.status = {"length": Status.TRUNCATED, "abort": Status.ABORTED,
                           "stop": Status.COMPLETED}.get(finish, self.status)

    def get_reward_value(self, args: Any) -> Any:
        """slime's accessor: with `--reward-key`, the reward is a dict and that key wins."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key and isinstance(self.reward, dict) else self.reward

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        """Inverse of `to_dict` (ours or slime's) for the fields Sample has; the others are
        ignored. `status` may be a string or any enum member with our values."""
        kwargs = {k: v for k, v in data.items() if k in _SAMPLE_FIELD_NAMES}
        if "status" in kwargs:
            kwargs["status"] = Status(getattr(kwargs["status"], "value", kwargs["status"]))
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """slime's `Sample.to_dict` shape: status as its string value."""
        return {
            "group_index": self.group_index,
            "index": self.index,
            "prompt": self.prompt,
            "label": self.label,
            "metadata": self.metadata,
            "tokens": list(self.tokens),
            "response_length": self.response_length,
            "response": self.response,
            "reward": self.reward,
            "loss_mask": self.loss_mask,
            "rollout_log_probs": self.rollout_log_probs,
            "weight_versions": list(self.weight_versions),
            "status": self.status.value,
        }


_SAMPLE_FIELD_NAMES = frozenset(Sample.__dataclass_fields__)
# slime's spelling, `Sample.Status.ABORTED`, for functions written against slime's Sample.
Sample.Status = Status  # type: ignore[attr-defined]


def parse_version(version: str | int | None) -> int | None:
    """Weight versions are strings on the engine side ("default" before any
    update); the pipeline counts them as integers. Non-numeric means 0."""
    if version is None:
        return None
    if isinstance(version, int):
        return version
    try:
        return int(version)
    except ValueError:
        return 0


@dataclass(frozen=True)
class SamplingRecord:
    """The sampling settings a group's tokens were drawn with, stored with the group so a
    trainer can check they are the ones it computes the policy's probabilities with."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool | None = None  # None: recorded by a worker that did not say


@dataclass
class Group:
    """`n_samples_per_prompt` copies of one prompt; the unit of work and of training."""

    group_id: str  # stable across requeues: "<dataset>:<epoch>:<row>"
    samples: list[Sample]
    prompt_ids: list[int] = field(default_factory=list)  # tokenized prompt, shared by samples
    attempts: int = 0  # engine/reward failures so far
    restarts: int = 0  # times restarted from the prompt because too stale
    admitted_version: int | None = None  # trainer weight version at first claim
    dataset: str = ""
    epoch: int = 0
    row: int = 0
    created_at: float = field(default_factory=time.time)
    claimed_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None  # last worker that held it
    error: str | None = None  # why it was dead-lettered
    sampling: SamplingRecord | None = None  # set by the worker that generated it

    @classmethod
    def fresh(cls, group_id: str, prompt: str | list[dict], n_samples: int, label: str | None = None,
              metadata: dict | None = None, dataset: str = "", epoch: int = 0, row: int = 0,
              group_index: int | None = None) -> Group:
        """A new group of `n_samples` copies of one prompt, as the producer pushes it.
        `group_index` (default: the row) numbers groups; sample indices follow from it."""
        group_index = row if group_index is None else group_index
        samples = [
            Sample(group_index=group_index, index=group_index * n_samples + i, prompt=prompt, label=label,
                   metadata=dict(metadata or {}))
            for i in range(n_samples)
        ]
        return cls(group_id=group_id, samples=samples, dataset=dataset, epoch=epoch, row=row)

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    def reset(self) -> Group:
        """The group as it was pushed: every generated token forgotten."""
        for s in self.samples:
            s.reset()
        self.prompt_ids = []
        self.sampling = None
        return self

    def sampling_seed(self, sample: Sample) -> int:
        """The seed `sample` is generated with (SGLang's sampling_seed): fixed by the
        dataset, epoch, sample index and restarts, so a request continued after an abort
        draws from the same stream, and two systems given the same data draw the same
        responses from the simulator (whose whole response follows from the seed)."""
        key = f"{self.dataset}|{self.epoch}|{sample.index}|{self.restarts}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _SEED_MASK

    def oldest_version(self, clock: VersionClock = VersionClock.ENGINE) -> int | None:
        """The oldest weight version that produced any token of this group, on `clock`."""
        if clock == VersionClock.QUEUE:
            return self.admitted_version
        versions = [parse_version(v) for s in self.samples for v in s.weight_versions]
        versions = [v for v in versions if v is not None]
        if versions:
            return min(versions)
        return self.admitted_version
