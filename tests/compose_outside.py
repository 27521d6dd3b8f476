"""Running docker-compose.yml's services on this machine, outside containers (no Docker
engine here): each service's own command line, environment and healthcheck, with every
service on 127.0.0.1 and a port of its own. For tests/test_compose.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.redis_server import find_redis_server, free_port

REPO = Path(__file__).resolve().parent.parent


def dependency_order(services: dict[str, dict]) -> list[str]:
    """Compose's start order: every service after what it depends on (file order otherwise)."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name not in order:
            for dep in services[name].get("depends_on") or {}:
                visit(dep)
            order.append(name)

    for name in services:
        visit(name)
    return order


class Outside:
    """Turns a service's command line, environment and healthcheck into the same ones on
    this machine: every service on 127.0.0.1 with a port of its own, /app (the image's
    WORKDIR) is the repository, `rollout` is `python -m cli`."""

    def __init__(self, services: dict[str, dict], tmp: Path):
        self.services = services
        self.tmp = tmp
        self.port = {name: free_port() for name in services}
        self.metrics_port = {name: free_port() for name in services}  # a command's --metrics-port
        self.addresses = {}
        for name, svc in services.items():
            inside = 6379 if name == "redis" else 30000
            for host in [name, *((svc.get("networks") or {}).get("default") or {}).get("aliases", [])]:
                for before in ("//", "@"):  # http://host:port, redis://:password@host:port
                    self.addresses[f"{before}{host}:{inside}"] = f"{before}127.0.0.1:{self.port[name]}"

    def text(self, value: str) -> str:
        for inside, outside in self.addresses.items():
            value = value.replace(inside, outside)
        return value.replace("/app/", f"{REPO}/")

    def command(self, name: str) -> list[str]:
        command = [self.text(str(a)) for a in self.services[name]["command"]]
        for flag, value in (("--port", str(self.port[name])), ("--host", "127.0.0.1"),
                            ("--metrics-port", str(self.metrics_port[name]))):
            if flag in command:
                command[command.index(flag) + 1] = value
        program, args = command[0], command[1:]
        if command[:2] == ["sh", "-c"] and "exec valkey-server -" in command[2]:
            # Redis (Valkey in the image): the file's own shell line, with this machine's server.
            data = self.tmp / "redis"
            data.mkdir()
            script = command[2].replace("$$", "$").replace("valkey-server", find_redis_server())
            return ["sh", "-c", script, *command[3:], "--port", str(self.port[name]), "--bind", "127.0.0.1",
                    "--dir", str(data)]
        if "sglang_router.launch_router" in args:
            # Its Prometheus exporter binds 0.0.0.0:29000, private to a container but not here.
            args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if program == "rollout":
            return [sys.executable, "-m", "cli", *args]
        if program == "python":
            return [sys.executable, *args]
        raise AssertionError(f"{name}: no way to run {program!r} outside a container")

    def environment(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
        env.update({k: self.text(str(v)) for k, v in (self.services[name].get("environment") or {}).items()})
        env.update(ROLLOUT_HOME=str(self.tmp / "home"), PYTHONUNBUFFERED="1")
        return env

    def healthy(self, name: str) -> bool:
        proc = self.health(name)
        return proc.returncode == 0 and "NOAUTH" not in proc.stdout

    def health(self, name: str) -> subprocess.CompletedProcess:
        """The service's healthcheck, run here: its exit status and what it printed."""
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: healthcheck {test}"
        command = [a.replace("localhost:30000", f"127.0.0.1:{self.port[name]}")
                   .replace("localhost:9100", f"127.0.0.1:{self.metrics_port[name]}") for a in test[1:]]
        if command[0] == "python":
            command[0] = sys.executable
        elif command[0] == "valkey-cli":  # reads the password from REDISCLI_AUTH, as valkey-cli does
            command = [str(Path(find_redis_server()).with_name("redis-cli")), "-p", str(self.port[name]),
                       *command[1:]]
        elif command[0] == "rollout":
            command = [sys.executable, "-m", "cli", *command[1:]]
        return subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=REPO,
                              env=self.environment(name))


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each still running, in this order (as `docker compose stop`); SIGKILL what
    does not stop within 30 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
