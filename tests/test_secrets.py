"""Secrets stay out of sight: the worker processes `rollout up` and `rollout demo`
start get the Redis URL (and its password) through the environment, not argv, which
any user can read in /proc and `ps`; metrics listen on loopback unless asked."""
from __future__ import annotations

from pathlib import Path

from pipeline.queue import Queue
from pipeline.redis_server import free_port
from tests.helpers import wait_for
from local.processes import REDIS_URL_ENV, start_worker_process, stop_processes
from engines.simulator import SimConfig, start_simulator


def listening_addresses(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at `port`, from /proc/net/tcp."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))  # little-endian
    return found


def test_child_workers_get_the_redis_url_through_the_environment_and_metrics_stay_local(
        redis_server, client, namespace, tmp_path):
    user, password = f"{namespace}-user", f"s3cret-{namespace}"
    client.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                       commands=["+@all"])
    url = f"redis://{user}:{password}@127.0.0.1:{redis_server.port}"
    sim = start_simulator(SimConfig(seed=1))
    local_port, open_port = free_port(), free_port()
    procs = [
        start_worker_process(url, namespace, [sim.url], tmp_path / "w0.log", ["--metrics-port", str(local_port)]),
        start_worker_process(url, namespace, [sim.url], tmp_path / "w1.log",
                             ["--metrics-port", str(open_port), "--metrics-host", "0.0.0.0"]),
    ]
    try:
        # Both connected with the password they were given.
        wait_for(lambda: len(Queue(client, namespace).live_workers()) == 2, what="two live workers")
        for proc in procs:
            argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
            assert not any(password.encode() in arg for arg in argv) and b"--redis-url" not in argv, argv
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert f"{REDIS_URL_ENV}={url}".encode() in environ
        wait_for(lambda: listening_addresses(local_port) and listening_addresses(open_port), what="metrics servers")
        assert listening_addresses(local_port) == {"127.0.0.1"}
        assert listening_addresses(open_port) == {"0.0.0.0"}
    finally:
        clean = stop_processes(procs)
        sim.stop()
        client.acl_deluser(user)
    assert clean, [(tmp_path / f"w{i}.log").read_text()[-2000:] for i in range(2)]
