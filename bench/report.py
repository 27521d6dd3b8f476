"""How every benchmark ends: what it measured and the load it saw, or one line saying why
it could not.

On a shared machine a benchmark competes with other work, so its figures mean little
without the load beside them: `run_bench(main)` records the load average and the cores
before and after, adds them to the JSON (`load`) or prints them under the table, and
turns a failure into one line on stderr (exit status 1) instead of a traceback. A
benchmark's `main(argv)` parses its arguments, prints its table when not asked for
JSON, and returns the result as a dict (None: nothing to add).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable

log = logging.getLogger("bench")
MAX_REASON = 600  # characters of the one line (a log tail in an error message is cut)


def machine_load() -> dict:
    """The load average (1, 5, 15 minutes) and the cores: all of them, and this process's."""
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0))}


def describe_load(before: dict, after: dict) -> str:
    return (f"load average {before['loadavg'][0]:g} before, {after['loadavg'][0]:g} after "
            f"(1 min; 5 min {after['loadavg'][1]:g}) on {after['cpus']} cores")


def run_bench(main: Callable[[list[str] | None], dict | None], argv: list[str] | None = None) -> None:
    """Run a benchmark's main and end as the module docstring says."""
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    name = Path(sys.argv[0]).name
    before = machine_load()
    try:
        result = main(argv)
    except SystemExit:  # argparse's usage errors and --help, a child role's end
        raise
    except KeyboardInterrupt:
        print(f"{name}: interrupted ({describe_load(before, machine_load())})", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - a benchmark says why it could not measure, never a traceback
        after = machine_load()
        log.debug("%s failed", name, exc_info=True)
        reason = " ".join((f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__).split())
        if len(reason) > MAX_REASON:
            reason = reason[:MAX_REASON] + " …"
        print(f"{name} could not measure: {reason} ({describe_load(before, after)})", file=sys.stderr)
        if as_json:
            print(json.dumps({"error": reason, "load": {"before": before, "after": after}}))
        sys.exit(1)
    after = machine_load()
    if as_json:
        print(json.dumps({**(result or {}), "load": {"before": before, "after": after}}))
    else:
        print(f"\n{describe_load(before, after)}")
