"""SGLang simulators as separate processes, and their slot utilization over a window.

Each simulator (`engines.simulator.start_simulator`) gets its own process, as real engines
would, so their HTTP work does not share a GIL with the code being measured.

Utilization is read from the simulators themselves: a sampler thread polls every
engine's `GET /sim/stats` and integrates the number of requests *decoding* (running
past their prefill, not frozen by an in_place pause) over time; divided by the slots,
that is the fraction of engine slots producing tokens. The tokens the engines decoded
in the window come from their cumulative `decode_tokens` counters, read at both ends.
"""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/sim_fleet.py` from a clone
    sys.path.insert(0, str(REPO))

from engines.simulator import SimConfig, start_simulator  # noqa: E402

SAMPLE_PERIOD_S = 0.05  # utilization sampling period per engine
STARTUP_TIMEOUT_S = 30.0


@dataclass
class Reading:
    """One poll of one engine's GET /sim/stats."""

    at: float
    decoding: int  # running past prefill and not frozen: producing tokens
    running: int  # holding a slot (prefilling, decoding, or frozen by an in_place pause)
    waiting: int  # queued inside the engine for a slot
    paused: bool


@dataclass
class Window:
    """What the engines did between start_window() and stop_window(), time-averaged
    over all engines. utilization + free_slots + the slots held but not decoding
    (prefill, frozen while paused) = 1."""

    utilization: float  # decoding requests ÷ slots
    per_engine: list[float]  # utilization of each engine
    free_slots: float  # slots holding no request ÷ slots
    paused: float  # fraction of the time the engines were paused (weight updates)
    # Requests queued inside the engines (all engines together): with slots free
    # elsewhere, a cost of how requests are spread over the engines.
    waiting: float
    polls: int  # per engine
    generated_tokens: int  # decoded by all engines in the window


class SimFleet:
    """`count` simulators with `config` (seed + i each); context manager."""

    def __init__(self, config: SimConfig, count: int):
        self.config = config
        self.slots = config.max_running_requests
        self._procs: list[subprocess.Popen] = []
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._readings: list[list[Reading]] = []  # per engine
        try:
            for i in range(count):
                engine_config = json.dumps(asdict(replace(config, seed=config.seed + i)))
                self._procs.append(subprocess.Popen([sys.executable, "-m", "bench.sim_fleet", engine_config],
                                                    cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE))
            self.urls = [self._read_url(proc) for proc in self._procs]
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _read_url(proc: subprocess.Popen) -> str:
        """The child prints its URL once it listens (it picks a free port itself)."""
        line = proc.stdout.readline().decode().strip()
        if not line.startswith("http://"):
            proc.wait(STARTUP_TIMEOUT_S)
            raise RuntimeError(f"a simulator failed to start (exit code {proc.returncode})")
        return line

    # -- utilization ---------------------------------------------------------------------

    def start_window(self) -> None:
        self._stop.clear()
        self._readings = [[] for _ in self.urls]
        self._tokens_at_start = self._decoded_tokens()
        self._window_start = time.monotonic()
        self._sampler = threading.Thread(target=self._sample, name="sim-utilization", daemon=True)
        self._sampler.start()

    def stop_window(self) -> Window:
        end = time.monotonic()
        generated = self._decoded_tokens() - self._tokens_at_start
        self._stop.set()
        self._sampler.join()
        start, slots, n = self._window_start, self.slots, len(self.urls)

        def average(value) -> list[float]:
            return [_time_average([(r.at, value(r)) for r in readings], start, end) for readings in self._readings]

        per_engine = [u / slots for u in average(lambda r: r.decoding)]
        return Window(utilization=sum(per_engine) / n, per_engine=per_engine,
                      free_slots=sum(average(lambda r: slots - r.running)) / (slots * n),
                      paused=sum(average(lambda r: r.paused)) / n, waiting=sum(average(lambda r: r.waiting)),
                      polls=min(len(r) for r in self._readings), generated_tokens=generated)

    def _decoded_tokens(self) -> int:
        return sum(_get_json(url, "/sim/stats")["stats"].get("decode_tokens", 0) for url in self.urls)

    def _sample(self) -> None:
        conns = [http.client.HTTPConnection(urlsplit(u).hostname, urlsplit(u).port, timeout=5) for u in self.urls]
        try:
            while not self._stop.is_set():
                for conn, readings in zip(conns, self._readings):
                    conn.request("GET", "/sim/stats")
                    stats = json.loads(conn.getresponse().read())
                    load = stats["load"]
                    readings.append(Reading(at=time.monotonic(), decoding=stats["decoding"],
                                            running=load["num_running_reqs"], waiting=load["num_waiting_reqs"],
                                            paused=stats["paused"]))
                self._stop.wait(SAMPLE_PERIOD_S)
        finally:
            for conn in conns:
                conn.close()

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        if self._sampler is not None and self._sampler.is_alive():
            self._stop.set()
            self._sampler.join()
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> SimFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _get_json(url: str, path: str) -> dict:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=2)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _time_average(series: list[tuple[float, float]], start: float, end: float) -> float:
    """Average of a step function (each reading holds until the next) over [start, end],
    or from the first reading if that came later."""
    if not series:
        return 0.0
    begin = max(start, series[0][0])
    total = 0.0
    for (t, value), (t_next, _) in zip(series, series[1:] + [(end, 0)]):
        lo, hi = max(t, begin), min(t_next, end)
        if hi > lo:
            total += value * (hi - lo)
    return total / (end - begin) if end > begin else 0.0


if __name__ == "__main__":  # one simulator: python -m bench.sim_fleet CONFIG_JSON; prints its URL
    handle = start_simulator(SimConfig(**json.loads(sys.argv[1])))
    print(handle.url, flush=True)
    threading.Event().wait()  # until SIGTERM
