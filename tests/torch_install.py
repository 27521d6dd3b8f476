"""Which torch `bash scripts/test` installs before the test extra: none when a torch of at
least the tested version is installed (a user's CPU build or newer release stays: the
extras ask for torch>=2.13 and never downgrade it), else the tested release, which this
machine kind has on disk as a CPU build (elsewhere pip would take the CUDA build: on a
machine without a GPU, install the CPU one first, as the message says).

`python -m tests.torch_install` prints the requirement to install, or nothing."""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

#: The release the suite is run with in CI; the extras' lower bound is its minor version.
TESTED = "2.13.0"
MINIMUM = (2, 13)


def installed_version() -> str | None:
    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def to_install(installed: str | None) -> str | None:
    """The requirement to install given the installed torch version (None: none), or None."""
    if installed is not None:
        found = re.match(r"(\d+)\.(\d+)", installed)
        if found and (int(found[1]), int(found[2])) >= MINIMUM:
            return None
    return f"torch=={TESTED}"


if __name__ == "__main__":
    print(to_install(installed_version()) or "")
