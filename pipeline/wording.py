"""Words for people: a count with its noun, singular or plural (`1 engine`, `2 engines`)."""
from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`1 engine`, `2 engines`: a count with its noun (plural: + "s" unless given)."""
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {plural or noun + 's'}"
