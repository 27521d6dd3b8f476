"""Test helpers: a real Worker in a thread, the real sglang-router as a subprocess,
small HTTP and consumer shortcuts, a replica catching up and a switchable TCP forwarder."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import pytest
import redis

from pipeline.connection import connect
from pipeline.consumer import Consumer
from pipeline.redis_server import free_port, wait_replicated  # noqa: F401 - wait_replicated re-exported
from pipeline.types import Group
from local import router
from local.router import router_engine_urls  # noqa: F401 - re-exported for the tests
from workers.worker import Worker, WorkerSettings

ROUTER_STARTUP_TIMEOUT_S = router.STARTUP_TIMEOUT_S


class WorkerThread:
    """A real worker (real HTTP to the engines, real Redis) in a background thread."""

    def __init__(self, settings: WorkerSettings, reward=None):
        self.settings = settings
        self.worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(reward,), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("worker thread did not start")
        deadline = time.monotonic() + 30  # until it registered (or failed trying)
        while not (self.error or self.worker.ready.is_set()) and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.error:
            raise self.error

    def _run(self, reward) -> None:
        async def main():
            self.worker = Worker(self.settings, reward=reward)
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            await self.worker.run()

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by stop()
            self.error = exc
            self._ready.set()

    def stop(self, timeout: float = 30) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.worker.stop)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "worker did not stop"
        if self.error:
            raise self.error


def one_error_line(result) -> str:
    """The one line a failed CLI command (click runner result) printed, checked to be
    a one-line error without a traceback."""
    assert result.exit_code != 0, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


def wait_for(predicate, timeout: float = 30, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class LoseReplies:
    """Wraps a Redis script: while `armed`, it runs and then its reply is lost (what a
    reset connection or a socket timeout does); the caller sees a ConnectionError."""

    def __init__(self, script, armed: int = 0):
        self.script, self.armed = script, armed

    def __call__(self, *args, **kwargs):
        result = self.script(*args, **kwargs)
        if self.armed:
            self.armed -= 1
            raise redis.ConnectionError("reply lost (test)")
        return result

    def queue(self, pipe, keys=(), args=()) -> None:
        """A call queued on a pipeline (Queue.publish_many): while armed, the whole
        pipeline runs and then its reply is lost."""
        self.script.queue(pipe, keys, args)
        if self.armed:
            self.armed -= 1
            execute = pipe.execute

            def run_then_lose(*a, **kw):
                execute(*a, **kw)
                raise redis.ConnectionError("reply lost (test)")

            pipe.execute = run_then_lose

    def __getattr__(self, name):  # load() and the rest: the script's own
        return getattr(self.script, name)


def holds_for(predicate, seconds: float, what: str) -> None:
    """Assert that `predicate` stays true for a whole window, checked throughout (for
    "nothing happens" claims; a wait for something to happen is wait_for)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), what
        time.sleep(0.01)


def http_json(url: str, body: Any = None, timeout: float = 5.0, method: str | None = None) -> Any:
    """GET (or POST when there is a body; or `method`) and the JSON answer (None if empty)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def http_call(url: str, path: str, body: dict | None = None, method: str | None = None,
              timeout: float = 10.0, raw: bytes | None = None) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON or text), error statuses included.
    Connection errors raise."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, payload = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read().decode()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload


def consume_all(consumer: Consumer, total: int, batch: int, timeout: float = 60) -> list[Group]:
    """Take and commit batches until `total` groups were trained on."""
    got: list[Group] = []
    while len(got) < total:
        b = consumer.next_batch(min(batch, total - len(got)), timeout=timeout)
        got += b.groups
        consumer.commit(b)
    return got


class RouterProcess(router.RouterProcess):
    """local.router.RouterProcess, its failures as test failures (a missing router is a
    broken test environment, not a skip)."""

    def __init__(self, worker_urls: list[str], log_path: str, extra_args: list[str] = ()):
        try:
            super().__init__(worker_urls, log_path, extra_args)
        except router.RouterError as exc:
            pytest.fail(str(exc))

    def wait_ready(self, expected: list[str], timeout: float = ROUTER_STARTUP_TIMEOUT_S) -> None:
        try:
            super().wait_ready(expected, timeout)
        except router.RouterError as exc:
            pytest.fail(str(exc))


class FakeModelEngine:
    """An HTTP server answering like SGLang serving a real model (not the simulator):
    /get_model_info names `tokenizer_path`; /generate records each request and answers
    `reply_ids` with log-probs, finished by a stop. For the workers' tokenizer choice."""

    def __init__(self, tokenizer_path: str, model_path: str = "Qwen/Qwen2.5-0.5B-Instruct",
                 reply_ids: tuple[int, ...] = (1, 2)):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        engine = self
        self.requests: list[dict] = []
        self.model_info = {"model_path": model_path, "tokenizer_path": tokenizer_path, "is_generation": True,
                           "preferred_sampling_params": None, "weight_version": "default",
                           "has_image_understanding": False, "has_audio_understanding": False,
                           "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def answer(self, status: int, body: Any = None) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path in ("/get_model_info", "/model_info"):
                    self.answer(200, engine.model_info)
                elif self.path == "/health":
                    self.answer(200)
                else:
                    self.answer(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                if self.path != "/generate":
                    self.answer(404, {"error": {"message": f"no route {self.path}"}})
                    return
                engine.requests.append(body)
                self.answer(200, {"text": "\\boxed{2}", "output_ids": list(reply_ids), "meta_info": {
                    "id": body.get("rid") or "r", "finish_reason": {"type": "stop", "matched": reply_ids[-1]},
                    "prompt_tokens": len(body.get("input_ids") or []), "completion_tokens": len(reply_ids),
                    "cached_tokens": 0, "weight_version": "default", "e2e_latency": 0.001,
                    "output_token_logprobs": [[-0.5, t, None] for t in reply_ids]}})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def primary_and_replica(redis_factory, binary: str | None = None):
    """A primary and a replica in sync: (primary server, replica server)."""
    kwargs = {"aof": False} | ({"binary": binary} if binary else {})
    primary, replica = redis_factory("primary", **kwargs), redis_factory("replica", **kwargs)
    connect(replica.url).replicaof("127.0.0.1", primary.port)
    wait_replicated(connect(primary.url), connect(replica.url, read_only=True))
    return primary, replica


def pause_replication(replica) -> None:
    """`replica` stops applying its primary's writes (the primary's WAIT sees it lag) until
    resume_replication; promoted meanwhile, it drops what it had not applied."""
    connect(replica.url, read_only=True).execute_command("CLIENT", "PAUSE", 60_000, "WRITE")


def resume_replication(replica) -> None:
    connect(replica.url, read_only=True).execute_command("CLIENT", "UNPAUSE")


class Forwarder:
    """A TCP forwarder on a fixed port to a switchable upstream port: clients keep one
    address while the server behind it changes (a failover behind a VIP or DNS name).
    `switch(port)` cuts every open connection; new ones go to the new upstream;
    `switch(None)` refuses them (the server is down)."""

    def __init__(self, upstream: int | None):
        self.upstream = upstream
        self.port = free_port()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                if self.upstream is None:
                    raise OSError("down")
                upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def switch(self, upstream: int | None) -> None:
        self.upstream = upstream
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def outage(server, back_when: Callable[[], bool], timeout: float = 60) -> threading.Thread:
    """kill -9 `server` now and start it again (same port, same data) once `back_when()`
    holds: an outage that lasts until the clients under test have lived it."""
    server.kill()

    def again():
        wait_for(back_when, timeout=timeout, interval=0.02, what="the outage's end condition")
        server.start()

    thread = threading.Thread(target=again, daemon=True)
    thread.start()
    return thread


class GenerateServer:
    """An SGLang-like `/generate` on a free port, served from a thread of its own; a
    subclass answers in `async def generate(request)`."""

    def __init__(self):
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app, access_log=None)
        self.url = ""
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    async def generate(self, request):
        raise NotImplementedError

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; Redis refuses ports > 55535."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")
