"""Whether a Redis server may be written to, checked on every connection a writer makes.

`connect()` (pipeline/connection.py) runs `check_connection` on each new socket of a
writing client: at start, after every reconnect, after a failover moved it to another
server (a replica configured differently). One place, so no writer can lack it:

- **No eviction.** A maxmemory-policy that evicts (`allkeys-*`; `volatile-*` while keys
  carry a TTL) deletes queue state without a trace: payloads, in-flight hashes, results
  (issue 31: 43-118 of 120 groups never trained under allkeys-lru). With `noeviction` a
  full Redis refuses writes instead, which every process waits out (docs/security.md).
  The pipeline's own keys carry no TTL once a publish is done; which keys do cannot be
  told without SCAN (which a worker's ACL user may not send), so any key of the database
  with a TTL refuses a `volatile-*` policy.
- **Not a replica named by a plain URL.** A replica with a healthy link to its primary
  refuses every write (READONLY). During a failover that is transient; a URL that names a
  replica is a configuration error: the message names the primary. Through Sentinel the
  client asks for the primary itself, so a replica there is a failover under way.

At start a refusal is one line (connect raises ConnectionFailed); on a reconnect it is
UnsafeServer, which every Reconnect waits out like an outage, saying why, until the server
is fixed: writing there would lose what is written. Read-only commands (status, audit,
dead list) connect without the check; status shows the same findings (`server_alerts`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
from redis._parsers.helpers import parse_info

log = logging.getLogger(__name__)

#: maxmemory-policy values that never delete a key.
SAFE_POLICY = "noeviction"
FIX_POLICY = f"run `redis-cli CONFIG SET maxmemory-policy {SAFE_POLICY}` on it (and set it in redis.conf)"


class UnsafeServer(redis.exceptions.RedisError):
    """The server a writing connection reached must not be written to (eviction, a replica).
    Not a ConnectionError, which redis-py would retry on its own; pipeline/retry.py counts
    it transient: a long-running process waits until the server is fixed."""


@dataclass
class ServerFacts:
    """What INFO says about a server, as far as writing to it goes."""

    policy: str = SAFE_POLICY
    maxmemory: int = 0
    used_memory: int = 0
    role: str = "master"
    master: str = ""  # a replica's primary, host:port
    link_up: bool = False  # a replica's link to its primary
    expires: int = 0  # keys of this database with a TTL
    evicted_keys: int = 0  # since the server started
    cluster: bool = False

    @classmethod
    def from_info(cls, info: dict, db: int = 0) -> ServerFacts:
        space = info.get(f"db{db}")
        return cls(policy=str(info.get("maxmemory_policy", SAFE_POLICY)),
                   maxmemory=int(info.get("maxmemory", 0) or 0), used_memory=int(info.get("used_memory", 0) or 0),
                   role=str(info.get("role", "master")),
                   master=f"{info['master_host']}:{info['master_port']}" if "master_host" in info else "",
                   link_up=info.get("master_link_status") == "up",
                   expires=int(space.get("expires", 0)) if isinstance(space, dict) else 0,
                   evicted_keys=int(info.get("evicted_keys", 0) or 0), cluster=info.get("cluster_enabled") == 1)


def read_facts(client: redis.Redis) -> ServerFacts:
    """The facts of `client`'s server (INFO: every default section in one round trip)."""
    db = client.connection_pool.connection_kwargs.get("db", 0) if hasattr(client, "connection_pool") else 0
    return ServerFacts.from_info(client.info(), int(db or 0))


def eviction_risk(facts: ServerFacts) -> str | None:
    """Why this server may delete the namespace's keys on its own, or None."""
    if facts.policy == SAFE_POLICY:
        return None
    if facts.policy.startswith("volatile-"):
        if not facts.expires:
            return None  # only keys with a TTL are candidates, and there are none
        what = f"maxmemory-policy {facts.policy} and {facts.expires} key{'s' * (facts.expires != 1)} with a TTL"
    else:
        what = f"maxmemory-policy {facts.policy}"
    return (f"it may evict keys ({what}), which loses groups without a trace: {FIX_POLICY}; at maxmemory "
            "Redis then refuses writes instead, and every process waits until there is room")


def replica_problem(facts: ServerFacts, url: str) -> str | None:
    """Why a plain URL naming this server is a configuration error for a writer, or None:
    a replica in sync with its primary (one whose link is down is a failover under way)."""
    if facts.role != "slave" or not facts.link_up or facts.cluster or url.startswith("redis+sentinel://"):
        return None
    return (f"it is a read-only replica of {facts.master}: point --redis-url (ROLLOUT_REDIS_URL) at the primary, "
            f"redis://{facts.master}, or at the Sentinels (redis+sentinel://HOST:26379/SERVICE) to follow failovers")


def unsafe_for_writes(facts: ServerFacts, url: str) -> str | None:
    return eviction_risk(facts) or replica_problem(facts, url)


#: The INFO sections the check reads, one command each (Redis 6.2 takes one section per
#: INFO), sent together: one round trip, a fraction of a full INFO's bytes.
CHECKED_SECTIONS = ("memory", "replication", "keyspace")


def check_connection(connection, shown_url: str, url: str, cluster: bool = False) -> None:
    """On a new socket of a writing client: raise UnsafeServer if its server must not be
    written to. A user whose ACL refuses INFO is not checked (every role here may send it)."""
    connection.send_packed_command(connection.pack_commands([("INFO", s) for s in CHECKED_SECTIONS]))
    info: dict = {}
    refused = False
    for _ in CHECKED_SECTIONS:  # every reply read, so the socket stays in step
        try:
            reply = connection.read_response()
        except redis.exceptions.NoPermissionError:
            refused = True
            continue
        info.update(parse_info(reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply))
    if refused:
        log.debug("INFO refused: the server's eviction policy and role are not checked")
        return
    facts = ServerFacts.from_info(info, int(getattr(connection, "db", 0) or 0))
    facts.cluster = cluster
    problem = unsafe_for_writes(facts, url)
    if problem:
        raise UnsafeServer(f"not writing to Redis at {shown_url}: {problem}")


def server_alerts(facts: ServerFacts) -> list[str]:
    """What status says about the server itself: it may evict keys, it is a replica."""
    alerts = []
    risk = eviction_risk(facts)
    if risk:
        alerts.append(f"Redis {risk.removeprefix('it ')}; every writer refuses it")
    if facts.role == "slave":
        alerts.append(f"this server is a replica of {facts.master or 'a primary'}: what it shows may lag the "
                      "primary, and writers refuse it")
    return alerts
