"""A step of the Redis server's clock, as every script sees it (the `clock_step` fault and
its tests): the system clock cannot be moved under a test, but a script only ever compares
the server's time with the server times stored earlier. A clock that steps back by S is
stored times S ahead of it: the lease deadlines (`workers` ZSET) and the last time a lease
script ran (`seen_ms` in the beats hash, lua/_prelude.lua `lease_clock`). Moving those by
S, atomically against every heartbeat (WATCH), is what a failover to a replica whose clock
is S behind, or an NTP step of S, leaves behind; a forward step is the same the other way.
"""
from __future__ import annotations

import redis

from pipeline.keys import Keys


def step_server_clock(client: redis.Redis, keys: Keys, step_ms: int) -> None:
    """Make every stored server time of the namespace's leases look as if the server's
    clock had just stepped by `step_ms` (negative: back)."""
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.workers, keys.beats)
                deadlines = pipe.zrange(keys.workers, 0, -1, withscores=True)
                seen = pipe.hget(keys.beats, "seen_ms")
                pipe.multi()
                if deadlines:
                    pipe.zadd(keys.workers, {w: int(d) - step_ms for w, d in deadlines}, xx=True)
                if seen is not None:
                    pipe.hset(keys.beats, "seen_ms", int(seen) - step_ms)
                pipe.execute()
                return
            except redis.WatchError:
                continue
