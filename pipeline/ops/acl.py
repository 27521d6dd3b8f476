"""Least-privilege Redis ACL users for the roles that touch a pipeline (the errors when
Redis refuses one of their commands are pipeline/permissions.py's).

Each role (worker, trainer, admin) may use only its namespace's keys (`{ns}:*`), the
events channel, and the commands it sends. Those are listed here and nowhere else:
the commands of the Lua scripts a role runs are read from the scripts themselves
(Redis checks every command a script calls against the caller's ACL), the commands
a role sends itself are listed by hand. tests/test_acl.py runs each role's whole
cycle under its ACL user, so a command missing here fails a test.

Taking entries out of a stream (XACK, XDEL) is allowed only on the streams a role
settles: a worker can release the requeue stream but cannot settle the trainer's
results, even though both go through the same settle script.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum


from pipeline import scripts
from pipeline.keys import Keys, eval_namespace
from pipeline.permissions import SCRIPT_CALL

from .admin import namespace_pattern

#: Commands that take an entry out of a stream; a role gets them only on the streams it settles.
SETTLING = frozenset({"xack", "xdel"})


class Role(str, Enum):
    WORKER = "worker"
    TRAINER = "trainer"
    ADMIN = "admin"


@dataclass(frozen=True)
class Access:
    """What a role does to its namespace. Commands are lower case, subcommands as
    `container|sub`, as ACL SETUSER spells them."""

    scripts: frozenset[str] = frozenset()  # pipeline/lua scripts it runs (their commands are read from them)
    commands: frozenset[str] = frozenset()  # commands it sends itself
    settles: frozenset[str] = frozenset()  # names of the streams it takes entries out of
    publishes: bool = False  # PUBLISH on the events channel
    subscribes: bool = False  # SUBSCRIBE to it

    def __or__(self, other: Access) -> Access:
        return Access(self.scripts | other.scripts, self.commands | other.commands, self.settles | other.settles,
                      self.publishes or other.publishes, self.subscribes or other.subscribes)

    def all_commands(self) -> frozenset[str]:
        found = set(self.commands)
        for name in self.scripts:
            found |= script_commands(name)
        if self.publishes:
            found.add("publish")
        if self.subscribes:
            found.add("subscribe")
        return frozenset(found)


def script_commands(name: str) -> frozenset[str]:
    """The commands lua/<name>.lua calls, with those of the prelude every script carries."""
    return frozenset(c.lower() for c in SCRIPT_CALL.findall(scripts.source(name)))


def _access(scripts=(), commands=(), settles=(), publishes=False, subscribes=False) -> Access:
    return Access(frozenset(scripts), frozenset(commands), frozenset(settles), publishes, subscribes)


#: Every client: connect() asks INFO whether the server runs a cluster; redis-py pings
#: idle connections; scripts.load asks the Functions library's version (FCALL).
CLIENT = _access(commands=("info", "ping", "fcall"))
#: Without the Functions library (scripts.uses_functions), scripts run by EVALSHA, and redis-py
#: loads one the server does not know yet (after a restart). These run any Lua: a role
#: made with `functions=True` has neither.
EVAL_SCRIPTS = frozenset({"evalsha", "script|load"})
#: control.read_control: one MULTI over the control hash, the stats and the admitted hash.
READ_CONTROL = _access(commands=("multi", "exec", "hmget", "hget", "hlen"))
#: Queue.release (workers while admission is open, the trainer on resume): requeue → prompts.
RELEASE = _access(scripts=("settle",), commands=("xrange",), settles=("requeue",))

#: Queue.reap_expired (workers, and the trainer while it waits): deadlines by server time.
REAP = _access(scripts=("reap",), commands=("time", "zrangebyscore"))

WORKER = CLIENT | READ_CONTROL | RELEASE | REAP | _access(
    scripts=("register", "claim", "heartbeat", "publish", "handback"),
    # publish stages a result with SET; depths; held() for reconciliation; reap_orphans
    commands=("set", "llen", "xlen", "hgetall", "zrange", "scan"),
    subscribes=True,
)

TRAINER = CLIENT | READ_CONTROL | RELEASE | REAP | _access(
    # the consumer's session, reads and hand-backs; settle (with RELEASE) for commits; push_groups
    scripts=("session", "read", "redeliver", "push"),
    commands=(
        "xread", "xpending", "xrange", "mget", "zmscore",  # Consumer.next_batch
        "llen", "xlen", "zrevrange", "zrange", "hlen",  # the timeout error's diagnosis, in-flight count
        "hset", "hdel",  # control fields (Controller, configure)
        "hincrby",  # the producer's cursor
        "exists",  # namespace_is_empty: consume, pause and resume check that the namespace exists
    ),
    settles=("results",),
    publishes=True,
)

ADMIN = TRAINER | _access(
    scripts=("audit", "audit_page", "check_results", "locate"),
    commands=(
        "scan", "unlink", "exists",  # purge, namespace_is_empty
        "lpos",  # the audit's re-check of a group that looks in two places
        "lrange", "hkeys", "hgetall", "zcount",  # status, dead letters, inspect
        "hmget", "get", "xrevrange",  # status --worker, inspect (a result's payload, the drop log)
    ),
    settles=("dead",),
)

ROLES: dict[Role, Access] = {Role.WORKER: WORKER, Role.TRAINER: TRAINER, Role.ADMIN: ADMIN}


def password_hash(password: str) -> str:
    """The `#<sha256>` form of a password: an ACL line that does not reveal it."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def default_user(role: Role, namespace: str) -> str:
    return f"{namespace}-{role.value}"


def setuser_args(role: Role, namespace: str, user: str, password: str, functions: bool = False) -> list[str]:
    """Arguments of `ACL SETUSER` for `role` on `namespace` and its evaluation companion
    `<namespace>.eval` (pipeline/trainers/eval.py: workers serve both) after the command name.
    `reset` first, so running it again replaces whatever the user had. With `functions`
    (Redis 7, the library loaded by `rollout functions load`) the user runs the
    pipeline's Lua by FCALL only: no EVAL, EVALSHA, SCRIPT or FUNCTION."""
    spaces = [namespace, eval_namespace(namespace)]
    access = ROLES[role]
    commands = access.all_commands() | (frozenset() if functions else EVAL_SCRIPTS)
    args = [user, "reset", "on", password_hash(password), *(f"~{namespace_pattern(ns)}" for ns in spaces),
            "resetchannels"]
    if access.publishes or access.subscribes:
        args += [f"&{Keys(ns).events}" for ns in spaces]
    args += ["-@all"] + [f"+{c}" for c in sorted(commands - SETTLING)]
    settling = sorted(commands & SETTLING)
    if settling and access.settles:
        streams = " ".join(f"~{getattr(Keys(ns), s)}" for ns in spaces for s in sorted(access.settles))
        args.append(f"({streams} -@all {' '.join('+' + c for c in settling)})")
    return args


def setuser_line(role: Role, namespace: str, user: str, password: str, functions: bool = False) -> str:
    """One `ACL SETUSER ...` line, as redis-cli reads it from stdin (ACL SETUSER joins
    the words of a selector in parentheses itself)."""
    return " ".join(["ACL", "SETUSER", *setuser_args(role, namespace, user, password, functions)])
