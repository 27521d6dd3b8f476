"""Secrets and operators' terminals (issue 26): a Redis password given as a query
parameter is never printed, and text from data or engines reaches the terminal with its
control characters escaped."""
from __future__ import annotations

import pytest

from pipeline.connection import redact, scrub
from pipeline.ops.printable import printable
from pipeline.queue import Place
from pipeline.types import Group
from tests.groups import claim, publish

SECRET = "pw-in-the-query-42"
TITLE = "\x1b]0;pwned\x07"  # sets the terminal window's title
CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4=\x07"  # OSC 52: writes the operator's clipboard
BIDI = "\u202e"  # right-to-left override: hides what follows


@pytest.mark.parametrize("url", [
    f"redis://127.0.0.1:1/0?password={SECRET}",
    f"redis://127.0.0.1:1/0?socket_timeout=1&password={SECRET}&username=bob",
    f"redis://127.0.0.1:1/0?PASSWORD={SECRET}",
    f"redis://127.0.0.1:1/0?pass%77ord={SECRET}",  # redis-py decodes the name: it is the password
    f"redis://127.0.0.1:1/0?password=pw&{SECRET}",  # a password holding '&', not percent-encoded
    f"redis://127.0.0.1:1/0?password=pw#{SECRET}",  # ... or '#'
    f"redis://127.0.0.1:1/0?password=pw&{SECRET}=1",
])
def test_a_password_in_the_url_query_is_never_printed(url, run):
    line = run("status", url=url).output
    assert "Redis" in line and "redis://127.0.0.1:1" in line and SECRET not in line, line
    assert SECRET not in redact(url) and "=***" in redact(url)
    assert scrub(f"AUTH failed for {SECRET}", url) == "AUTH failed for ***"


def hostile_dead_letter(queue) -> str:
    group = Group.fresh("g-hostile", f"What is 1+1?{TITLE}{BIDI}", 1, label=f"2{CLIPBOARD}")
    queue.push_groups([group])
    (claimed,) = claim(queue, "w1", 1).groups
    publish(queue, "w1", claimed, Place.DEAD, group=group,
            error=f"engine failed: HTTP 500 from http://e: {TITLE}{CLIPBOARD} exploded")
    return group.group_id


@pytest.mark.parametrize("command", [("dead", "list"), ("dead", "show", "g-hostile"), ("inspect", "g-hostile")])
def test_untrusted_text_reaches_the_terminal_with_control_characters_escaped(command, run, queue):
    hostile_dead_letter(queue)
    result = run(*command)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output and BIDI not in result.output
    unwrapped = "".join(line.strip() for line in result.output.splitlines())  # tables wrap long text
    assert "\\x1b]52;c;" in unwrapped  # shown, not obeyed


def test_printable_leaves_plain_text_alone():
    assert printable("engine failed 3 times; résumé ✓ 答案") == "engine failed 3 times; résumé ✓ 答案"
    assert printable("a\nb\tc\x00\u202e") == "a\\x0ab\\x09c\\x00\\u202e"
