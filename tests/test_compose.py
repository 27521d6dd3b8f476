"""docker-compose.yml, Dockerfile and .dockerignore, checked without a Docker engine.

* the compose file validates with Debian's docker-compose (`config -q`, offline);
* every `rollout ...` command it runs exists and accepts those exact arguments
  (`--help` through click's runner, and a full parse of the arguments with the
  service's environment, as the container would see them);
* every ROLLOUT_* variable it sets is one the CLI reads;
* the profiles keep the GPU engines out of `--profile sim`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from cli import main

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
ENV = {"MODEL_PATH": "/models/Qwen2.5-7B-Instruct", "NAMESPACE": "exp1", "BATCH_SIZE": "32",
       "HF_CACHE": "/tmp/hf-cache"}


def compose_binary() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.fail("the docker-compose binary is missing: install Debian's docker-compose package "
                    "(apt-get install docker-compose) to validate docker-compose.yml offline")
    return path


def compose(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ENV}
    full_env.update(env or {})
    return subprocess.run([compose_binary(), "-f", str(COMPOSE), *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def config() -> dict:
    """The compose file as docker-compose resolves it (anchors merged, ${VARS} interpolated)."""
    proc = compose("config", env=ENV)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_validates(config):
    # `config` with the settings ran in the fixture; here: defaults alone, and a profile.
    for args in (["config", "-q"], ["--profile", "sim", "config", "-q"]):
        proc = compose(*args, env={})
        assert proc.returncode == 0, proc.stderr


def test_settings_are_interpolated(config):
    engine = config["services"]["engine-0"]["command"]
    assert engine[engine.index("--model-path") + 1] == ENV["MODEL_PATH"]
    assert config["services"]["worker"]["environment"]["ROLLOUT_NAMESPACE"] == "exp1"
    trainer = config["services"]["trainer"]["command"]
    assert trainer[trainer.index("--batch-size") + 1] == "32"


def rollout_services(config: dict) -> dict[str, list[str]]:
    out = {}
    for name, svc in config["services"].items():
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd and cmd[0] == "rollout":
            out[name] = [str(a) for a in cmd[1:]]
    return out


def test_every_rollout_command_exists_and_accepts_its_options(config, monkeypatch):
    services = rollout_services(config)
    assert {"worker", "feeder", "trainer", "sim-0", "sim-1"} <= set(services)
    for name, args in services.items():
        env = {k: str(v) for k, v in (config["services"][name].get("environment") or {}).items()}
        for var in [v for v in os.environ if v.startswith("ROLLOUT_")]:
            monkeypatch.delenv(var)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        # 1. `--help` on the exact command line: every option name exists.
        result = CliRunner().invoke(main, [*args, "--help"])
        assert result.exit_code == 0, f"{name}: rollout {' '.join(args)} --help\n{result.output}"
        # 2. A full parse without running: option values convert and required options
        #    (e.g. the worker's engine URLs) are there, from the arguments or the environment.
        cmd = main.commands.get(args[0])
        assert cmd is not None, f"{name}: no command {args[0]!r}"
        with click.Context(main, info_name="rollout") as ctx:
            try:
                cmd.make_context(args[0], list(args[1:]), parent=ctx).close()
            except click.ClickException as exc:
                pytest.fail(f"{name}: rollout {' '.join(args)}: {exc.format_message()}")


def cli_envvars(group: click.Group = main) -> set[str]:
    found = set()

    def visit(cmd: click.Command) -> None:
        for p in cmd.params:
            envvar = getattr(p, "envvar", None)
            if isinstance(envvar, str):
                found.add(envvar)
            elif envvar:
                found.update(envvar)
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                visit(sub)

    visit(group)
    return found


def test_rollout_environment_variables_are_read_by_the_cli(config):
    read = cli_envvars()
    assert {"ROLLOUT_REDIS_URL", "ROLLOUT_NAMESPACE", "ROLLOUT_ENGINE_URLS"} <= read
    set_anywhere = set()
    for name, svc in config["services"].items():
        for var in svc.get("environment") or {}:
            if var.startswith("ROLLOUT_"):
                set_anywhere.add(var)
                assert var in read, f"service {name} sets {var}, which no rollout option reads"
    assert {"ROLLOUT_REDIS_URL", "ROLLOUT_NAMESPACE", "ROLLOUT_ENGINE_URLS"} <= set_anywhere


def test_profiles_keep_gpu_engines_out_of_sim(config):
    services = config["services"]
    gpu = {n for n, s in services.items() if "gpu" in (s.get("profiles") or [])}
    sim = {n for n, s in services.items() if "sim" in (s.get("profiles") or [])}
    common = {n for n, s in services.items() if not s.get("profiles")}
    assert gpu == {"engine-0", "engine-1", "router"}
    assert sim == {"sim-0", "sim-1", "sim-router"}
    assert common == {"redis", "worker", "feeder", "trainer"}
    assert not gpu & sim
    for name in gpu:
        assert "sglang" in services[name]["image"]
    # Services that run under every profile must not depend on a profiled one.
    for name in common:
        assert set(services[name].get("depends_on") or {}) <= common, name
    # Both profiles offer the engines as `router`, which the workers use.
    assert services["worker"]["environment"]["ROLLOUT_ENGINE_URLS"] == "http://router:30000"
    assert "router" in services["sim-router"]["networks"]["default"]["aliases"]


def test_gpu_engines_and_router(config):
    services = config["services"]
    engines = [n for n in services if n.startswith("engine-")]
    for name in engines:
        svc = services[name]
        assert svc["image"].startswith("lmsysorg/sglang")
        assert svc["command"][:3] == ["python3", "-m", "sglang.launch_server"]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices and "gpu" in devices[0]["capabilities"] and devices[0]["driver"] == "nvidia"
        assert "healthcheck" in svc
    router = services["router"]["command"]
    assert router[:3] == ["python3", "-m", "sglang_router.launch_router"]
    urls = router[router.index("--worker-urls") + 1:]
    urls = urls[:next((i for i, a in enumerate(urls) if a.startswith("--")), len(urls))]
    assert sorted(urls) == sorted(f"http://{n}:30000" for n in engines)
    sim_router = services["sim-router"]["command"]
    assert "sglang_router.launch_router" in sim_router
    assert {"http://sim-0:30000", "http://sim-1:30000"} <= set(sim_router)


def test_router_arguments_parse(config):
    """The router's arguments, checked by sglang-router's own parser when it is installed."""
    try:
        from sglang_router.launch_router import parse_router_args
    except ImportError:
        pytest.fail("sglang-router is not installed: `pip install sglang-router` (in the [test] extra)")
    for name in ("router", "sim-router"):
        args = config["services"][name]["command"][3:]
        parsed = parse_router_args(args)
        assert parsed.port == 30000 and len(parsed.worker_urls) == 2


def test_redis_service(config):
    redis = config["services"]["redis"]
    cmd = redis["command"]
    assert cmd[0] == "redis-server" and cmd[cmd.index("--appendonly") + 1] == "yes"
    assert "redis-cli" in " ".join(redis["healthcheck"]["test"])
    for name in ("worker", "feeder", "trainer"):
        assert config["services"][name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert config["services"][name]["environment"]["ROLLOUT_REDIS_URL"] == "redis://redis:6379/0"


def test_workers_scale(raw, config):
    worker = raw["services"]["worker"]
    # `--scale worker=N` needs no fixed container name and no fixed host port.
    assert "container_name" not in worker and "ports" not in worker
    assert config["services"]["worker"]["command"][:1] == ["rollout"]
    feeder = config["services"]["feeder"]["command"]
    assert feeder[:2] == ["rollout", "push"] and "--max-queued" in feeder
    assert config["services"]["trainer"]["command"][:2] == ["rollout", "consume"]
    assert raw["services"]["feeder"]["command"][2].endswith("/app/workers/data/arithmetic.jsonl}")
    assert (REPO / "workers" / "data" / "arithmetic.jsonl").exists()


def test_dockerfile_and_dockerignore():
    dockerfile = (REPO / "Dockerfile").read_text()
    lines = [l.strip() for l in dockerfile.splitlines() if l.strip() and not l.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert "WORKDIR /app" in lines and any(l.startswith("COPY . ") for l in lines)
    assert any("pip install" in l and " ." in l for l in lines)
    assert "sglang-router" in (REPO / "pyproject.toml").read_text()  # the router extra the image installs
    ignored = {l.strip() for l in (REPO / ".dockerignore").read_text().splitlines()
               if l.strip() and not l.startswith("#")}
    assert {".git", "**/__pycache__", ".venv"} <= ignored
    # The image needs these; they must not be ignored.
    for needed in ("pyproject.toml", "cli.py", "pipeline", "workers"):
        assert needed not in ignored
