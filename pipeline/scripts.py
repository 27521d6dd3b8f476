"""The Lua scripts of `lua/`, each loaded with the shared prelude (`lua/_prelude.lua`)."""
from __future__ import annotations

from functools import cache
from pathlib import Path

import redis
from redis.commands.core import Script

_LUA = Path(__file__).with_name("lua")


_PRELUDE = "_prelude.lua"


@cache
def source(name: str) -> str:
    return (_LUA / _PRELUDE).read_text() + "\n" + (_LUA / f"{name}.lua").read_text()


def name_of(loaded: str) -> str:
    """The .lua file a loaded script was made from."""
    return next((path.name for path in sorted(_LUA.glob("*.lua"))
                 if path.name != _PRELUDE and loaded == source(path.stem)), "a script")


def origin(loaded: str, line: int) -> tuple[str, int]:
    """The .lua file and line that line `line` of a loaded script comes from (for
    error messages: Redis numbers the lines of the whole loaded text)."""
    prelude_lines = len((_LUA / _PRELUDE).read_text().splitlines()) + 1
    return (name_of(loaded), line - prelude_lines) if line > prelude_lines else (_PRELUDE, line)


def load(client: redis.Redis, *names: str) -> dict[str, Script]:
    """Scripts registered on `client`; redis-py re-sends one the server has forgotten
    (after a restart) by itself."""
    return {name: client.register_script(source(name)) for name in names}
