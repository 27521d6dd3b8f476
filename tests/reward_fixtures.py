"""Reward functions that misbehave, importable by worker processes the tests start."""
from __future__ import annotations

import os
import threading
import time


def hang_forever(args, sample) -> float:
    """A sync judge stuck for good (a deadlock, a sandbox that never returns)."""
    threading.Event().wait()
    return 0.0


def exit_on_poison(args, sample) -> float:
    """Kills its worker process on one particular prompt; fine on every other."""
    if "poison" in str(sample.prompt):
        os._exit(1)
    return 1.0


def slow_judge(args, sample) -> float:
    """A sync judge taking 0.3 s a sample (sympy, a sandboxed run)."""
    time.sleep(0.3)
    return 1.0
