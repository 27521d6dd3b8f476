"""Are the workers generating on the engines slime updates?

slime pushes its weights to its rollout engines (the ones it launched, behind its
router, or `--rollout-external-engine-addrs`) and tells nobody else. Workers pointed at
other engines keep sampling the initial policy for the whole run while every batch looks
fresh on the queue's clock. Two observables tell: the engines each live worker registered
(`worker_info`), and the weight versions samples carry against the versions slime's
engines report (`/get_model_info`). A worker on a foreign engine is refused at start; one
that registers later has its groups refused when they are read (sent back to be generated
again, one error); a batch whose newest version lags slime's engines by more than the
staleness allows is logged as an error (docs/trainers.md, "One set of engines").
"""
from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pipeline.consumer import Refusal
from pipeline.queue import Queue
from pipeline.types import Group, parse_version

from .slime_checks import SlimeConfigError

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 5.0
#: Versions a batch's newest sample may lag slime's engines without `rollout_max_staleness`
#: (with it: η + this). Generation of one rollout overlaps training of the last (train_async).
VERSION_LAG_SLACK = 2
#: Without a staleness bound: lag beyond this many versions is reported.
DEFAULT_VERSION_LAG = 8
#: The kind of a refusal of a group generated on an engine slime does not update.
FOREIGN_ENGINE = "foreign_engine"


def engine_key(url: str) -> str:
    """host:port of an engine URL or a `host:port` address, "localhost" read as 127.0.0.1."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = "127.0.0.1" if parts.hostname in ("localhost", "::1") else parts.hostname or ""
    return f"{host}:{parts.port or 80}"


def _get(url: str) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url), timeout=HTTP_TIMEOUT_S) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def slime_engine_urls(args: Any) -> list[str] | None:
    """The engines slime updates: `--rollout-external-engine-addrs`, else the workers of
    slime's router (`--sglang-router-ip/port`, set by slime when it starts its engines).
    None when neither is known or the router does not answer."""
    external = getattr(args, "rollout_external_engine_addrs", None)
    if external:
        return [a if "://" in a else f"http://{a}" for a in external]
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    if not ip or not port:
        return None
    router = f"http://{ip}:{port}"
    try:
        body = _get(router + "/workers")
        urls = [w["url"] for w in body.get("workers", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        try:  # older routers
            urls = list(_get(router + "/list_workers").get("urls", []))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("cannot list slime's engines behind its router %s (%s): the engine check is off", router, exc)
            return None
    return urls + [router]  # workers may also generate through slime's router itself


def engine_version(url: str) -> str | None:
    """An engine's weight version (`/get_model_info`, `/model_info` since SGLang 0.5.6), None if unreachable."""
    for path in ("/get_model_info", "/model_info"):
        try:
            return str((_get(url.rstrip("/") + path) or {}).get("weight_version") or "default")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                return None
        except (OSError, ValueError, AttributeError):
            return None
    return None


def version_number(version: str | None) -> int | None:
    """slime numbers its weights 1, 2, ...; an engine slime has not updated says "default" (0)."""
    if version == "default":
        return 0
    return parse_version(version) if version is not None else None


def worker_engines(queue: Queue) -> dict[str, list[str]]:
    """Each live worker's engines, as it registered them."""
    live = queue.live_workers()
    if not live:
        return {}
    infos = queue.redis.hmget(queue.keys.worker_info, live)
    out = {}
    for worker, raw in zip(live, infos):
        try:
            out[worker] = list(json.loads(raw or b"{}").get("engines") or [])
        except (ValueError, AttributeError):
            continue
    return out


@dataclass
class EngineCheck:
    """The check at start and at each rollout, for one RedisDataSource."""

    args: Any
    queue: Queue
    max_staleness: int | None = None
    slime_urls: list[str] | None = None
    reported: set[str] = field(default_factory=set)  # foreign engines already logged
    #: Workers seen on engines slime does not update, and those engines: their groups are
    #: refused even after the worker left (its registration goes with it).
    foreign: dict[str, list[str]] = field(default_factory=dict)

    def start(self) -> None:
        """Refuse to start while a live worker generates on an engine slime does not update."""
        self.slime_urls = slime_engine_urls(self.args)
        if self.slime_urls is None:
            log.warning("slime's engines are unknown to the adapter (no --rollout-external-engine-addrs nor "
                        "--sglang-router-ip/port): it cannot check that the workers generate on the engines slime "
                        "updates (docs/trainers.md, 'One set of engines')")
            return
        foreign = self.foreign_engines()
        if foreign:
            raise SlimeConfigError(self._foreign_message(foreign) + ": start those workers with --engine-url on "
                                   "slime's engines or its router, or stop them")

    def foreign_engines(self) -> dict[str, list[str]]:
        """Live worker -> its engines that slime does not update (remembered in `foreign`)."""
        if self.slime_urls is None:
            return {}
        slime = {engine_key(u) for u in self.slime_urls}
        out = {}
        for worker, engines in worker_engines(self.queue).items():
            other = [e for e in engines if engine_key(e) not in slime]
            if other:
                out[worker] = other
        self.foreign.update(out)
        return out

    def refusals(self, groups: list[Group]) -> list[Refusal | None]:
        """For each group, a Refusal if the worker that generated it is on an engine slime
        does not update (registered now, or seen so before): its tokens come from weights
        slime never trained, however fresh the queue's clock says they are."""
        if self.slime_urls is None or not groups:
            return [None] * len(groups)
        self.foreign_engines()
        return [None if group.worker not in self.foreign else Refusal(
            FOREIGN_ENGINE, f"group {group.group_id} was generated by worker {group.worker} on "
                            f"{', '.join(self.foreign[group.worker])}, an engine slime does not update (slime updates "
                            f"{', '.join(self.slime_urls)}): stop that worker, or start it with --engine-url on "
                            f"slime's engines or its router") for group in groups]

    def _foreign_message(self, foreign: dict[str, list[str]]) -> str:
        named = "; ".join(f"worker {w} on {', '.join(e)}" for w, e in sorted(foreign.items())[:5])
        return (f"workers generate on engines slime does not update ({named}); slime updates "
                f"{', '.join(self.slime_urls or [])}, so those workers would sample the initial policy all run")

    def rollout(self, groups: list[Group]) -> dict[str, Any]:
        """Log loudly what is wrong with this batch's engines; metrics for slime's log."""
        if self.slime_urls is None:
            return {}
        foreign = self.foreign_engines()
        if foreign and set(foreign) - self.reported:
            self.reported |= set(foreign)
            log.error("%s", self._foreign_message(foreign))
        versions = [version_number(engine_version(u)) for u in self.slime_urls]
        current = max((v for v in versions if v is not None), default=None)
        carried = [version_number(v) for g in groups for s in g.samples for v in s.weight_versions]
        newest = max((v for v in carried if v is not None), default=None)
        metrics: dict[str, Any] = {"rollout/queue/foreign_engine_workers": len(foreign)}
        if current is None or newest is None:
            return metrics
        lag = current - newest
        metrics["rollout/queue/engine_version_lag"] = lag
        allowed = DEFAULT_VERSION_LAG if self.max_staleness is None else self.max_staleness + VERSION_LAG_SLACK
        if lag > allowed:
            log.error("the newest sample of this batch was generated with weight version %s, slime's engines are at "
                      "%s (%d behind, more than %d): the workers are not generating on the engines slime updates, "
                      "or they serve a backlog that old (docs/trainers.md, 'One set of engines')", newest, current,
                      lag, allowed)
        return metrics
