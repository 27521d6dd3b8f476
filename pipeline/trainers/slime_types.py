"""slime's classes, or stand-ins with the same fields when slime is not installed, and
the conversions between slime's `Sample` and ours.

slime is not a dependency: tests and the CLI run without it. Inside a slime process
(slime importable) an import error is raised, never papered over with stand-ins: a
stand-in `Sample` handed to slime fails far from the cause. The versions the entry
points need are checked when they start (`require`).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.types import Sample

#: `RolloutFnTrainOutput`, which `--rollout-function-path` must return, is in slime 0.2.0.
MIN_ROLLOUT_FUNCTION = (0, 2, 0)
#: `--data-source-path` is in slime 0.2.1; before it slime hard-codes its own data source.
MIN_DATA_SOURCE = (0, 2, 1)


class SlimeImportError(ImportError):
    """slime is installed but the classes the adapter needs cannot be imported."""


@dataclass
class RolloutFnTrainOutput:
    """Stand-in for slime.rollout.base_types.RolloutFnTrainOutput."""

    samples: list[list[Any]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """Stand-in for slime.rollout.base_types.RolloutFnEvalOutput."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


@dataclass(frozen=True)
class SlimeTypes:
    sample: type  # slime's Sample, or ours
    train_output: type
    eval_output: type
    version: tuple[int, ...] | None  # slime's version; None: slime is not installed
    load_tokenizer: Callable[..., Any] | None  # slime's (slime.utils.processing_utils), when it has one

    @property
    def real(self) -> bool:
        return self.version is not None


def _installed() -> bool:
    if "slime" in sys.modules:  # imported already (or blocked with None)
        return sys.modules["slime"] is not None
    return importlib.util.find_spec("slime") is not None


def _version() -> tuple[int, ...]:
    """The installed distribution's version; from a source checkout on the path, the
    newest of the minimum versions its modules show."""
    try:
        text = importlib.metadata.version("slime")
        return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())
    except (importlib.metadata.PackageNotFoundError, ValueError):
        pass
    try:
        importlib.import_module("slime.rollout.data_source").DataSource  # noqa: B018
        return MIN_DATA_SOURCE
    except (ImportError, AttributeError):
        return MIN_ROLLOUT_FUNCTION


@functools.lru_cache(maxsize=1)
def slime_types() -> SlimeTypes:
    """slime's classes when slime is installed, else ours. Cached; tests that inject a
    fake `slime` into sys.modules call `slime_types.cache_clear()`."""
    if not _installed():
        return SlimeTypes(Sample, RolloutFnTrainOutput, RolloutFnEvalOutput, None, None)
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput as EvalOut
        from slime.rollout.base_types import RolloutFnTrainOutput as TrainOut
        from slime.utils.types import Sample as SlimeSample
    except ImportError as exc:
        raise SlimeImportError(
            f"slime is installed but its rollout types do not import ({type(exc).__name__}: {exc}); the rollout "
            f"queue's adapter needs slime >= {_dotted(MIN_ROLLOUT_FUNCTION)} (--data-source-path: "
            f">= {_dotted(MIN_DATA_SOURCE)})") from exc
    try:
        from slime.utils.processing_utils import load_tokenizer
    except ImportError:
        load_tokenizer = None
    return SlimeTypes(SlimeSample, TrainOut, EvalOut, _version(), load_tokenizer)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def require(minimum: tuple[int, ...], what: str) -> SlimeTypes:
    """slime's types, refusing a slime older than `minimum` for `what`."""
    types = slime_types()
    if types.real and types.version < minimum:
        raise RuntimeError(f"{what} needs slime >= {_dotted(minimum)}; this is slime {_dotted(types.version)}")
    return types


def to_slime_sample(sample: Sample, types: SlimeTypes | None = None) -> Any:
    """slime's `Sample.from_dict(ours.to_dict())`: every field (ours declares slime's), and
    every attribute user code set, as slime's from_dict sets unknown keys. Without slime,
    our own Sample unchanged."""
    types = types or slime_types()
    if not types.real:
        return sample
    return types.sample.from_dict(sample.to_dict())


def from_slime_sample(sample: Any) -> Sample:
    """Our Sample from slime's (or from ours): every field and every attribute user code set
    (slime's to_dict has them all); tensors become lists."""
    return Sample.from_dict(sample.to_dict() if hasattr(sample, "to_dict") else dict(vars(sample)))


def current_rollout_id() -> int | None:
    """slime's rollout id of the rollout under way (`RolloutManager.generate` sets it with
    `slime.rollout.sample_hooks.set_current_rollout_id`), None without slime or before it."""
    if not slime_types().real:
        return None
    try:
        hooks = importlib.import_module("slime.rollout.sample_hooks")
    except ImportError:
        return None
    value = getattr(hooks, "_current_rollout_id", None)
    return value if isinstance(value, int) else None
