"""A batch's metrics under slime-style keys (`RolloutFnTrainOutput.metrics`, which
slime logs with the rollout). docs/trainers.md lists them."""
from __future__ import annotations

import re
from typing import Any

from pipeline.consumer import BatchMetrics


def _metric_name(reason: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", reason).strip("_") or "filtered"


def slime_metrics(metrics: BatchMetrics, weight_version: int) -> dict[str, Any]:
    """Batch metrics under slime-style keys. Filter drops use slime's own
    `rollout/dynamic_filter/drop_<reason>` so existing dashboards keep working."""
    out: dict[str, Any] = {
        "rollout/queue/kept": metrics.kept,
        "rollout/queue/dropped": sum(metrics.dropped.values()),
        "rollout/queue/drop_ratio": metrics.drop_ratio,
        "rollout/queue/restarted": metrics.restarted,
        "rollout/queue/dead": metrics.dead,
        "rollout/queue/duplicates": metrics.duplicates,
        "rollout/queue/kept_when_insufficient": metrics.kept_insufficient,
        "rollout/queue/abandoned": metrics.abandoned,
        "rollout/queue/wait_time": metrics.wait_s,
        "rollout/queue/weight_version": weight_version,
    }
    for kind, count in metrics.refused.items():
        out[f"rollout/queue/refused_{_metric_name(kind)}"] = count
    for reason, count in metrics.dropped.items():
        key = "rollout/queue/drop_stale" if reason == "stale" else f"rollout/dynamic_filter/drop_{_metric_name(reason)}"
        out[key] = out.get(key, 0) + count
    if metrics.staleness:
        total = sum(metrics.staleness.values())
        out["rollout/queue/staleness_mean"] = sum(lag * n for lag, n in metrics.staleness.items()) / total
        out["rollout/queue/staleness_max"] = max(metrics.staleness)
        for lag, count in sorted(metrics.staleness.items()):
            out[f"rollout/queue/staleness/{lag}"] = count
    return out
