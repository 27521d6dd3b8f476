"""The benchmarks at their smallest settings: the JSON they print has its keys, and its
figures are sane (positive rates, token and group counts that add up, nothing missing);
and every one runs as the README says, `python bench/<name>.py`, from a clone."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bench.waterfall import FATES

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run_bench(script: str, *args: str, timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, f"bench/{script}", "--json", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_async_vs_sync_smallest_run_reports_consistent_rows():
    steps, batch, n, seeds = 2, 4, 2, 2
    out = run_bench("async_vs_sync.py", "--engines", "2", "--slots", "8", "--n-samples", str(n), "--batch",
                    str(batch), "--median", "32", "--steps", str(steps), "--warmup", "1", "--etas", "2",
                    "--tails", "10", "--seeds", str(seeds), "--profiles", "", "--pauses", "", "--updates", "",
                    "--no-engine-table")
    headline = {"speedup_tokens_eta2", "speedup_samples_eta2", "vs_inmemory_eta2", "trained_utilization_eta2"}
    assert set(out) == headline | {"ranges", "seeds", "profile", "rows", "settings", "waterfall_eta2",
                                   "waterfall_inmemory_eta2", "breakeven_update_s", "update_sweep", "load"}
    assert out["load"]["after"]["cpus"] >= 1 and len(out["load"]["before"]["loadavg"]) == 3
    assert out["breakeven_update_s"] == {"abort": None}  # one cost run: no curve
    assert out["seeds"] == [0, 1] and out["profile"] == "h100-llama8b" and set(out["ranges"]) == headline
    assert [(r["system"], r["eta"]) for r in out["rows"]] == [("sync", 0), ("in-memory", 2), ("pipeline", 2)]
    assert out["speedup_tokens_eta2"] > 0 and out["vs_inmemory_eta2"] > 0 and 0 < out["trained_utilization_eta2"] <= 1
    for key in headline:
        lo, hi = out["ranges"][key]
        assert lo <= out[key] <= hi
    for row in out["rows"]:
        assert [p["seed"] for p in row["per_seed"]] == out["seeds"]  # every row has its per-seed values
        assert row["trained_tokens_per_s"]["median"] > 0 and row["tokens_x_sync"]["median"] > 0
        for p in row["per_seed"]:
            assert p["samples_per_s"] > 0 and 0 <= p["trainer_idle"] < 1
            # (trained may exceed generated in the window: groups generated before it are trained in it)
            assert 0 < p["trained_utilization"] <= 1.05 and 0 < p["generated_utilization"] <= 1.05
            for clock in ("oldest", "completion"):
                assert sum(p[f"staleness_{clock}"].values()) == steps * batch  # every trained group, once
            w = p["waterfall"]  # every generated token has one fate, each counted where it happens
            assert w["trained"] > 0 and min(w[f] for f in FATES) >= 0
            assert w["generated"] == sum(w[f] for f in FATES)
            assert w["stale"] == sum(w["stale_by_lag"].values()) == sum(w["stale_by_length"].values())
            assert all(int(lag) > 2 for lag in w["stale_by_lag"])  # stale means past η
        w = row["waterfall"]  # the row's: summed over seeds
        assert w["generated"] == sum(p["waterfall"]["generated"] for p in row["per_seed"])
        assert sum(w["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    assert out["waterfall_eta2"] == out["rows"][2]["waterfall"]
    assert out["waterfall_inmemory_eta2"] == out["rows"][1]["waterfall"]
    sync = out["rows"][0]
    assert all(p["staleness_oldest"] == {"0": steps * batch} for p in sync["per_seed"])  # fresh groups only
    assert sync["waterfall"]["stale"] == 0 and sync["waterfall"]["left"] == 0  # sync trains what it generates
    assert sync["tokens_x_sync"] == {"median": 1.0, "range": [1.0, 1.0]}
    assert all(p["audit"].endswith(": OK") for p in out["rows"][2]["per_seed"])


def test_multi_turn_smallest_run_reports_sync_and_pipeline_rows():
    steps, batch = 2, 4
    out = run_bench("multi_turn.py", "--engines", "1", "--slots", "8", "--n-samples", "2", "--batch", str(batch),
                    "--median", "32", "--p99", "320", "--steps", str(steps), "--warmup", "1", "--turns", "2",
                    "--tool-median-s", "0.05", "--tool-p99-s", "0.5", "--concurrency-factors", "1")
    assert set(out) == {"rows", "speedup", "settings", "load"} and out["speedup"] > 0
    assert [r["system"] for r in out["rows"]] == ["sync", "pipeline"]
    for row in out["rows"]:
        assert row["samples_per_s"] > 0 and row["tokens_per_s"] > 0 and 0 < row["utilization"] <= 1
        assert sum(row["staleness"].values()) == steps * batch
    assert out["rows"][0]["staleness"] == {"0": steps * batch}


def test_redis_capacity_smallest_run_reports_every_sample_length_and_fsync_mode():
    out = run_bench("redis_capacity.py", "--quick", "--window", "1", "--max-workers", "1", timeout=300)
    assert out["settings"]["publish_together"] is True  # as the worker's publisher, by default
    lengths = {"256", "1024", "2048"}
    for key in ("server_us_per_group", "engines_per_core", "fsync_blocked_us_per_group", "engine_tokens_per_s"):
        assert set(out[key]) == lengths, key
        assert all(out[key][n] >= 0 for n in lengths), key
    assert all(out["server_us_per_group"][n] > 0 and out["engines_per_core"][n] > 0 for n in lengths)
    # a longer sample costs an engine longer steps (a bigger cache): fewer tokens/s
    assert out["engine_tokens_per_s"]["256"] > out["engine_tokens_per_s"]["1024"] > out["engine_tokens_per_s"]["2048"]
    assert out["publish_to_delivery_p99_ms"] > 0
    assert set(out["by_fsync"]) == {"everysec", "always"}
    assert out["by_fsync"]["everysec"]["fsync_blocked_us_per_group"] <= out["by_fsync"]["always"]["server_us_per_group"]
    for mode in out["by_fsync"].values():
        assert mode["groups_per_s_measured"] > 0 and 0 < mode["server_cpu_at_measured"] <= 1.5
        for load in ("50%", "90%"):
            latency = mode["latency_ms"][load]
            assert 0 < latency["p50"] <= latency["p99"] and latency["groups"] > 0


BENCHES = sorted(p.name for p in (ROOT / "bench").glob("*.py") if "ArgumentParser(" in p.read_text())  # the commands


@pytest.mark.parametrize("script", BENCHES)
def test_every_benchmark_ends_through_the_shared_report(script):
    """Each command ends with bench/report.py's run_bench: its figures with the load it
    saw, or one line saying why it could not."""
    assert "run_bench(main)" in (ROOT / "bench" / script).read_text()


def test_a_benchmark_that_cannot_measure_says_why_in_one_line_with_the_load():
    proc = subprocess.run([sys.executable, "bench/step_time.py", "--engine-url", "http://127.0.0.1:9", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("step_time.py could not measure: ") and "load average" in line and "cores" in line
    out = json.loads(proc.stdout)
    assert set(out) == {"error", "load"} and out["error"] in line and out["load"]["after"]["cpus"] >= 1


def test_inflight_extends_a_window_too_short_to_hold_two_samples():
    """On a loaded machine one reading can outlast the quick window ("the measurement
    window holds fewer than two samples"): a 0.1 s window (samples every 0.5 s) is
    extended until it holds enough, and the readings skipped are counted."""
    out = run_bench("inflight.py", "--engines", "1", "--concurrency", "16", "--ramp", "0.5", "--settle", "0.5",
                    "--measure", "0.1", "--decode-rate", "200", timeout=180)
    assert out["window_samples"] >= 3 and out["window_s"] > 0.1 and out["missed_samples"] >= 0
    assert out["load"]["before"]["cpus"] >= 1


@pytest.mark.parametrize("script", BENCHES)
def test_every_benchmark_runs_as_a_script_without_the_package_installed(script, tmp_path):
    """`python bench/x.py` puts bench/ first on sys.path, not the repository: a benchmark
    that imports `pipeline` must find it itself (queue_overhead.py and inflight.py did not).
    Nor may it need the test extra: pytest is hidden (commit_wait.py needed it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    path = ROOT / "bench" / script
    as_script = (f"import runpy, sys; sys.modules['pytest'] = None; sys.path.insert(0, {str(path.parent)!r}); "
                 f"sys.argv = [{str(path)!r}, '--help']; runpy.run_path({str(path)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-I", "-c", as_script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_engine_table_reports_every_batch_against_the_published_figures():
    out = run_bench("engine_table.py", "--batches", "1,2", "--speedup", "20")
    assert [r["batch"] for r in out["rows"]] == [1, 2] and out["t_of_b_error_max"] >= 0
    assert out["rows"][0]["ratio_error"] == 0 and out["settings"]["source"].startswith("FerranAgulloLopez/")
    assert all(r["tpot_ms"] > 0 and r["tokens_per_s"] > 0 for r in out["rows"])


def test_pause_smallest_run_times_every_metric():
    """Each metric timed at every update (the workers' own state went unrecorded for a
    while: the bench read `worker.state`, which had become a method)."""
    out = run_bench("pause.py", "--updates", "1", "--run-s", "0.3", "--concurrency", "8", "--depth", "16")
    assert set(out["modes"]) == {"abort", "retract", "in_place"}
    for mode, m in out["modes"].items():
        for metric in ("quiesce_s", "engines_pause_s", "first_claim_s", "state_paused_s", "heartbeat_paused_s"):
            assert m[metric]["missing"] == 0 and m[metric]["median"] > 0, (mode, metric, m[metric])
    assert out["audit"]["summary"].endswith(": OK")


def test_async_vs_sync_sweeps_compare_each_setting_with_its_own_sync_row():
    """Every sweep row has a sync row at the same settings (one shared by pause modes,
    which do not change sync), and the base settings are not run twice."""
    sys.path.insert(0, str(ROOT))
    from bench.async_vs_sync import baseline_key, build_arms
    from bench.rl_loop import Settings

    base = Settings()
    arms = build_arms(base, [0, 2], [1, 10], ["flat", "h100-llama8b", "heavy"], ["abort", "in_place"],
                      ["nccl", "disk"])
    names = [(a.sweep, a.system, a.settings.engine_profile, a.settings.pause_mode, a.settings.weight_update)
             for a in arms]
    assert names == [
        ("main", "sync", "h100-llama8b", "abort", "nccl"), ("main", "in-memory", "h100-llama8b", "abort", "nccl"),
        ("main", "pipeline", "h100-llama8b", "abort", "nccl"), ("main", "pipeline", "h100-llama8b", "abort", "nccl"),
        ("tail", "sync", "h100-llama8b", "abort", "nccl"), ("tail", "pipeline", "h100-llama8b", "abort", "nccl"),
        ("profile", "sync", "flat", "abort", "nccl"), ("profile", "pipeline", "flat", "abort", "nccl"),
        ("profile", "sync", "heavy", "abort", "nccl"), ("profile", "pipeline", "heavy", "abort", "nccl"),
        ("pause", "pipeline", "h100-llama8b", "in_place", "nccl"),
        ("update", "sync", "h100-llama8b", "abort", "disk"), ("update", "pipeline", "h100-llama8b", "abort", "disk"),
        ("update", "pipeline", "h100-llama8b", "in_place", "disk"),  # the cost swept under each pause mode
    ]
    assert [a.eta for a in arms[2:4]] == [0, 2] and arms[4].settings.tail_ratio == pytest.approx(1.0)
    syncs = {baseline_key(a.settings) for a in arms if a.system == "sync"}
    assert all(baseline_key(a.settings) in syncs for a in arms)
    slowdowns = [a.settings.slowdown for a in arms[6:10:2]] + [base.slowdown]
    assert slowdowns[0] == 1.0 < slowdowns[2] < slowdowns[1]  # flat < calibrated < heavy


@pytest.fixture
def sim_engines(tmp_path):
    """Two `rollout sim-engine` processes, treated by the test as external engines."""
    sys.path.insert(0, str(ROOT))
    from pipeline.redis_server import free_port
    from tests.helpers import wait_for

    urls, procs = [], []
    try:
        for i in range(2):
            port = free_port()
            log = open(tmp_path / f"engine{i}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "cli", "sim-engine", "--port", str(port), "--seed", str(i),
                 "--max-running", "8", "--decode-rate", "400", "--engine-profile", "h100-llama8b"],
                cwd=ROOT, stdout=log, stderr=log, stdin=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")

        def healthy(url: str) -> bool:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False
        for url in urls:
            wait_for(lambda: healthy(url), what=f"{url}/health")
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def sim_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/sim/stats", timeout=5) as resp:
        return json.loads(resp.read())


def test_async_vs_sync_runs_its_rows_against_external_engines(sim_engines):
    """--engine-urls: the rows run on the given engines (nothing else generates), the
    lengths are the seeded draws whatever the engine would have written (the oracle's
    max_new_tokens with ignore_eos), and the weight update reaches the engines as
    /update_weight_version."""
    steps, batch, n = 2, 4, 2
    common = ["--slots", "8", "--n-samples", str(n), "--batch", str(batch), "--median", "32", "--steps",
              str(steps), "--warmup", "1", "--etas", "2", "--tails", "10", "--seeds", "1", "--pauses", "",
              "--updates", ""]
    out = run_bench("async_vs_sync.py", *common, "--engine-urls", ",".join(sim_engines), timeout=300)
    assert out["settings"]["engine_urls"] == sim_engines
    assert [(r["system"], r["eta"]) for r in out["rows"]] == [("sync", 0), ("in-memory", 2), ("pipeline", 2)]
    decoded = sum(sim_stats(u)["stats"]["decode_tokens"] for u in sim_engines)
    generated = sum(r["per_seed"][0]["waterfall"]["generated"] for r in out["rows"])
    assert decoded >= generated > 0  # the rows' tokens were generated on the given engines
    for row in out["rows"]:
        p = row["per_seed"][0]
        assert p["generated_tokens_per_s"] > 0 and 0 < p["generated_utilization"] <= 1.05
        assert 0 < p["slot_utilization"] <= 1 and p["waterfall"]["trained"] > 0
        assert p["waterfall"]["generated"] == sum(p["waterfall"][f] for f in FATES)
    for url in sim_engines:  # versions set, no weights loaded: the update was emulated
        stats = sim_stats(url)
        assert stats["weight_version"] == str(steps + 1) and stats["stats"].get("weight_updates", 0) == 0
    assert out["rows"][2]["per_seed"][0]["audit"].endswith(": OK")
    # Sync trains the first groups whole: exactly their seeded lengths.
    from bench.rl_loop import Settings, make_groups
    from engines.sim_model import draw_output_length

    settings = Settings(n_samples=n, batch_groups=batch, median_tokens=32, p99_tokens=320)
    drawn = sum(draw_output_length(random.Random(f"sample:{g.sampling_seed(x)}|length"), 32, 320)
                for g in make_groups(settings, (1 + steps) * batch) for x in g.samples)
    assert out["rows"][0]["per_seed"][0]["waterfall"]["trained"] == drawn


def test_step_time_measures_every_batch_through_generate(sim_engines):
    out = run_bench("step_time.py", "--engine-url", sim_engines[0], "--batches", "1,4,8", "--tokens", "64",
                    "--prompt-tokens", "8")
    assert out["engine_url"] == sim_engines[0] and out["tokens"] == 64
    assert [r["batch"] for r in out["rows"]] == [1, 4, 8]
    for row in out["rows"]:
        assert 0 < row["short_s"] and row["step_ms"] > 0 and row["tokens_per_s"] > 0
    assert out["r"] > 0


def test_the_length_oracle_stops_while_a_request_waits_at_a_paused_engine(sim_engines):
    """Found in CI: the oracle's stop() waited for a proxied /generate still waiting at an
    engine (aiohttp's shutdown waits 60 s for handlers, stop() 30 s) and the benchmark died
    with TimeoutError after its rows were done."""
    import threading

    from bench.engine_oracle import LengthOracle
    from tests.helpers import wait_for

    oracle = LengthOracle(sim_engines[:1], slots=8, median=32, p99=64, weight_update_s=0.0)
    proxy = oracle.urls[0]
    post = lambda path, body: urllib.request.urlopen(urllib.request.Request(  # noqa: E731
        proxy + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}), timeout=60)
    post("/pause_generation", {"mode": "abort"}).read()
    def generate() -> None:
        try:
            post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"sampling_seed": 7, "max_new_tokens": 8}})
        except OSError:  # the stopping proxy closes it
            pass

    waiting = threading.Thread(target=generate, daemon=True)
    waiting.start()  # held by the paused engine
    wait_for(lambda: oracle.engines[0].inflight == 1, what="the request at the paused engine")
    try:
        oracle.stop()  # raised TimeoutError after 30 s
    finally:
        urllib.request.urlopen(urllib.request.Request(sim_engines[0] + "/continue_generation", data=b"{}",
                                                      headers={"Content-Type": "application/json"}), timeout=10)
