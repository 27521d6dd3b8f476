"""Which namespaces a Redis server holds: whether one is empty, and the names close to a
mistyped one, so a command pointed at a namespace nobody pushed to says so."""
from __future__ import annotations

import redis

from pipeline.keys import Keys
from pipeline.queue import text


def namespace_is_empty(client: redis.Redis, keys: Keys) -> bool:
    """No fixed key exists. (A worker's in-flight hash never exists alone: its worker
    registered in `workers` and its group has history. No SCAN: a role that may touch
    one namespace should not list every team's key names.)"""
    return not client.exists(*keys.all_fixed())


def known_namespaces(client: redis.Redis, max_names: int = 1000, max_keys: int = 200_000) -> list[str]:
    """Namespaces found on this server (from their `{ns}:...` keys), for hints. Scans at
    most `max_keys` keys: an error path on a big shared server must stay quick."""
    found: set[str] = set()
    try:
        for seen, key in enumerate(client.scan_iter(match="{*}:*", count=1000)):
            name = text(key)
            if name.startswith("{") and "}:" in name:
                found.add(name[1:name.index("}:")])
            if len(found) >= max_names or seen >= max_keys:
                break
    except redis.exceptions.NoPermissionError:  # a role limited to its namespace: no hints
        return []
    return sorted(found)


def empty_message(client: redis.Redis, namespace: str, shown: int = 8) -> str:
    """`namespace 'x' is empty: nothing has been pushed`, with the likeliest intended names."""
    import difflib

    others = [n for n in known_namespaces(client) if n != namespace]
    if not others:
        return f"namespace {namespace!r} is empty: nothing has been pushed (this server holds no pipeline)"
    close = difflib.get_close_matches(namespace, others, n=3, cutoff=0.6)
    rest = [n for n in others if n not in close]
    listed = close + rest[:max(0, shown - len(close))]
    more = f" and {len(others) - len(listed)} more" if len(others) > len(listed) else ""
    guess = f"did you mean {' or '.join(repr(n) for n in close)}? " if close else ""
    return (f"namespace {namespace!r} is empty: nothing has been pushed ({guess}namespaces on this server: "
            f"{', '.join(listed)}{more})")
