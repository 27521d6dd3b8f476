"""Clear errors when Redis refuses a command under a user's ACL: which command, on which
key, and inside a script which script and line (Redis's own text names no command for a
key refusal, and inside a script only its sha and line). Every client `connect()` builds
is an ExplainingRedis; the roles themselves are pipeline/ops/acl.py's."""
from __future__ import annotations

import re

import redis

from pipeline import scripts

#: A `redis.call('CMD', ...)` / `redis.pcall(...)` in a script's source: the command it calls.
SCRIPT_CALL = re.compile(r"""redis\.p?call\(\s*['"]([A-Za-z]+)['"]""")


class PermissionDenied(redis.exceptions.NoPermissionError):
    """Redis refused a command under the user's ACL; the message names the command
    (inside a script: the script, its line and the command there)."""


_SCRIPT_PLACE = re.compile(r"script: ([0-9a-f]{40}), on @user_script:(\d+)")
_SCRIPT_REFUSAL = "The user executing the script can't"


def _shown(arg) -> str:
    text = arg.decode(errors="replace") if isinstance(arg, bytes) else str(arg)
    return repr(text[:100])


def _user(client: redis.Redis) -> str:
    return client.connection_pool.connection_kwargs.get("username") or "default"


class ExplainingPipeline(redis.client.Pipeline):
    """A pipeline whose refusals say "permission denied" (redis-py names the command)."""

    def execute(self, raise_on_error: bool = True):
        stack = [c[0] if isinstance(c, tuple) else c.args for c in self.command_stack]  # execute() resets it
        try:
            return super().execute(raise_on_error)
        except redis.exceptions.NoPermissionError as exc:
            # redis-py's text quotes the refused command's arguments (a payload, say): name it and its key.
            text = str(exc)
            found = re.match(r"Command # (\d+) \(.*?\) of pipeline caused error: ", text, re.DOTALL)
            if found and 0 < int(found.group(1)) <= len(stack):
                args = stack[int(found.group(1)) - 1]
                command = str(args[0]).upper() + (f" {_shown(args[1])}" if len(args) > 1 else "")
                text = f"{command}: {text[found.end():]}"
            raise PermissionDenied(f"permission denied for Redis user {_user(self)!r}: {text}") from None


class ExplainingRedis(redis.Redis):
    """redis.Redis whose ACL refusals raise PermissionDenied saying which command was
    refused. Redis's own text names no command for a key refusal, and inside a script
    only its sha and line."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._script_sources: dict[str, str] = {}

    def register_script(self, script: str | bytes):
        registered = super().register_script(script)
        self._script_sources[registered.sha] = script if isinstance(script, str) else script.decode()
        return registered

    def pipeline(self, transaction: bool = True, shard_hint=None) -> ExplainingPipeline:
        return ExplainingPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)

    def execute_command(self, *args, **options):
        try:
            return super().execute_command(*args, **options)
        except redis.exceptions.ResponseError as exc:
            text = str(exc)
            if not isinstance(exc, redis.exceptions.NoPermissionError) and _SCRIPT_REFUSAL not in text:
                raise
            raise PermissionDenied(self._explain(args, text)) from None

    def _explain(self, args: tuple, text: str) -> str:
        command = str(args[0]).upper()
        reason = text.split(" script: ")[0]
        if command == "EVALSHA" and len(args) > 1 and args[1] in self._script_sources:
            command = f"EVALSHA of {scripts.name_of(self._script_sources[args[1]])}"
        elif command == "FCALL" and len(args) > 1:  # the library's functions are named for their .lua files
            command = f"FCALL of {_shown(args[1])[1:-1].removeprefix(scripts.LIBRARY + '_')}.lua"
        place = _SCRIPT_PLACE.search(text)
        if place and place.group(1) in self._script_sources:
            source = self._script_sources[place.group(1)]
            line_no = int(place.group(2))
            lines = source.splitlines()
            line = lines[line_no - 1] if 0 < line_no <= len(lines) else ""
            called = SCRIPT_CALL.search(line)
            inner = called.group(1).upper() if called else "a command"
            name, file_line = scripts.origin(source, line_no)
            command = f"{inner} in {name} line {file_line} (run by {command})"
        elif "keys" in reason and len(args) > 1 and str(args[0]).upper() not in ("EVALSHA", "EVAL", "FCALL"):
            command = f"{command} {_shown(args[1])}"  # the first argument: the key, for every command we send
        return f"permission denied for Redis user {_user(self)!r}: {command}: {reason}"
