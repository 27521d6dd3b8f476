"""The Lua scripts of `lua/`, each loaded with the shared prelude (`lua/_prelude.lua`)."""
from __future__ import annotations

from functools import cache
from pathlib import Path

import redis
from redis.commands.core import Script

_LUA = Path(__file__).with_name("lua")


@cache
def source(name: str) -> str:
    return (_LUA / "_prelude.lua").read_text() + "\n" + (_LUA / f"{name}.lua").read_text()


def load(client: redis.Redis, *names: str) -> dict[str, Script]:
    """Scripts registered on `client`; redis-py re-sends one the server has forgotten
    (after a restart) by itself."""
    return {name: client.register_script(source(name)) for name in names}
