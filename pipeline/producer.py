"""The producer: push prompt groups from a JSONL or Parquet dataset.

The cursor (next position in each epoch's order) lives in Redis and advances in the
same script that pushes, so pushing again resumes where the last push stopped and a
(dataset, epoch, row) is never pushed twice.

A cursor is a position in one file's rows in one order, so it is kept with a
fingerprint of both (`Fingerprint`): the file's content, the shuffle and seed, the
samples per prompt and the keys read. Resuming with anything else would skip some
rows and push others twice, so it is refused, naming the difference and the ways
out: another `--dataset-name`, or `--restart-cursor` (everything again, under new
group ids, since the old ones may already be trained on).

Every row is checked before the first push: JSON (NaN is not JSON), the keys and
types, text the wire format can store (no lone surrogates), values msgpack can
encode, the size (`max_prompt_bytes`) and, with a token counter, the engine's
context. A bad row refuses the file, or with `skip_bad` is dead-lettered with its
first KBs and its size. Bad rows do not count towards the content fingerprint, so
the file can be fixed in place; `rollout dead retry` then re-reads the row
(`reread_rows`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack

from .codec import encode_group
from .queue import Queue
from .retry import Reconnect
from .types import Group

log = logging.getLogger(__name__)

#: Default for PushOptions.max_prompt_bytes: a row's prompt, label and metadata as stored.
DEFAULT_MAX_PROMPT_BYTES = 4 * 1024 * 1024
#: How much of a bad row its dead letter keeps (its size is kept too).
RAW_KEPT_CHARS = 2000
_FINGERPRINT_FIELD = "fingerprint"
_RUNS_FIELD = "runs"  # cursor restarts of a dataset, for the group ids of the next run


class DatasetError(ValueError):
    """A dataset row is unusable: the message names the file, the line and why."""


@dataclass
class PushOptions:
    input_key: str = "input"
    label_key: str | None = "label"
    metadata_key: str | None = "metadata"
    n_samples_per_prompt: int = 1
    epochs: int = 1
    shuffle: bool = False
    seed: int = 42
    skip_bad: bool = False  # dead-letter bad rows instead of refusing the file
    dataset_name: str | None = None  # default: the file name
    chunk_size: int = 500
    max_queued: int | None = None  # feeder mode: wait while the prompt list holds this many
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    # Prompt length in tokens (a tokenizer and its chat template, given by the caller:
    # pipeline/ does not tokenize) and the engine's context; longer prompts are bad rows.
    count_tokens: Callable[[str | list[dict]], int] | None = None
    context_length: int | None = None
    restart_cursor: bool = False  # forget this dataset's cursor; push everything again


@dataclass
class Row:
    index: int  # position in the file (0-based)
    where: str  # "file:line" for messages
    prompt: str | list[dict] | None = None
    label: str | None = None
    metadata: dict = field(default_factory=dict)
    error: str | None = None
    raw: str = ""  # the first RAW_KEPT_CHARS of the row, for its dead letter
    raw_bytes: int = 0
    digest: bytes = b""  # of the whole row, for the content fingerprint


@dataclass
class Fingerprint:
    """What a dataset's cursor positions refer to, recorded with it."""

    path: str
    size: int
    rows: int
    content: str  # hash of every row's digest, bad rows left out
    shuffle: bool
    seed: int
    n_samples: int
    input_key: str
    label_key: str | None
    metadata_key: str | None
    bad_rows: list[int] = field(default_factory=list)  # dead-lettered; may be fixed in place
    run: int = 0  # times the cursor was restarted: part of the group ids after the first

    def differences(self, new: Fingerprint) -> list[str]:
        """What makes `new` another dataset than this one, as 'what: was -> now'."""
        out = []
        if (self.content, self.rows) != (new.content, new.rows):
            out.append(f"content: {self.rows} rows, {self.size:,} bytes in {self.path} -> "
                       f"{new.rows} rows, {new.size:,} bytes in {new.path}")
        if self.shuffle != new.shuffle:
            out.append(f"shuffle: {self.shuffle} -> {new.shuffle}")
        elif self.shuffle and self.seed != new.seed:
            out.append(f"seed: {self.seed} -> {new.seed}")
        for name in ("n_samples", "input_key", "label_key", "metadata_key"):
            if getattr(self, name) != getattr(new, name):
                out.append(f"{name}: {getattr(self, name)!r} -> {getattr(new, name)!r}")
        return out


@dataclass
class Dataset:
    """A file's rows, as read once, with what identifies them."""

    path: Path
    size: int
    rows: list[Row]

    def content_hash(self, leave_out: set[int]) -> str:
        h = hashlib.blake2b(digest_size=16)
        for row in self.rows:
            h.update(b"-" if row.index in leave_out else row.digest)
        return h.hexdigest()

    def fingerprint(self, opts: PushOptions, bad_rows: list[int], run: int = 0) -> Fingerprint:
        return Fingerprint(path=str(self.path.resolve()), size=self.size, rows=len(self.rows),
                           content=self.content_hash(set(bad_rows)), shuffle=opts.shuffle, seed=opts.seed,
                           n_samples=opts.n_samples_per_prompt, input_key=opts.input_key,
                           label_key=opts.label_key, metadata_key=opts.metadata_key, bad_rows=bad_rows, run=run)


@dataclass
class PushReport:
    dataset: str
    rows: int
    pushed: int = 0
    dead: int = 0
    already: int = 0  # positions an earlier push had covered
    #: Good rows without a label: a reward that needs one (the default, math_boxed) dead-letters
    #: their groups on the first attempt.
    without_label: int = 0


# -- reading ------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _stored_size(row: Row) -> int:
    """Bytes of the row's prompt, label and metadata as msgpack stores them; raises
    for what msgpack cannot store (lone surrogates, datetimes, huge integers)."""
    return len(msgpack.packb([row.prompt, row.label, row.metadata], use_bin_type=True))


def _check_row(row: Row, opts: PushOptions) -> None:
    """The checks that need the whole row: storable, size, context. Sets row.error."""
    try:
        size = _stored_size(row)
    except UnicodeEncodeError:
        row.error = "holds text that is not valid UTF-8 (a lone surrogate such as \\ud800)"
        return
    except (TypeError, ValueError, OverflowError) as exc:
        row.error = f"holds a value that cannot be stored: {exc}"
        return
    if size > opts.max_prompt_bytes:
        row.error = f"is {size:,} bytes, over the limit of {opts.max_prompt_bytes:,} (--max-prompt-bytes)"
        return
    if opts.count_tokens is not None and opts.context_length is not None:
        try:
            n_tokens = opts.count_tokens(row.prompt)
        except ValueError as exc:
            row.error = f"prompt cannot be tokenized: {exc}"
            return
        if n_tokens >= opts.context_length:
            row.error = (f"prompt is {n_tokens:,} tokens, which leaves no room in the engine's context of "
                         f"{opts.context_length:,} (--context-length)")


#: Field names datasets commonly use for the prompt and the label, likeliest first.
PROMPT_KEYS = ("prompt", "question", "problem", "instruction", "query", "messages", "text")
LABEL_KEYS = ("answer", "label", "solution", "ground_truth", "target", "reference")


def _key_hint(record: dict, opts: PushOptions) -> str:
    """`: pass --input-key prompt --label-key answer` when the row's fields look like that."""
    prompt_key = next((k for k in PROMPT_KEYS if k in record), None)
    if prompt_key is None:
        return ""
    flags = f"--input-key {prompt_key}"
    if opts.label_key and opts.label_key not in record:
        label_key = next((k for k in LABEL_KEYS if k in record), None)
        if label_key is not None:
            flags += f" --label-key {label_key}"
    return f": pass {flags}"


def _row_from_record(record: Any, index: int, where: str, opts: PushOptions, raw: str) -> Row:
    row = Row(index=index, where=where, raw=raw[:RAW_KEPT_CHARS], raw_bytes=len(raw.encode("utf-8", "replace")))
    if not isinstance(record, dict):
        row.error = f"expected a JSON object, got {type(record).__name__}"
        return row
    if opts.input_key not in record:
        row.error = (f"missing key {opts.input_key!r} (have: {', '.join(sorted(map(str, record))) or 'none'})"
                     f"{_key_hint(record, opts)}")
        return row
    prompt = record[opts.input_key]
    chat = isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    if not (isinstance(prompt, str) and prompt) and not (chat and prompt):
        row.error = (f"{opts.input_key!r} must be a non-empty string or a list of "
                     f"{{role, content}} messages, got {type(prompt).__name__}: {str(prompt)[:80]!r}")
        return row
    row.prompt = prompt
    if opts.label_key and record.get(opts.label_key) is not None:
        label = record[opts.label_key]
        if isinstance(label, float) and not math.isfinite(label):
            row.error = f"{opts.label_key!r} is {label}, not a usable label"
            return row
        if isinstance(label, (int, float)) and not isinstance(label, bool):
            label = str(label)
        if not isinstance(label, str):
            row.error = f"{opts.label_key!r} must be a string or number, got {type(label).__name__}"
            return row
        row.label = label
    if opts.metadata_key and record.get(opts.metadata_key) is not None:
        metadata = record[opts.metadata_key]
        if not isinstance(metadata, dict):
            row.error = f"{opts.metadata_key!r} must be an object, got {type(metadata).__name__}"
            return row
        row.metadata = metadata
    _check_row(row, opts)
    return row


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def load_dataset(path: str | Path, opts: PushOptions) -> Dataset:
    """Every row of the file, bad ones marked with their error."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if path.suffix == ".parquet":
        rows = _read_parquet(path, opts)
    else:
        rows = _read_jsonl(path, opts)
    return Dataset(path=path, size=path.stat().st_size, rows=rows)


def _read_jsonl(path: Path, opts: PushOptions) -> list[Row]:
    rows: list[Row] = []
    with path.open("rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            text = line.decode("utf-8", errors="replace")
            try:
                record = json.loads(line, parse_constant=_reject_constant)
            except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
                row = Row(index=len(rows), where=where, error=f"invalid JSON: {exc}", raw=text[:RAW_KEPT_CHARS],
                          raw_bytes=len(line))
            except RecursionError:
                row = Row(index=len(rows), where=where, error="invalid JSON: nested too deeply",
                          raw=text[:RAW_KEPT_CHARS], raw_bytes=len(line))
            else:
                row = _row_from_record(record, len(rows), where, opts, text)
            row.digest = _digest(line.rstrip(b"\r\n"))
            rows.append(row)
    return rows


def _read_parquet(path: Path, opts: PushOptions) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install -e '.[parquet]' in your clone)") from None
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises many types for a broken file
        raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
    rows = []
    for i, record in enumerate(records):
        raw = json.dumps(record, default=str)
        row = _row_from_record(record, i, f"{path}:row {i + 1}", opts, raw)
        row.digest = _digest(raw.encode("utf-8", "surrogatepass"))
        rows.append(row)
    return rows


# -- the cursor and its fingerprint -------------------------------------------------------


def _fingerprint_field(dataset: str) -> str:
    return f"{dataset}:{_FINGERPRINT_FIELD}"


def _read_fingerprint(queue: Queue, dataset: str) -> Fingerprint | None:
    raw = queue.redis.hget(queue.keys.dataset, _fingerprint_field(dataset))
    if raw is None:
        return None
    try:
        return Fingerprint(**json.loads(raw))
    except (ValueError, TypeError):
        raise DatasetError(f"dataset {dataset!r}: its recorded fingerprint is corrupt ({raw[:80]!r}); start it over "
                           "with --restart-cursor, or push under another --dataset-name") from None


def _cursor_fields(queue: Queue, dataset: str) -> list[str]:
    pattern = re.compile(re.escape(dataset) + r":\d+")
    return [f for f in (k.decode("utf-8", "replace") for k in queue.redis.hkeys(queue.keys.dataset))
            if pattern.fullmatch(f)]


def read_cursor(queue: Queue, dataset: str, epoch: int) -> int:
    """Rows of `epoch` pushed so far (their order: `epoch_order`)."""
    raw = queue.redis.hget(queue.keys.dataset, f"{dataset}:{epoch}")
    try:
        cursor = int(raw or 0)
    except ValueError:
        cursor = -1
    if cursor < 0:
        raise DatasetError(f"dataset {dataset!r}: the cursor of epoch {epoch} holds {raw[:40]!r}, not a position; "
                           "start the dataset over with --restart-cursor")
    return cursor


def _claim_fingerprint(queue: Queue, dataset: str, data: Dataset, opts: PushOptions) -> Fingerprint:
    """The fingerprint this push goes on with: recorded now if there is none, else
    the recorded one, if the file and options are the same dataset."""
    bad_now = [r.index for r in data.rows if r.error]
    if opts.restart_cursor:
        # Counted apart from the fingerprint, which may be what was corrupt.
        run = int(queue.redis.hincrby(queue.keys.dataset, f"{dataset}:{_RUNS_FIELD}", 1))
        new = data.fingerprint(opts, bad_now, run)
        pipe = queue.redis.pipeline(transaction=True)
        for name in _cursor_fields(queue, dataset):
            pipe.hdel(queue.keys.dataset, name)
        pipe.hset(queue.keys.dataset, _fingerprint_field(dataset), json.dumps(asdict(new)))
        pipe.execute()
        log.warning("dataset %s: cursor restarted (run %d): every row is pushed again", dataset, run)
        return new
    recorded = _read_fingerprint(queue, dataset)
    if recorded is None:
        new = data.fingerprint(opts, bad_now)
        if queue.redis.hsetnx(queue.keys.dataset, _fingerprint_field(dataset), json.dumps(asdict(new))):
            if _cursor_fields(queue, dataset):
                log.warning("dataset %s: pushed before without a fingerprint; recording this file's now", dataset)
            return new
        recorded = _read_fingerprint(queue, dataset)  # another producer recorded one meanwhile
        assert recorded is not None
    # Rows dead-lettered by the first push may have been fixed in place since.
    now = data.fingerprint(opts, recorded.bad_rows, recorded.run)
    differences = recorded.differences(now)
    if differences:
        raise DatasetError(
            f"dataset {dataset!r} was pushed before from another file or with other options "
            f"({'; '.join(differences)}): resuming its cursor would skip some rows and push others twice. "
            "Push it as a new dataset with --dataset-name NAME, or start it over with --restart-cursor")
    if now.path != recorded.path:
        log.info("dataset %s: same content as %s, now read from %s", dataset, recorded.path, now.path)
    return recorded


# -- pushing --------------------------------------------------------------------------


def epoch_order(n_rows: int, epoch: int, opts: PushOptions) -> list[int]:
    order = list(range(n_rows))
    if opts.shuffle:
        random.Random(opts.seed + epoch).shuffle(order)
    return order


def push_dataset(queue: Queue, source: str | Path | Dataset, opts: PushOptions | None = None,
                 progress: Callable[[int], None] | None = None, reconnect: Reconnect | None = None) -> PushReport:
    """Push every (epoch, row) not pushed yet. Raises DatasetError on the first bad row
    unless `skip_bad`, in which case bad rows go to the dead-letter stream; and when
    the dataset's recorded fingerprint does not match (see the module docstring).

    With `reconnect` (a feeder), the pushing rides out Redis restarts: a chunk whose
    reply was lost is pushed again under the same cursor, which the push script refuses
    if the first try moved it, so nothing is pushed twice."""
    opts = opts or PushOptions()
    if opts.n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be at least 1, got {opts.n_samples_per_prompt}")
    if opts.epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {opts.epochs}")
    data = source if isinstance(source, Dataset) else load_dataset(source, opts)
    rows = data.rows
    bad = [r for r in rows if r.error]
    if bad and not opts.skip_bad:
        more = f" (and {len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
        raise DatasetError(f"{bad[0].where}: {bad[0].error}{more}; fix it or pass --skip-bad to dead-letter bad rows")
    dataset = opts.dataset_name or data.path.name
    report = PushReport(dataset=dataset, rows=len(rows),
                        without_label=sum(1 for r in rows if not r.error and r.label is None))
    if not rows:
        log.warning("%s holds no rows: nothing to push", data.path)
        return report
    fingerprint = _claim_fingerprint(queue, dataset, data, opts)
    call = reconnect.call if reconnect else (lambda fn, *args: fn(*args))
    for epoch in range(opts.epochs):
        order = epoch_order(len(rows), epoch, opts)
        field_name = f"{dataset}:{epoch}"
        cursor = call(read_cursor, queue, dataset, epoch)
        report.already += min(cursor, len(order))
        while cursor < len(order):
            room = call(_wait_for_room, queue, opts.max_queued)
            chunk = [rows[i] for i in order[cursor:cursor + min(opts.chunk_size, room)]]
            items = [_item(row, dataset, fingerprint.run, epoch, len(rows), opts) for row in chunk]
            ok, new_cursor = call(queue.push, field_name, cursor, items)
            if not ok:
                log.warning("dataset %s epoch %d: the cursor moved to %d (another producer, or this push's own "
                            "earlier try whose reply was lost); continuing from there",
                            dataset, epoch, new_cursor)
                cursor = new_cursor
                continue
            dead = sum(1 for dest, _, _ in items if dest != "prompt")
            report.pushed += len(items) - dead
            report.dead += dead
            cursor = new_cursor
            if progress:
                progress(len(items))
    return report


def group_id(dataset: str, run: int, epoch: int, row: int) -> str:
    """`<dataset>:<epoch>:<row>`; after a --restart-cursor the dataset part carries the
    run (`<dataset>#<run>`), since the first run's ids may already be trained on."""
    name = dataset if run == 0 else f"{dataset}#{run}"
    return f"{name}:{epoch}:{row}"


def _group(row: Row, gid: str, dataset: str, epoch: int, n_rows: int, n_samples: int) -> Group:
    group_index = epoch * n_rows + row.index  # unique across epochs, so sample indices are too
    return Group.fresh(gid, row.prompt, n_samples, row.label, row.metadata,
                       dataset=dataset, epoch=epoch, row=row.index, group_index=group_index)


def _item(row: Row, dataset: str, run: int, epoch: int, n_rows: int, opts: PushOptions) -> tuple[str, str, bytes]:
    gid = group_id(dataset, run, epoch, row.index)
    if row.error:
        log.error("%s: %s; dead-lettering the row as group %s", row.where, row.error, gid)
        # One placeholder sample: with none, Group.fresh drops the metadata and the raw line with it.
        group = Group.fresh(gid, "", 1, metadata={"raw": row.raw, "raw_bytes": row.raw_bytes},
                            dataset=dataset, epoch=epoch, row=row.index)
        group.error = f"{row.where}: {row.error}"
        return group.error, gid, encode_group(group)
    return "prompt", gid, encode_group(_group(row, gid, dataset, epoch, n_rows, opts.n_samples_per_prompt))


def _wait_for_room(queue: Queue, max_queued: int | None) -> int:
    """How many groups may be pushed now (feeder mode waits until there is room)."""
    if max_queued is None:
        return 1 << 62
    while True:
        room = max_queued - queue.redis.llen(queue.keys.prompts)
        if room > 0:
            return room
        time.sleep(0.2)


# -- fixed rows -----------------------------------------------------------------------


def reread_rows(queue: Queue, groups: list[Group]) -> list[Group | str]:
    """For dead-lettered dataset rows: the group each row makes now that its file was
    fixed (same group id, for the same place in the books), or why it still cannot
    be pushed. The file is the one recorded in the dataset's fingerprint, read with
    the options of the push, and must be that dataset still, bad rows aside."""
    loaded: dict[str, tuple[Fingerprint, Dataset] | str] = {}
    out: list[Group | str] = []
    for group in groups:
        if group.dataset not in loaded:
            loaded[group.dataset] = _load_recorded(queue, group.dataset)
        source = loaded[group.dataset]
        if isinstance(source, str):
            out.append(source)
            continue
        fingerprint, data = source
        row = data.rows[group.row] if 0 <= group.row < len(data.rows) else None
        if row is None:
            out.append(f"{fingerprint.path} has no row {group.row + 1}")
        elif row.error:
            out.append(f"the file still has it bad: {row.where}: {row.error}")
        else:
            out.append(_group(row, group.group_id, group.dataset, group.epoch, len(data.rows), fingerprint.n_samples))
    return out


def _load_recorded(queue: Queue, dataset: str) -> tuple[Fingerprint, Dataset] | str:
    """The recorded file of `dataset`, read as it was pushed; or why it cannot be."""
    try:
        fingerprint = _read_fingerprint(queue, dataset)
    except DatasetError as exc:
        return str(exc)
    if fingerprint is None:
        return f"no record of the file dataset {dataset!r} came from (pushed before fingerprints were kept)"
    opts = PushOptions(input_key=fingerprint.input_key, label_key=fingerprint.label_key,
                       metadata_key=fingerprint.metadata_key)
    try:
        data = load_dataset(fingerprint.path, opts)
    except DatasetError as exc:
        return str(exc)
    if data.content_hash(set(fingerprint.bad_rows)) != fingerprint.content or len(data.rows) != fingerprint.rows:
        return f"{fingerprint.path} changed beyond its bad rows since it was pushed"
    return fingerprint, data
