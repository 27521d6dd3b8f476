"""The producer: push prompt groups from a JSONL or Parquet dataset.

The cursor (next position in each epoch's order) lives in Redis and advances in the
same script that pushes, so pushing again resumes where the last push stopped and a
(dataset, epoch, row) is never pushed twice.
"""
from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .codec import encode_group
from .queue import Queue
from .types import Group

log = logging.getLogger(__name__)


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


@dataclass
class Row:
    index: int  # position in the file (0-based)
    where: str  # "file:line" for messages
    prompt: str | list[dict] | None = None
    label: str | None = None
    metadata: dict = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


@dataclass
class PushReport:
    dataset: str
    rows: int
    pushed: int = 0
    dead: int = 0
    already: int = 0  # positions an earlier push had covered


def _row_from_record(record: Any, index: int, where: str, opts: PushOptions, raw: str) -> Row:
    row = Row(index=index, where=where, raw=raw[:2000])
    if not isinstance(record, dict):
        row.error = f"expected a JSON object, got {type(record).__name__}"
        return row
    if opts.input_key not in record:
        row.error = f"missing key {opts.input_key!r} (have: {', '.join(sorted(map(str, record))) or 'none'})"
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
    return row


def read_rows(path: Path, opts: PushOptions) -> list[Row]:
    """Every row of the file, bad ones marked with their error."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file")
    if path.suffix == ".parquet":
        return _read_parquet(path, opts)
    rows = []
    with path.open("rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            text = line.decode("utf-8", errors="replace")
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                rows.append(Row(index=len(rows), where=where, error=f"invalid JSON: {exc}", raw=text[:2000]))
                continue
            rows.append(_row_from_record(record, len(rows), where, opts, text))
    return rows


def _read_parquet(path: Path, opts: PushOptions) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install 'rollout-queue[parquet]')") from None
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises many types for a broken file
        raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
    return [_row_from_record(r, i, f"{path}:row {i + 1}", opts, json.dumps(r, default=str)) for i, r in enumerate(records)]


def epoch_order(n_rows: int, epoch: int, opts: PushOptions) -> list[int]:
    order = list(range(n_rows))
    if opts.shuffle:
        random.Random(opts.seed + epoch).shuffle(order)
    return order


def push_dataset(queue: Queue, path: str | Path, opts: PushOptions | None = None,
                 progress: Callable[[int], None] | None = None) -> PushReport:
    """Push every (epoch, row) not pushed yet. Raises DatasetError on the first bad row
    unless `skip_bad`, in which case bad rows go to the dead-letter stream."""
    opts = opts or PushOptions()
    if opts.n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be at least 1, got {opts.n_samples_per_prompt}")
    if opts.epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {opts.epochs}")
    rows = read_rows(Path(path), opts)
    bad = [r for r in rows if r.error]
    if bad and not opts.skip_bad:
        more = f" (and {len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
        raise DatasetError(f"{bad[0].where}: {bad[0].error}{more}; fix it or pass --skip-bad to dead-letter bad rows")
    dataset = opts.dataset_name or Path(path).name
    report = PushReport(dataset=dataset, rows=len(rows))
    for epoch in range(opts.epochs):
        order = epoch_order(len(rows), epoch, opts)
        field_name = f"{dataset}:{epoch}"
        cursor = int(queue.redis.hget(queue.keys.dataset, field_name) or 0)
        report.already += min(cursor, len(order))
        while cursor < len(order):
            _wait_for_room(queue, opts.max_queued)
            chunk = [rows[i] for i in order[cursor:cursor + opts.chunk_size]]
            items = [_item(row, dataset, epoch, len(rows), opts) for row in chunk]
            ok, new_cursor = queue.push(field_name, cursor, items)
            if not ok:
                log.warning("dataset %s epoch %d: another producer moved the cursor to %d; continuing from there",
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


def _item(row: Row, dataset: str, epoch: int, n_rows: int, opts: PushOptions) -> tuple[str, str, bytes]:
    gid = f"{dataset}:{epoch}:{row.index}"
    group_index = epoch * n_rows + row.index  # unique across epochs, so sample indices are too
    if row.error:
        log.error("%s: %s; dead-lettering the row as group %s", row.where, row.error, gid)
        # One placeholder sample: with none, Group.fresh drops the metadata and the raw line with it.
        group = Group.fresh(gid, "", 1, metadata={"raw": row.raw}, dataset=dataset, epoch=epoch, row=row.index)
        group.error = f"{row.where}: {row.error}"
        return group.error, gid, encode_group(group)
    group = Group.fresh(gid, row.prompt, opts.n_samples_per_prompt, row.label, row.metadata,
                        dataset=dataset, epoch=epoch, row=row.index, group_index=group_index)
    return "prompt", gid, encode_group(group)


def _wait_for_room(queue: Queue, max_queued: int | None) -> None:
    if max_queued is None:
        return
    while queue.redis.llen(queue.keys.prompts) >= max_queued:
        time.sleep(0.2)
