"""Pipeline-wide settings and state kept in the `control` hash."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import redis

from .keys import Keys


@dataclass
class ControlState:
    paused: bool = False
    weight_version: int = 0
    max_staleness: int | None = None  # η; None: no staleness bound
    batch_size: int | None = None  # B, for admission pacing
    max_ready: int | None = None  # results backlog at which workers stop claiming
    admitted: int = 0  # groups admitted so far (first claims)


def _int(value: bytes | None) -> int | None:
    return None if value is None else int(value)


def read_control(client: redis.Redis, keys: Keys) -> ControlState:
    fields = ("paused", "weight_version", "max_staleness", "batch_size", "max_ready", "admitted")
    paused, version, eta, batch, ready, admitted = client.hmget(keys.control, fields)
    return ControlState(
        paused=paused == b"1",
        weight_version=_int(version) or 0,
        max_staleness=_int(eta),
        batch_size=_int(batch),
        max_ready=_int(ready),
        admitted=_int(admitted) or 0,
    )


def configure(client: redis.Redis, keys: Keys, *, max_staleness: int | None = None,
              batch_size: int | None = None, max_ready: int | None = None) -> None:
    """Set the limits the claim script enforces. A value of None leaves it unchanged;
    a negative value removes the limit."""
    for name, value in (("max_staleness", max_staleness), ("batch_size", batch_size), ("max_ready", max_ready)):
        if value is None:
            continue
        if value < 0:
            client.hdel(keys.control, name)
        else:
            client.hset(keys.control, name, value)


def _announce(client: redis.Redis, keys: Keys, state: ControlState) -> None:
    # Workers subscribed to the events channel react at once instead of at their next poll.
    client.publish(keys.events, json.dumps(asdict(state)))


def set_paused(client: redis.Redis, keys: Keys, paused: bool) -> None:
    client.hset(keys.control, "paused", 1 if paused else 0)
    _announce(client, keys, read_control(client, keys))


def set_weight_version(client: redis.Redis, keys: Keys, version: int) -> None:
    client.hset(keys.control, "weight_version", version)
    _announce(client, keys, read_control(client, keys))
