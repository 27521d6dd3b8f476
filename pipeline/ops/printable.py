"""Untrusted text on an operator's terminal.

Prompts, engine errors, rows, worker names and history details come from data and
from engines. Printed raw, an escape sequence among them retitles the operator's
window, writes the clipboard (OSC 52) or rewrites what is on screen, and a bidi
override hides text. `printable` shows every such character as an escape instead.
"""
from __future__ import annotations


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """`text` with every character that is not printable (controls, ESC, bidi and other
    format characters, line breaks) written as a backslash escape; plain text unchanged."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)
