"""Operator actions on a whole namespace."""
from __future__ import annotations

from typing import Callable

import redis

from pipeline.keys import Keys


def namespace_pattern(namespace: str) -> str:
    """SCAN pattern matching every key of one namespace and nothing else.

    Namespaces are letters, digits, '_', '.', '-' (keys.check_namespace), none of
    which is special in a Redis glob; the braces are literal in globs too. The
    closing `}:` keeps namespace `a` from matching `{ab}:...`.
    """
    Keys(namespace)  # validates
    return f"{{{namespace}}}:*"


def namespace_keys(client: redis.Redis, namespace: str, count: int = 1000):
    """Every key of the namespace (including in-flight sets of any worker), by SCAN."""
    yield from client.scan_iter(match=namespace_pattern(namespace), count=count)


def purge(client: redis.Redis, namespace: str, batch: int = 500,
          progress: Callable[[int], None] | None = None) -> int:
    """Delete every key of `namespace` (SCAN + UNLINK in batches; never KEYS).
    Keys of other namespaces are untouched. Returns how many keys were deleted."""
    deleted = 0
    chunk: list = []

    def flush() -> None:
        nonlocal deleted
        if chunk:
            n = int(client.unlink(*chunk))
            deleted += n
            if progress:
                progress(n)
            chunk.clear()

    # Collect first, then delete: deleting while a SCAN cursor is open is allowed,
    # but a second pass below catches keys a live worker recreated meanwhile.
    for _ in range(2):
        keys = list(namespace_keys(client, namespace))
        if not keys:
            break
        for key in keys:
            chunk.append(key)
            if len(chunk) >= batch:
                flush()
        flush()
    return deleted
