"""An SGLang-compatible HTTP server in front of any `engines.core.Engine`.

It answers like SGLang 0.5.15's native HTTP server (see shared/SGLANG_API.md):
`/generate` (single, batch, ``n > 1``, SSE streaming), `/abort_request`,
`/pause_generation` (modes abort / retract / in_place), `/continue_generation`, the
weight-update and weight-version endpoints, `/get_model_info`, `/get_server_info`,
`/health`, `/health_generate`, `/flush_cache`, `/v1/models` and `/v1/loads`.

This module owns the wire: request validation (via engines/generate_request.py),
answer shapes, streaming and the control routes. It asks its engine what a request
has produced so far (`Engine.output`) and changes engine state only through the
engine's methods. Backends: the simulator (engines/simulator.py, which adds its
`/sim/*` routes and fault injection by subclassing `EngineServer`) and the PyTorch
engine (engines/torch_engine.py).

Streams follow SGLang's `--stream-interval` (a chunk at the first token, then every that many
tokens; a request's `sampling_params.stream_interval` overrides it) and, with
`--incremental-streaming-output`, carry only their new tokens. Deliberate simplifications:
progress is looked at when its pace says the next chunk is due, so a chunk may carry more tokens
than the interval; unknown sampling parameters are a 400.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable

from aiohttp import web

from pipeline.types import PauseMode, choices

from .core import (CacheNotFlushed, Engine, EngineRequest, Outcome, Output, Restarted, State, WeightLoadError,
                   WeightSource)
from .generate_request import SchemaError, parse_generate

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.15.post1"  # the release whose HTTP answers this imitates
#: SGLang's HEALTH_CHECK_TIMEOUT: /health_generate answers 503 when its one token takes longer.
HEALTH_CHECK_TIMEOUT_S = 20.0
STREAM_INTERVAL_S = 0.02  # the shortest wait between looks at a stream's progress
STREAM_MAX_WAIT_S = 1.0  # the longest: a stream whose pace was misjudged is looked at again this soon


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _incremental(chunk: dict, sent: int, sent_text: int) -> int:
    """Cut a cumulative stream chunk down to what it adds after `sent` tokens and `sent_text`
    characters (SGLang's --incremental-streaming-output: ids, output log-probs and text);
    returns the characters of text sent after it. completion_tokens stays cumulative."""
    meta = chunk["meta_info"]
    chunk["output_ids"] = chunk["output_ids"][sent:]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = meta[key][sent:]
    if "output_token_logprobs_length" in meta:
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    text = chunk["text"]
    chunk["text"] = text[sent_text:]
    return len(text)


def json_reply(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type="application/json")


def error(message: str, status: int = 400) -> web.Response:
    """SGLang's `_create_error_response` body (validation errors from its own code)."""
    return json_reply({"error": {"message": message}}, status)


def error_response(message: str, status: int) -> web.Response:
    """FastAPI's ErrorResponse body, used by SGLang for HTTPException and for
    request-schema errors (its RequestValidationError handler)."""
    phrase = "Bad Request" if status == 400 else str(status)
    return json_reply({"object": "error", "message": message, "type": phrase, "param": None, "code": status}, status)


def drop(request: web.Request, resp: web.StreamResponse | None = None) -> web.StreamResponse:
    """Close the connection without (the rest of) an answer; the client sees a
    disconnect. The returned response never reaches it."""
    if request.transport is not None:
        request.transport.abort()
    return resp if resp is not None else web.Response(status=500)


async def read_body(request: web.Request, optional: bool = False) -> dict:
    raw = await request.read()
    if not raw.strip():
        if optional:
            return {}
        raise SchemaError("A JSON request body is required.")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise SchemaError("The request body must be a JSON object.")
    return body


class EngineServer:
    """Answers SGLang's HTTP API for one engine."""

    def __init__(self, engine: Engine, stream_interval_s: float = STREAM_INTERVAL_S) -> None:
        self.engine = engine
        self.config = engine.config
        if self.config.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1 token, got {self.config.stream_interval}")
        self.tokenizer = engine.tokenizer
        self.stream_interval_s = stream_interval_s
        self.health_check_timeout_s = HEALTH_CHECK_TIMEOUT_S

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name or self.engine.model_path

    # -- /generate -------------------------------------------------------------------

    async def before_submit(self, request: web.Request) -> web.StreamResponse | None:
        """A response to send instead of generating (the simulator's faults), or None."""
        return None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        created = engine.now()
        try:
            body = await read_body(request)
            parsed = parse_generate(body, self.tokenizer, self.config.context_length, engine.vocab_size)
            engine.check(parsed.specs)
        except SchemaError as exc:
            return error_response(str(exc), 400)
        except ValueError as exc:
            # SGLang validates inside the response generator, after a stream has started.
            if body.get("stream") is True:
                return await self._stream_error(request, str(exc))
            return error(str(exc))
        try:
            instead = await self.before_submit(request)
            if instead is not None:
                return instead
            await engine.wait_admission()
        except Restarted:
            return drop(request)
        try:
            reqs = engine.submit(parsed.specs, created, parallel=parsed.n > 1)
        except ValueError as exc:  # duplicate rid
            return await self._stream_error(request, str(exc)) if parsed.stream else error(str(exc))
        if parsed.stream:
            return await self._stream(request, reqs, batch=not parsed.single)
        try:
            if reqs:  # asyncio.wait, not gather: a cancelled handler must not cancel the futures
                await asyncio.wait([r.future for r in reqs])
        except asyncio.CancelledError:  # the client disconnected
            engine.cancel(reqs)
            raise
        if any(r.outcome == Outcome.DROPPED for r in reqs):
            return drop(request)
        failed = next((r.finish for r in reqs if (r.finish or {}).get("status_code")), None)
        if failed is not None:  # an engine error, not a user abort: SGLang answers with its status
            return error(failed["message"], failed["status_code"])
        outputs = [self._render(r, stream=False) for r in reqs]
        return json_reply(outputs[0] if parsed.single else outputs)

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        resp = await self._start_stream(request)
        await resp.write(b"data: " + _dumps({"error": {"message": message}}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    async def _start_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    async def _stream(self, request: web.Request, reqs: list[EngineRequest], batch: bool) -> web.StreamResponse:
        """SSE: a chunk whenever a request made its stream interval's tokens (looked at when
        its pace says they are due, at least stream_interval_s apart), its final chunk when it
        ends, then `data: [DONE]`."""
        try:
            return await self._stream_loop(request, reqs, batch)
        except asyncio.CancelledError:
            self.engine.cancel(reqs)
            raise
        except ConnectionError:  # the client went away mid-stream
            self.engine.cancel(reqs)
            return web.Response(status=499)  # never reaches the client

    async def _stream_loop(self, request: web.Request, reqs: list[EngineRequest], batch: bool) -> web.StreamResponse:
        resp = await self._start_stream(request)
        sent = [0] * len(reqs)  # tokens sent per request
        sent_text = [0] * len(reqs)  # characters of text sent (incremental chunks carry the rest)
        final = [False] * len(reqs)
        first: list[tuple[float, int] | None] = [None] * len(reqs)  # (time, tokens) when first seen producing
        while True:
            now = self.engine.now()
            due = STREAM_MAX_WAIT_S  # seconds until some request's next chunk is due, at its pace so far
            for i, req in enumerate(reqs):
                if final[i]:
                    continue
                if req.outcome == Outcome.DROPPED:
                    return drop(request, resp)
                final[i] = req.outcome is not None
                if not final[i]:
                    # SGLang's stream interval: the first token at once, then every `interval` tokens.
                    produced = self.engine.produced(req)
                    if produced and first[i] is None:
                        first[i] = (now, produced)
                    interval = req.spec.stream_interval or self.config.stream_interval
                    missing = interval - (produced - sent[i]) if sent[i] else 1 - produced
                    if missing <= 0:
                        missing = interval  # for the chunk after the one sent now
                    # Its decoding pace since it was first seen producing (none yet: look again soon).
                    pace = (produced - first[i][1]) / (now - first[i][0]) if first[i] and now > first[i][0] else 0
                    due = min(due, missing / pace if pace else self.stream_interval_s)
                    if produced <= sent[i] or (sent[i] and produced - sent[i] < interval):
                        continue
                await self._send_chunk(resp, req, i if batch else None, sent, sent_text)
            if all(final):
                break
            pending = [r.future for r, done in zip(reqs, final) if not done]
            # Looked at again when a chunk is due (a request ending wakes it at once): thousands of
            # slow streams must not each wake every stream_interval_s.
            await asyncio.wait(pending, timeout=max(self.stream_interval_s, due), return_when=asyncio.FIRST_COMPLETED)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _send_chunk(self, resp: web.StreamResponse, req: EngineRequest, index: int | None, sent: list[int],
                          sent_text: list[int]) -> None:
        i = index or 0
        incremental = self.config.incremental_streaming_output
        chunk = self._render(req, stream=not incremental)  # cut below from the whole answer so far
        if incremental:
            sent_text[i] = _incremental(chunk, sent[i], sent_text[i])
        sent[i] = chunk["meta_info"]["completion_tokens"]
        if index is not None:
            chunk["index"] = index
        await resp.write(b"data: " + _dumps(chunk).encode() + b"\n\n")

    def _render(self, req: EngineRequest, stream: bool) -> dict:
        """The JSON SGLang returns for one request (cumulative, in 0.5.15's key order)."""
        spec = req.spec
        final = req.outcome is not None
        out = self.engine.output(req)
        count = len(out.tokens)
        version = req.weight_version if final else self.engine.weight_version
        ids = out.tokens
        finish = req.finish if final else None

        text_ids = ids
        if finish and finish.get("type") == "stop" and not spec.no_stop_trim and isinstance(finish["matched"], int):
            text_ids = ids[:-1]  # the detokenizer trims a matched stop token from the text
        text = self.tokenizer.decode(text_ids, skip_special_tokens=spec.skip_special_tokens)
        if finish and finish.get("type") == "stop" and not spec.no_stop_trim and isinstance(finish["matched"], str):
            pos = text.find(finish["matched"])
            text = text[:pos] if pos != -1 else text

        if req.in_queue_abort:
            # TokenizerManager._handle_abort_req: a smaller meta_info, built there.
            meta: dict[str, Any] = {"id": spec.rid, "finish_reason": finish, "weight_version": version,
                                    "e2e_latency": req.finished_at - req.created}
            if spec.return_logprob:
                self._add_logprobs(meta, req, out)
            meta["completion_tokens"] = count
            output_ids = ids[-1:] if stream else list(ids)
            return {"text": text, "output_ids": output_ids, "meta_info": meta}

        meta = {"id": spec.rid, "finish_reason": finish, "prompt_tokens": len(spec.input_ids),
                "weight_version": version, "num_retractions": req.retractions}
        if spec.return_logprob:
            self._add_logprobs(meta, req, out)
        meta["reasoning_tokens"] = 0  # no reasoning parser: SGLang counts none
        meta["completion_tokens"] = count
        meta["cached_tokens"] = req.cached_tokens
        if final:
            meta["e2e_latency"] = req.finished_at - req.created
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    def _token_text(self, token: int, wanted: bool) -> str | None:
        return self.tokenizer.decode([token], skip_special_tokens=False) if wanted else None

    def _add_logprobs(self, meta: dict, req: EngineRequest, out: Output) -> None:
        """`[logprob, token_id, text_or_null]` entries, as SGLang's convert_logprob_style."""
        spec = req.spec
        with_text = spec.return_text_in_logprobs
        start = spec.logprob_start_len
        # -1 (the default) means output logprobs only.
        positions = range(min(start, len(spec.input_ids)), len(spec.input_ids)) if start >= 0 else range(0)
        input_lp = [[lp, spec.input_ids[pos], self._token_text(spec.input_ids[pos], with_text)]
                    for pos, lp in zip(positions, out.input_logprobs)]
        meta["input_token_logprobs"] = input_lp
        if with_text:
            meta["output_token_logprobs"] = [[lp, t, self._token_text(t, True)]
                                             for lp, t in zip(out.logprobs, out.tokens)]
        else:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs, out.tokens)]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if spec.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [None if e[0] is None else [[e[0], e[1], e[2]]] for e in input_lp]
            meta["output_top_logprobs"] = [[[lp, t, self._token_text(t, with_text)] for lp, t in entries]
                                           for entries in out.top_logprobs]

    # -- control endpoints -----------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request)
        except SchemaError as exc:
            return error_response(str(exc), 400)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return error_response("rid must be a string and abort_all a boolean", 400)
        count = self.engine.abort_request(rid=rid, abort_all=abort_all)
        logger.debug("abort_request rid=%r abort_all=%s: %d aborted", rid, abort_all, count)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request, optional=True)
        except SchemaError as exc:
            return error_response(str(exc), 400)
        mode = body.get("mode") or "abort"
        if mode not in choices(PauseMode):
            return error_response(f"mode must be one of {', '.join(map(repr, choices(PauseMode)))}, got {mode!r}", 400)
        self.engine.pause(mode)
        return json_reply({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return json_reply({"message": "Generation continued successfully.", "status": "ok"})

    async def _weights_update(self, request: web.Request, source: WeightSource) -> web.Response:
        """The update_weights_* family: success, then the optional weight_version applies."""
        try:
            body = await read_body(request)
        except SchemaError as exc:
            return error_response(str(exc), 400)
        model_path = body.get("model_path")
        if source == WeightSource.DISK and not isinstance(model_path, str):
            return error_response("model_path (a string) is required", 400)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            return error_response("weight_version must be a string", 400)
        try:
            await self.engine.update_weights(
                source, model_path if source == WeightSource.DISK else None, version,
                abort_all=body.get("abort_all_requests", False) is True,
                flush=body.get("flush_cache", True) is not False)
        except Restarted:
            return drop(request)
        except WeightLoadError as exc:
            logger.error("weight update (%s) from %r failed: %s", source.value, model_path, exc)
            message = str(exc) if isinstance(exc, CacheNotFlushed) else f"Failed to update weights: {exc}"
            failed: dict[str, Any] = {"success": False, "message": message}
            if source == WeightSource.DISK:
                failed["num_paused_requests"] = 0
            return json_reply(failed, 400)
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        out: dict[str, Any] = {"success": True, "message": message}
        if source == WeightSource.DISK:
            # SGLang's scheduler answers 0 whatever sat paused (0.5.15.post1, 0.5.20 and 0.5.23).
            out["num_paused_requests"] = 0
        return json_reply(out)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        return await self._weights_update(request, WeightSource.DISK)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        return await self._weights_update(request, WeightSource.TENSOR)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return await self._weights_update(request, WeightSource.DISTRIBUTED)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        return json_reply({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request)
        except SchemaError as exc:
            return error_response(str(exc), 400)
        version = body.get("new_version")
        if not isinstance(version, str):
            return error_response("new_version (a string) is required", 400)
        self.engine.set_weight_version(version, abort_all=body.get("abort_all_requests", True) is not False)
        return json_reply({"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    # -- information endpoints -------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)  # 503 comes from the availability middleware

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's /health_generate: a greedy one-token request from input id 0; 200 as soon
        as the engine produces anything (its own running requests count), 503 if nothing
        within HEALTH_CHECK_TIMEOUT_S (a paused engine holds the request at its gate)."""
        engine = self.engine
        if any(r.state == State.RUNNING for r in engine.running.values()):
            return web.Response(status=200)
        body = {"input_ids": [0], "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}",
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        specs = parse_generate(body, self.tokenizer, self.config.context_length, engine.vocab_size).specs
        reqs: list[EngineRequest] = []

        async def one_token() -> None:
            await engine.wait_admission()
            reqs.extend(engine.submit(specs, engine.now()))
            await asyncio.wait([r.future for r in reqs])

        try:
            await asyncio.wait_for(one_token(), self.health_check_timeout_s)
        except (asyncio.TimeoutError, Restarted):
            engine.cancel(reqs)
            logger.error("health check failed: no token within %gs", self.health_check_timeout_s)
            return web.Response(status=503)
        ok = all(r.outcome == Outcome.FINISHED for r in reqs)
        return web.Response(status=200 if ok else 503)

    async def get_model_info(self, request: web.Request) -> web.Response:
        facts = self.engine.describe()
        return json_reply({
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": facts["model_type"],
            "architectures": facts["architectures"],
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        cfg = self.config
        load = self.engine.load()
        facts = self.engine.describe()
        return json_reply({
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.tokenizer_path,
            "served_model_name": self.served_model_name,
            "context_length": cfg.context_length,
            "max_running_requests": cfg.max_running_requests,
            "max_total_num_tokens": cfg.max_total_num_tokens,
            "skip_tokenizer_init": False,
            "dp_size": 1,
            "tp_size": 1,
            "random_seed": cfg.seed,
            "weight_version": self.engine.weight_version,
            "internal_states": [{"num_running_reqs": load["num_running_reqs"],
                                 "num_waiting_reqs": load["num_waiting_reqs"],
                                 "paused": self.engine.paused}],
            "version": SGLANG_VERSION,
            **{k: v for k, v in facts.items() if k not in ("model_type", "architectures")},
        })

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.engine.flush_cache()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                 "waiting requests, the operation will not be performed.)\n",
            status=200 if ok else 400)

    async def v1_models(self, request: web.Request) -> web.Response:
        name = self.served_model_name
        return json_reply({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": self.config.context_length}]})

    async def v1_loads(self, request: web.Request) -> web.Response:
        dp_rank = request.query.get("dp_rank")
        loads = [] if dp_rank not in (None, "0") else [self.engine.load()]
        for load in loads:
            load["num_total_reqs"] = load["num_running_reqs"] + load["num_waiting_reqs"]
        n = len(loads) or 1
        aggregate = {
            "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
            "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
            "total_reqs": sum(d["num_total_reqs"] for d in loads),
            "total_used_tokens": sum(d["num_used_tokens"] for d in loads),
            "total_tokens": sum(d["num_total_tokens"] for d in loads),
            "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
            "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2),
            "avg_utilization": round(sum(d["utilization"] for d in loads) / n, 4),
        }
        return json_reply({"timestamp": datetime.now(timezone.utc).isoformat(), "version": SGLANG_VERSION,
                      "dp_rank_count": len(loads), "loads": loads, "aggregate": aggregate})

    # -- wiring ----------------------------------------------------------------------

    @web.middleware
    async def _availability(self, request: web.Request, handler) -> web.StreamResponse:
        """While starting or restarting every SGLang endpoint answers 503."""
        if not request.path.startswith("/sim/") and self.engine.unavailable():
            if request.path in ("/health", "/health_generate"):
                return web.Response(status=503)
            return error_response("The server is not ready (starting or restarting).", 503)
        return await handler(request)

    async def _on_startup(self, app: web.Application) -> None:
        await self.engine.start()

    async def _on_shutdown(self, app: web.Application) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Drop everything in flight so handlers end before the server closes."""
        self.engine.close()

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Backend-specific routes (the simulator's /sim/*)."""

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[self._availability])
        app[SERVER_KEY] = self
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.get_model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.get_server_info)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_get("/v1/models", self.v1_models)
        r.add_get("/v1/loads", self.v1_loads)
        self.add_routes(r)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app


SERVER_KEY = web.AppKey("sglang_engine_server", EngineServer)

ServerFactory = Callable[[], EngineServer]


async def _start(make_server: ServerFactory, host: str, port: int) -> tuple[web.AppRunner, int, EngineServer]:
    app = make_server().build_app()
    # handler_cancellation: a client that disconnects cancels its handler, which
    # aborts its requests (SGLang aborts on disconnect too) instead of leaking slots.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    actual_port = runner.addresses[0][1]
    return runner, actual_port, app[SERVER_KEY]


async def serve(make_server: ServerFactory, host: str = "127.0.0.1", port: int = 30000) -> None:
    """Run a server until cancelled."""
    runner, actual_port, server = await _start(make_server, host, port)
    logger.info("SGLang-compatible %s listening on http://%s:%d (seed=%d)", type(server.engine).__name__,
                host, actual_port, server.config.seed)
    try:
        await asyncio.Event().wait()
    finally:
        server.shutdown()
        await runner.cleanup()


class ServerHandle:
    """A server running in a background thread with its own event loop."""

    def __init__(self, server: EngineServer, runner: web.AppRunner, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread, host: str, port: int) -> None:
        self.server = server
        self.config = server.config
        self.host = host
        self.port = port
        self._runner = runner
        self._loop = loop
        self._thread = thread
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def call(self, fn, *args) -> Any:
        """Run `fn(*args)` on the server's loop (engine state is not thread-safe)."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True

        async def cleanup():
            self.server.shutdown()
            await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(timeout=timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self.server.engine).__name__}({self.url})"


def start_in_thread(make_server: ServerFactory, host: str = "127.0.0.1", port: int = 0,
                    name: str = "sglang-engine") -> ServerHandle:
    """Start a server in a daemon thread; port 0 picks a free port (see `.url`)."""
    ready = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            result["started"] = loop.run_until_complete(_start(make_server, host, port))
        except BaseException as exc:  # report startup failures to the caller
            result["error"] = exc
            ready.set()
            loop.close()
            return
        result["loop"] = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    if not ready.wait(timeout=60):
        raise RuntimeError(f"the {name} server did not start within 60 s")
    if "error" in result:
        raise RuntimeError(f"the {name} server failed to start: {result['error']}") from result["error"]
    runner, actual_port, server = result["started"]
    return ServerHandle(server, runner, result["loop"], thread, host, actual_port)
