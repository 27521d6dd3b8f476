"""Connecting to Redis: one function, protocol pinned, Cluster detected."""
from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.cluster import RedisCluster

from .acl import ExplainingRedis
from .tls import check_tls_options

log = logging.getLogger(__name__)

# The reply shapes this code parses (XREADGROUP lists, HMGET lists) are RESP2's;
# RESP3 turns several into maps. Pin it rather than inherit a client default.
PROTOCOL = 2
SOCKET_TIMEOUT_S = 30.0


class ConnectionFailed(RuntimeError):
    """Redis could not be reached or the URL is wrong; the message says which."""


def redact(url: str) -> str:
    """The URL with any password replaced, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def connect(url: str, socket_timeout: float = SOCKET_TIMEOUT_S) -> redis.Redis | RedisCluster:
    """A client for `url` (redis://, rediss://, unix://). Returns a cluster client
    when the server runs in cluster mode. Raises ConnectionFailed with the reason."""
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ConnectionFailed(f"unsupported Redis URL {redact(url)!r}: use redis://, rediss:// or unix://")
    try:
        check_tls_options(url)
    except ValueError as exc:
        raise ConnectionFailed(f"bad Redis URL {redact(url)}: {exc}") from None
    try:
        client = ExplainingRedis.from_url(url, protocol=PROTOCOL, socket_timeout=socket_timeout,
                                          socket_connect_timeout=5, health_check_interval=30)
        cluster_enabled = client.info("cluster").get("cluster_enabled") == 1
    except (redis.RedisError, ValueError, OSError) as exc:
        raise ConnectionFailed(f"cannot reach Redis at {redact(url)}: {exc}") from None
    if not cluster_enabled:
        return client
    client.close()
    try:
        return RedisCluster.from_url(url, protocol=PROTOCOL, socket_timeout=socket_timeout,
                                     socket_connect_timeout=5)
    except (redis.RedisError, ValueError, OSError) as exc:
        raise ConnectionFailed(f"cannot reach Redis Cluster at {redact(url)}: {exc}") from None


def socket_timeout_of(client: redis.Redis | RedisCluster) -> float | None:
    if isinstance(client, RedisCluster):
        kwargs = client.get_default_node().redis_connection.connection_pool.connection_kwargs
    else:
        kwargs = client.connection_pool.connection_kwargs
    return kwargs.get("socket_timeout")
