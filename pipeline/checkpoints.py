"""In-flight checkpoints (invariant 12): the partial samples of a claimed group, saved in
Redis while it is generated, so that a crash costs seconds of decoding, not whole samples.

Where they live: beside the group's payload, keyed by group id (`checkpoints` holds each
group's header, `checkpoint_records` its records; lua/_prelude.lua). A checkpoint is
written only by the holder of the group's claim, under its token (lua/checkpoint.lua), in
one script call for every group a worker writes at once. It never outlives the payload:
a reap, a hand-back or a departure leave both, and the next claim hands the checkpoint out
with the group (lua/claim.lua); a publish (results, requeue, dead) and a dead letter by
`max_claims` delete both (`drop_payload`). So the checkpoints are bounded by the groups
queued or in flight, each by CHECKPOINT_MAX_RECORDS records and CHECKPOINT_MAX_BYTES.

A record holds, per sample that changed, its tokens from where the last record left it
(pipeline/codec.py): appending costs the new tokens, not the whole sample again; a full
write (the first of a claim, or when the records reach their bound) replaces them all.
`CheckpointLog` is the writer's side for one group: what Redis holds of each sample and
the write that brings it up to date.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import StrEnum

from .codec import DecodeError, SampleProgress, decode_checkpoint, encode_checkpoint_record
from .types import SEGMENTS_KEY, Group, Sample, Status

#: Records a checkpoint may hold; a writer past it writes the checkpoint whole (one record).
CHECKPOINT_MAX_RECORDS = 32
#: Bytes a checkpoint's records may take: 16 samples of 64k tokens at ~9 bytes each, with room.
CHECKPOINT_MAX_BYTES = 16 << 20
#: The header schema lua/checkpoint.lua writes.
HEADER_SCHEMA = "c1"
_FINISHED = (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)


class CheckpointOutcome(StrEnum):
    """What lua/checkpoint.lua did with one group's write."""

    OK = "ok"
    ALREADY = "already"  # a retry of a write that went through (its reply was lost)
    REFUSED = "refused"  # the writer no longer holds the group under this token (reaped, handed back, published)
    RESYNC = "resync"  # an append to a checkpoint other than the one the writer saw: write it whole
    TOO_LARGE = "too_large"  # the checkpoint would be over CHECKPOINT_MAX_BYTES


@dataclass
class CheckpointWrite:
    """One group's part of Queue.checkpoint: a record replacing the checkpoint (`full`) or
    appended to the `records_before` records its writer knows of."""

    group_id: str
    token: str  # the claim the writer holds the group under
    record: bytes  # codec.encode_checkpoint_record
    full: bool
    records_before: int
    tokens: int  # response tokens of every sample in the checkpoint after this write
    write_id: str = field(default_factory=lambda: secrets.token_hex(6))


@dataclass
class CheckpointHeader:
    writer: str  # the claim token of the last write
    records: int
    bytes: int
    tokens: int
    write_id: str
    written_ms: list[int]  # Redis time of each record

    @classmethod
    def parse(cls, raw: bytes | str) -> CheckpointHeader:
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        parts = text.split(" ")
        try:
            if parts[0] != HEADER_SCHEMA or len(parts) != 7:
                raise ValueError
            header = cls(parts[1], int(parts[2]), int(parts[3]), int(parts[4]), parts[5],
                         [int(t) for t in parts[6].split(",")] if parts[6] else [])
        except (ValueError, IndexError):
            raise DecodeError(f"checkpoint header {text[:80]!r} is not one of schema {HEADER_SCHEMA}") from None
        if len(header.written_ms) != header.records:
            raise DecodeError(f"checkpoint header names {header.records} records and {len(header.written_ms)} times")
        return header


@dataclass
class GroupCheckpoint:
    """A group's checkpoint as read from Redis (a claim's reply, `rollout inspect`)."""

    header: CheckpointHeader
    samples: dict[int, SampleProgress]  # by position in the group

    @classmethod
    def from_reply(cls, reply: list) -> GroupCheckpoint:
        """From lua/_prelude.lua's checkpoint_of: [header, record 1, ...]. Raises DecodeError."""
        if not isinstance(reply, list) or not reply:
            raise DecodeError("no checkpoint header")
        header = CheckpointHeader.parse(reply[0])
        records = reply[1:]
        if len(records) != header.records or not all(isinstance(r, bytes) and r for r in records):
            raise DecodeError(f"checkpoint header names {header.records} records, {len(records)} are stored")
        return cls(header, decode_checkpoint(records, header.written_ms))

    @property
    def updated_ms(self) -> int:
        return max(self.header.written_ms, default=0)


@dataclass(frozen=True)
class _Saved:
    """What Redis holds of one sample: enough to tell what changed since."""

    length: int
    versions: tuple[str, ...]
    segments: tuple[int, ...] | None
    status: Status
    # The sample's token list when written (a reference: a sample restarted and grown past this
    # length since has another list), and its last response token: a prefix that changed is
    # written anew, never extended.
    tokens: list[int] | None = field(default=None, compare=False)
    last: int | None = field(default=None, compare=False)

    @classmethod
    def of(cls, sample: Sample) -> _Saved:
        tokens = sample.tokens if sample.response_length else None
        return cls(sample.response_length, tuple(sample.weight_versions),
                   _tuple(sample.metadata.get(SEGMENTS_KEY)), sample.status, tokens,
                   tokens[-1] if tokens else None)

    def continued_by(self, sample: Sample) -> bool:
        """`sample` is this one with (maybe) more tokens: the same list, the same last token."""
        if not self.length:
            return True
        tokens = sample.tokens
        return (tokens is self.tokens and sample.response_length >= self.length
                and tokens[len(tokens) - sample.response_length + self.length - 1] == self.last)


def _tuple(values: list | None) -> tuple | None:
    return None if values is None else tuple(values)


class CheckpointLog:
    """The writer's side of one claimed group's checkpoint: `next_write` makes the write
    that brings Redis up to date with the group's samples (None: nothing changed), and
    `settle` takes what Redis answered. The first write of a claim, and one after Redis
    asked for it, is full; the rest append what changed: a sample's tokens after those
    saved, or the sample from its start when its tokens are not the ones saved continued
    (restarted, replaced) or it finished (its loss mask may have been rewritten). After
    putting a claimed checkpoint back into the group's samples, call `resumed`."""

    def __init__(self, group_id: str, token: str, claimed: GroupCheckpoint | None = None,
                 whole_samples: bool = False):
        self.group_id, self.token = group_id, token
        self.whole_samples = whole_samples  # keep text, metadata and reward too (a generate function's samples)
        self.saved: dict[int, _Saved] = {}
        self.records = self.bytes = 0
        self.full = True  # the next write replaces the checkpoint
        self.stopped = False  # the group is not ours any more, or its checkpoint cannot fit
        if claimed is not None:  # continue the checkpoint handed out with the claim
            self.records, self.bytes, self.full = claimed.header.records, claimed.header.bytes, False
            self.saved = {i: _Saved(len(p.response_ids), tuple(p.weight_versions), _tuple(p.segments), p.status)
                          for i, p in claimed.samples.items()}
        self._pending: dict[int, _Saved] = {}

    def resumed(self, group: Group) -> None:
        """The group's samples now hold what the claimed checkpoint holds (the caller put it
        back into them): the next write extends them instead of writing them anew."""
        for i, saved in list(self.saved.items()):
            if i < len(group.samples) and group.samples[i].response_length == saved.length:
                self.saved[i] = _Saved.of(group.samples[i])

    def next_write(self, group: Group) -> CheckpointWrite | None:
        if self.stopped:
            return None
        tokens = sum(s.response_length for s in group.samples)
        full = self.full or self.records >= CHECKPOINT_MAX_RECORDS or self.bytes > 2 * (9 * tokens + 4096)
        changes, state = [], {}
        for i, s in enumerate(group.samples):
            now = _Saved.of(s)
            before = self.saved.get(i)
            if full:
                if not now.length and now.status == Status.PENDING:
                    continue  # nothing to keep
                offset = 0
            elif before is not None and now == before and before.continued_by(s):
                continue
            elif before is None or not before.continued_by(s) or (now.status in _FINISHED
                                                                  and now.status != before.status):
                offset = 0
            else:
                offset = before.length
            changes.append((i, offset, SampleProgress.of(s, group.prompt_ids, self.whole_samples)))
            state[i] = now
        if not changes and not (full and self.records):
            return None
        self._pending = state
        return CheckpointWrite(self.group_id, self.token, encode_checkpoint_record(changes), full,
                               self.records, tokens)

    def settle(self, write: CheckpointWrite, outcome: CheckpointOutcome) -> None:
        if outcome in (CheckpointOutcome.OK, CheckpointOutcome.ALREADY):
            if write.full:
                self.saved, self.records, self.bytes = dict(self._pending), 1, len(write.record)
            else:
                self.saved.update(self._pending)
                self.records, self.bytes = self.records + 1, self.bytes + len(write.record)
            self.full = False
        elif outcome == CheckpointOutcome.RESYNC or (outcome == CheckpointOutcome.TOO_LARGE and not write.full):
            self.full = True
        else:  # refused: not held any more; too large even whole: nothing more is saved
            self.stopped = True
        self._pending = {}
