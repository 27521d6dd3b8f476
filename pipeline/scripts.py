"""The Lua scripts of `lua/`, each loaded with the shared prelude (`lua/_prelude.lua`).

The same files make the Redis 7 Functions library (`library_source`, loaded by an admin
with `rollout functions load`): where it is loaded, every script runs by `FCALL`, so an
ACL role can be given `FCALL` and no `EVAL`, `SCRIPT` or `FUNCTION` (it then runs the
pipeline's Lua and no other). Where it is not (Redis 6.2 has no Functions, or nobody
loaded it, or it is another version's), scripts run by `EVALSHA`, and `load` says so
once per client, as a warning: such roles must keep `EVALSHA`, which runs any Lua.
"""
from __future__ import annotations

import hashlib
import logging
import weakref
from functools import cache
from pathlib import Path

import redis
from redis.commands.core import Script

from .retry import is_transient

log = logging.getLogger(__name__)

_LUA = Path(__file__).with_name("lua")
_PRELUDE = "_prelude.lua"
#: The Functions library's name; each script is the function `rollout_<file stem>`.
LIBRARY = "rollout"
#: A function of the library answering its digest: a library of another version is not used.
VERSION_FUNCTION = f"{LIBRARY}_version"


@cache
def source(name: str) -> str:
    return prelude() + "\n" + body(name)


@cache
def prelude() -> str:
    return (_LUA / _PRELUDE).read_text()


@cache
def body(name: str) -> str:
    """lua/<name>.lua as written, without the prelude."""
    return (_LUA / f"{name}.lua").read_text()


@cache
def names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _LUA.glob("*.lua") if p.name != _PRELUDE))


def name_of(loaded: str) -> str:
    """The .lua file a loaded script was made from."""
    return next((f"{n}.lua" for n in names() if loaded == source(n)), "a script")


def origin(loaded: str, line: int) -> tuple[str, int]:
    """The .lua file and line that line `line` of a loaded script comes from (for
    error messages: Redis numbers the lines of the whole loaded text)."""
    prelude_lines = len(prelude().splitlines()) + 1
    return (name_of(loaded), line - prelude_lines) if line > prelude_lines else (_PRELUDE, line)


@cache
def library_digest() -> str:
    return hashlib.sha1("".join(source(n) for n in names()).encode()).hexdigest()[:16]


@cache
def library_source() -> str:
    """The Functions library: each script's text, unchanged, as the body of a function
    (KEYS and ARGV become its parameters); one source of truth for both ways to run it."""
    parts = [f"#!lua name={LIBRARY}\n"]
    for n in names():
        parts.append(f"redis.register_function('{LIBRARY}_{n}', function(KEYS, ARGV)\n{source(n)}\nend)\n")
    parts.append(f"redis.register_function{{function_name='{VERSION_FUNCTION}', "
                 f"callback=function() return '{library_digest()}' end, flags={{'no-writes'}}}}\n")
    return "".join(parts)


def load_library(client: redis.Redis) -> str:
    """FUNCTION LOAD REPLACE the library (an admin's job); returns its digest."""
    client.function_load(library_source(), replace=True)
    _fallback.pop(id(client), None)
    return library_digest()


class FunctionScript:
    """A library function called like redis-py's Script: `script(keys=[...], args=[...])`."""

    def __init__(self, client: redis.Redis, name: str):
        self.client = client
        self.function = f"{LIBRARY}_{name}"

    def __call__(self, keys=(), args=(), client: redis.Redis | None = None):
        return (client or self.client).fcall(self.function, len(keys), *keys, *args)


#: Per client (by id, dropped with the client): why the scripts run by EVALSHA, or None (FCALL).
_fallback: dict[int, str | None] = {}


def fallback_reason(client: redis.Redis) -> str | None:
    """Why `client` runs the scripts by EVALSHA (None: by FCALL). Long-running processes
    (the worker) say it as a warning when they start; one-shot commands keep their one line."""
    if id(client) not in _fallback:
        _fallback[id(client)] = _probe(client)
        weakref.finalize(client, _fallback.pop, id(client), None)
    return _fallback[id(client)]


def uses_functions(client: redis.Redis) -> bool:
    """Whether `client`'s server has this version's library loaded (one FCALL per client)."""
    return fallback_reason(client) is None


def _probe(client: redis.Redis) -> str | None:
    try:
        found = client.fcall(VERSION_FUNCTION, 0)
        found = found.decode() if isinstance(found, bytes) else found
        why = None if found == library_digest() else (
            f"the Functions library loaded is another version ({found}, this is {library_digest()}): "
            "reload it with `rollout functions load`")
    except redis.ResponseError as exc:
        if is_transient(exc):
            raise  # READONLY, BUSY, LOADING... say nothing about Functions: asked again next call
        text = str(exc).lower()
        if "unknown command" in text:
            why = "this Redis has no Functions (6.2 or older)"
        elif "function not found" in text:
            why = "the Functions library is not loaded (`rollout functions load`, as an admin, once per server)"
        else:
            why = f"FCALL was refused ({exc})"
    except redis.RedisError as exc:
        # A cluster client looks the command up in the server's COMMAND table before sending it.
        if "doesn't exist in redis commands" not in str(exc).lower():
            raise  # connection errors and the like: the caller's retry decides
        why = "this Redis has no Functions (6.2 or older)"
    if why:
        log.debug("Lua scripts run by EVALSHA, not FCALL: %s", why)
    return why


def fallback_warning(why: str) -> str:
    return (f"Lua scripts run by EVALSHA, not FCALL: {why}. A Redis user that may EVALSHA may run any Lua "
            "script, so ACL roles cannot be limited to the pipeline's own (docs/security.md)")


class PipelineScript:
    """One of the pipeline's scripts on `client`: a library function where this version's
    library is loaded, else registered on `client` (redis-py re-sends one the server has
    forgotten after a restart by itself). Which, is asked at the first call, which callers
    retry through outages, never when a Queue or Consumer is built: a process started
    while Redis is away waits like any other call."""

    def __init__(self, client: redis.Redis, name: str):
        self.client = client
        self.name = name
        self._run: Script | FunctionScript | None = None

    def _resolve(self) -> Script | FunctionScript:
        if self._run is None:
            self._run = (FunctionScript(self.client, self.name) if uses_functions(self.client)
                         else self.client.register_script(source(self.name)))
        return self._run

    def __call__(self, keys=(), args=(), client: redis.Redis | None = None):
        return self._resolve()(keys=keys, args=args, client=client)

    def queue(self, pipe, keys=(), args=()) -> None:
        """Add a call to `pipe` (a pipeline or MULTI of this script's client), as FCALL or
        as a bare EVALSHA: redis-py's Script on a pipeline asks SCRIPT EXISTS first, an
        extra round trip per execute. A server that does not know the script answers that
        call with NoScriptError: `load()` and run the pipeline again."""
        run = self._resolve()
        # As plain commands: redis-py's cluster pipeline refuses its evalsha() (a script may
        # have to be loaded on several nodes); a pipeline's keys share one hash tag, so one
        # node runs the whole MULTI.
        if isinstance(run, FunctionScript):
            pipe.execute_command("FCALL", run.function, len(keys), *keys, *args)
        else:
            pipe.execute_command("EVALSHA", run.sha, len(keys), *keys, *args)

    def load(self) -> None:
        """SCRIPT LOAD this script (after a NoScriptError from a queued call)."""
        run = self._resolve()
        if not isinstance(run, FunctionScript):
            run.sha = self.client.script_load(run.script)


def load(client: redis.Redis, *names: str) -> dict[str, PipelineScript]:
    """The scripts `names`, by FCALL or EVALSHA as `client`'s server allows (PipelineScript)."""
    return {name: PipelineScript(client, name) for name in names}
