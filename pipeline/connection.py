"""Connecting to Redis: one function, URL checked, protocol pinned, Cluster detected,
Sentinel followed (`redis+sentinel://[user:password@]host:26379[,host2:26379]/service[/db]`:
the client asks the Sentinels for the service's primary, and again after a failover).

A URL is checked before anything is sent, so a typo is one clear line, not a
traceback from deep in redis-py; and the userinfo part (a password, or a
password typed where the user name goes) is never printed: `redact` finds it
without trusting the URL parser, which splits at a `#`, `/` or `?` inside it.
"""
from __future__ import annotations

import inspect
import logging
import re
import time
from dataclasses import dataclass
from functools import cache
from urllib.parse import SplitResult, parse_qsl, unquote, unquote_plus, urlsplit

import redis
from redis.cluster import RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS, SSLConnection, UnixDomainSocketConnection
from redis.sentinel import Sentinel

from .permissions import ExplainingRedis
from .retry import is_transient
from .server_checks import UnsafeServer, check_connection
from .tls import check_tls_options

log = logging.getLogger(__name__)

# The reply shapes this code parses (XREADGROUP lists, HMGET lists) are RESP2's;
# RESP3 turns several into maps. Pin it rather than inherit a client default.
PROTOCOL = 2
SOCKET_TIMEOUT_S = 30.0
#: The first round trip waits this long: a rediss:// URL against a server without
#: TLS gets no answer at all, and the full socket timeout would hide why.
PROBE_TIMEOUT_S = 5.0
SENTINEL_SCHEME = "redis+sentinel"
SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)
_CONNECTION_CLASSES = {"redis": redis.Connection, "rediss": SSLConnection, "unix": UnixDomainSocketConnection,
                       SENTINEL_SCHEME: redis.Connection}
#: The port of a Sentinel given without one.
SENTINEL_PORT = 26379


#: How long a long-running process (worker, feeder, the chaos trainer) started while Redis
#: is down, restarting or failing over waits for it before it gives up: the same limit as
#: a trainer's wait through an outage (pipeline/retry.TRAINER_OUTAGE_LIMIT_S).
STARTUP_WAIT_S = 300.0


class ConnectionFailed(RuntimeError):
    """Redis could not be reached or the URL is wrong; the message says which.
    `transient`: waiting may help (Redis down or loading), not a wrong URL or password."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


#: Query parameters that carry credentials: redis-py reads `?password=` and `?username=`,
#: their names percent-decoded (`pass%77ord` is one too).
_CREDENTIALS = ("password", "username")


def _credential(query: str) -> tuple[int, str] | None:
    """Where the first credential parameter of `query` (the URL after its '?') starts, and its
    name as typed. Everything from there on is secret: a password may hold an '&' or a '#'
    not percent-encoded, so what follows it cannot be told apart from it."""
    i = 0
    while i <= len(query):
        ends = [k for k in (query.find("&", i), query.find("#", i)) if k >= 0]
        j = min(ends, default=len(query))
        name = query[i:j].partition("=")[0]
        if unquote_plus(name).lower() in _CREDENTIALS:
            return i, name
        i = j + 1
    return None


def redact(url: str) -> str:
    """The URL without its userinfo (everything up to the last '@' after the scheme) and
    without everything from a `password=` or `username=` query parameter on, for logs and
    error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        rest = f"***@{rest.rpartition('@')[2]}"
    head, mark, query = rest.partition("?")
    found = _credential(query) if mark else None
    if found:
        rest = f"{head}?{query[:found[0]]}{found[1]}=***"
    return f"{scheme}{sep}{rest}"


def _secrets(url: str) -> set[str]:
    """The credentials in `url`: userinfo pieces, and the rest of the URL from a credential
    query parameter's value on, whole and in its pieces."""
    userinfo = url.partition("://")[2].rpartition("@")[0]
    found = set(userinfo.split(":"))
    query = url.partition("?")[2]
    credential = _credential(query)
    if credential:
        tail = query[credential[0]:].partition("=")[2]
        found |= {tail, *re.split(r"[&#=]", tail)}
    return {p for part in found for p in (part, unquote(part), unquote_plus(part)) if len(p) > 2}


def scrub(text: str, url: str) -> str:
    """`text` (an error message, say) with `url` redacted and every credential in
    it, as typed or percent-decoded, masked wherever it appears."""
    text = text.replace(url, redact(url))
    pieces = _secrets(url)
    for piece in sorted(pieces, key=len, reverse=True):
        text = text.replace(piece, "***")
    return text


@cache
def _query_parameters(scheme: str) -> frozenset[str]:
    """Query parameters redis-py passes on for this scheme: its URL parsers plus the
    keyword arguments of the connection class (an unknown one is a TypeError later)."""
    names = set(URL_QUERY_ARGUMENT_PARSERS)
    for cls in _CONNECTION_CLASSES[scheme].__mro__:
        if "__init__" in vars(cls):
            names |= {p.name for p in inspect.signature(cls.__init__).parameters.values()
                      if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
    return frozenset(names - {"self"})


def check_url(url: str) -> SplitResult:
    """The parsed URL, or ConnectionFailed saying what is wrong with it (never
    echoing the userinfo, and never a parser's message, which may quote it)."""
    shown = redact(url)
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in SCHEMES:
        raise ConnectionFailed(f"unsupported Redis URL {shown!r}: use redis://, rediss://, unix:// or "
                               f"redis+sentinel://")
    if scheme == SENTINEL_SCHEME:
        sentinel_target(url)  # raises what is wrong with it
        return urlsplit(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ConnectionFailed(f"malformed host in Redis URL {shown!r}: not a host name or a bracketed IPv6 "
                               "address (redis://[::1]:6379)") from None
    if "@" in url.partition("://")[2] and "@" not in parts.netloc:
        raise ConnectionFailed(f"malformed Redis URL {shown!r}: the password holds '/', '?' or '#'; "
                               "percent-encode them (%2F, %3F, %23)")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ConnectionFailed(f"malformed Redis URL {shown!r}: the port must be a number from 1 to 65535")
    if scheme == "unix" and not parts.path:
        raise ConnectionFailed(f"malformed Redis URL {shown!r}: a unix:// URL needs a socket path")
    try:  # before the generic check: "needs rediss://" says more than "unknown query parameter"
        check_tls_options(url)
    except ValueError as exc:
        raise ConnectionFailed(f"bad Redis URL {shown}: {exc}") from None
    credential = _credential(url.partition("?")[2])
    if credential:  # after it, only parameters redis-py knows: else they are the password's rest
        after = url.partition("?")[2][credential[0]:]
        names = [unquote_plus(n) for n, _ in parse_qsl(after.partition("#")[0], keep_blank_values=True)]
        if "#" in after or set(names) - _query_parameters(scheme) - {unquote_plus(credential[1])}:
            raise ConnectionFailed(f"malformed Redis URL {shown!r}: what follows {credential[1]}= is not a query "
                                   f"parameter redis-py knows; a password or user name holding '&' or '#' must "
                                   f"percent-encode them (%26, %23)")
    query = url.partition("?")[2]
    before = query[:credential[0]] if credential else query
    unknown = sorted({name for name, _ in parse_qsl(before.partition("#")[0], keep_blank_values=True)}
                     - _query_parameters(scheme))
    if credential and unquote_plus(credential[1]) not in _query_parameters(scheme):
        unknown.append(credential[1])
    if unknown:
        raise ConnectionFailed(f"unknown query parameter {', '.join(map(repr, unknown))} in Redis URL {shown!r} "
                               f"(known: {', '.join(sorted(URL_QUERY_ARGUMENT_PARSERS))}, ...)")
    return parts


@dataclass
class SentinelTarget:
    """What a redis+sentinel:// URL names: the Sentinels to ask, the service (Sentinel's
    name for the primary and its replicas), the database, the primary's credentials."""

    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def sentinel_target(url: str) -> SentinelTarget:
    """Parse `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]`,
    or ConnectionFailed saying what is wrong (never echoing the userinfo)."""
    shown = redact(url)
    rest = url.partition("://")[2]
    userinfo, at, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    service, _, db = path.partition("/")
    if "?" in rest or "#" in rest:
        raise ConnectionFailed(f"malformed Sentinel URL {shown!r}: no query parameters or fragments")
    if not service:
        raise ConnectionFailed(f"malformed Sentinel URL {shown!r}: name the service after the hosts "
                               f"(redis+sentinel://host:{SENTINEL_PORT}/mymaster)")
    if db and not db.isdigit():
        raise ConnectionFailed(f"malformed Sentinel URL {shown!r}: the database must be a number, got {db!r}")
    sentinels = []
    for host in hosts.split(","):
        if host.startswith("["):  # [::1]:26379
            name, _, port = host[1:].partition("]")
            port = port.removeprefix(":")
        else:
            name, _, port = host.partition(":")
        port = port or str(SENTINEL_PORT)
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConnectionFailed(f"malformed Sentinel URL {shown!r}: {host!r} is not host:port")
        sentinels.append((name, int(port)))
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None, unquote(secret)) if colon else (None, unquote(user))
    return SentinelTarget(sentinels, unquote(service), int(db or 0), username, password)


def _failure(url: str, exc: Exception) -> ConnectionFailed:
    failure = _described(url, exc)
    # A server a writer must not use is waited out once running (a failover landed on
    # it), but at start it is the URL or the server's configuration: say so at once.
    failure.transient = is_transient(exc) and not isinstance(exc, UnsafeServer)
    return failure


def _described(url: str, exc: Exception) -> ConnectionFailed:
    shown = redact(url)
    if isinstance(exc, UnsafeServer):
        return ConnectionFailed(str(exc))
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return ConnectionFailed(f"permission denied at Redis {shown}: {exc} (grant the user that command)")
    if isinstance(exc, redis.AuthenticationError):
        return ConnectionFailed(f"cannot reach Redis at {shown}: it refused the credentials: {exc}")
    if url.startswith("rediss://") and (isinstance(exc, redis.TimeoutError) or "SSL" in str(exc)):
        return ConnectionFailed(f"cannot reach Redis at {shown} over TLS: the server may not speak TLS "
                                f"(use redis:// for a plain server): {exc}")
    return ConnectionFailed(f"cannot reach Redis at {shown}: {exc}")


def connect(url: str, socket_timeout: float | None = SOCKET_TIMEOUT_S,
            wait_s: float = 0.0, read_only: bool = False) -> redis.Redis | RedisCluster:
    """A client for `url` (redis://, rediss://, unix://, redis+sentinel://). Returns a cluster client
    when the server runs in cluster mode. Raises ConnectionFailed with the reason. With
    `wait_s`, a Redis that cannot be reached yet (down, loading, failing over, a link that
    resets) is tried again with backoff for up to that long, saying so once in the log; a
    wrong URL or password fails at once.

    Every connection of a writing client (all but `read_only` ones: status, audit, dead
    list) checks its server first (pipeline/server_checks.py): one that may evict keys, or
    a replica named by a plain URL, is refused at once here, and waited out (UnsafeServer)
    when a reconnect lands on one later."""
    deadline = time.monotonic() + wait_s
    delay, said = 0.1, False
    while True:
        try:
            return _connect(url, socket_timeout, read_only)
        except ConnectionFailed as exc:
            if not exc.transient or time.monotonic() + delay > deadline:
                raise
            if not said:
                log.warning("%s; waiting for it (up to %gs)", exc, wait_s)
                said = True
            time.sleep(delay)
            delay = min(2.0, delay * 2)


def _checked(url: str, cluster: bool = False):
    """redis-py's `redis_connect_func`: run on every new socket, after the handshake (this
    function does it for a plain client; a cluster client does its own first), then the
    server check of a writer."""
    shown = redact(url)

    def on_connect(connection) -> None:
        if not cluster:
            connection.on_connect()
        check_connection(connection, shown, url, cluster)

    return on_connect


def _connect(url: str, socket_timeout: float | None, read_only: bool = False) -> redis.Redis | RedisCluster:
    check_url(url)
    probe_timeout = PROBE_TIMEOUT_S if socket_timeout is None else min(socket_timeout, PROBE_TIMEOUT_S)
    if url.startswith(SENTINEL_SCHEME + "://"):
        return _connect_sentinel(url, socket_timeout, probe_timeout, read_only)
    try:
        probe = redis.Redis.from_url(url, protocol=PROTOCOL, socket_timeout=probe_timeout,
                                     socket_connect_timeout=PROBE_TIMEOUT_S)
        try:
            cluster_enabled = probe.info("cluster").get("cluster_enabled") == 1
        finally:
            probe.close()
        checks = {} if read_only else {"redis_connect_func": _checked(url, cluster_enabled)}
        if not cluster_enabled:
            client = ExplainingRedis.from_url(url, protocol=PROTOCOL, socket_timeout=socket_timeout,
                                              socket_connect_timeout=5, health_check_interval=30, **checks)
        else:
            client = RedisCluster.from_url(url, protocol=PROTOCOL, socket_timeout=socket_timeout,
                                           socket_connect_timeout=5, **checks)
        if not read_only:
            client.ping()  # the first connection, checked now: a server no writer may use is refused at once
        return client
    except (redis.RedisError, ValueError, TypeError, OSError) as exc:
        raise _failure(url, exc) from None


def _connect_sentinel(url: str, socket_timeout: float | None, probe_timeout: float,
                      read_only: bool = False) -> redis.Redis:
    """A client of the service's current primary: its connections ask the Sentinels where
    the primary is whenever they (re)connect, and drop a primary that was demoted (its
    READONLY reply), so a failover is one outage that Reconnect waits out."""
    target = sentinel_target(url)
    sentinel = Sentinel(target.sentinels, sentinel_kwargs={"socket_timeout": probe_timeout,
                                                           "socket_connect_timeout": PROBE_TIMEOUT_S})
    checks = {} if read_only else {"redis_connect_func": _checked(url)}
    client = sentinel.master_for(target.service, redis_class=ExplainingRedis, db=target.db,
                                 username=target.username, password=target.password, protocol=PROTOCOL,
                                 socket_timeout=socket_timeout, socket_connect_timeout=5, health_check_interval=30,
                                 **checks)
    try:
        client.ping()
    except (redis.RedisError, ValueError, TypeError, OSError) as exc:
        client.close()
        raise _failure(url, exc) from None
    return client


def socket_timeout_of(client: redis.Redis | RedisCluster) -> float | None:
    if isinstance(client, RedisCluster):
        kwargs = client.get_default_node().redis_connection.connection_pool.connection_kwargs
    else:
        kwargs = client.connection_pool.connection_kwargs
    return kwargs.get("socket_timeout")
