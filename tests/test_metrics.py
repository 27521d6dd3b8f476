"""Prometheus metrics from real traffic: a worker against the simulator, a consumer."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pipeline.consumer import Consumer
from pipeline.redis_server import free_port
from pipeline.types import Group
from tests.helpers import WorkerThread, http_json, wait_for
from engines.simulator import SimConfig, start_simulator
from workers.worker import SamplingSettings, WorkerSettings, WorkerState


def scrape(port: int) -> dict[str, float]:
    """Every sample on /metrics as {name{labels}: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_worker_and_consumer_metrics_from_real_traffic(redis_url, queue, namespace):
    sim = start_simulator(SimConfig(seed=5, decode_tokens_per_s=20000.0, length_median=24, length_p99=240))
    port = free_port()
    queue.push_groups([Group.fresh(f"m{i}", f"What is {i} + 1?", 4, label=str(i + 1), row=i) for i in range(20)])
    worker = WorkerThread(WorkerSettings(redis_url=redis_url, engine_urls=[sim.url], namespace=namespace,
                                         sampling=SamplingSettings(max_new_tokens=64), heartbeat_s=0.2,
                                         metrics_port=port))
    try:
        consumer = Consumer(queue.redis, namespace)
        for _ in range(2):
            consumer.commit(consumer.next_batch(10, timeout=30))
        # Queue depths are sampled by the worker's upkeep (every second). Gauges are
        # process-wide, so wait for this worker's reading (every prompt claimed).
        wait_for(lambda: scrape(port).get('rollout_queue_depth{place="prompts"}') == 0, timeout=10,
                 what="queue depth")
        m = scrape(port)
        # Two groups of 4 whose requests hang: 8 samples in flight, as the gauge says.
        http_json(sim.url + "/sim/faults", {"hang_rate": 1.0})
        queue.push_groups([Group.fresh(f"h{i}", "What is 1 + 1?", 4, label="2", row=i) for i in range(2)])
        wait_for(lambda: scrape(port).get("rollout_inflight_samples") == 8, timeout=10, what="8 samples in flight")
        # /health on the same port: registered, so ready, with the state status shows.
        health = http_json(f"http://127.0.0.1:{port}/health")
        assert health["ready"] is True and health["state"].split(":")[0] in {s.value for s in WorkerState}
    finally:
        worker.stop()
        sim.stop()
    assert m["rollout_generation_seconds_count"] >= 80  # 20 groups x 4 samples
    assert m["rollout_output_tokens_count"] >= 80 and m["rollout_output_tokens_sum"] > 0
    assert m['rollout_groups_total{place="results"}'] >= 20
    assert m['rollout_queue_depth{place="prompts"}'] == 0
    # The consumer runs in this process: its metrics are on the same registry.
    assert m["rollout_trainer_wait_seconds_count"] >= 2
    assert m["rollout_staleness_versions_count"] >= 20
