"""What an engine call can raise, and which errors are retriable (what callers branch on):

* ``EngineUnavailable``: connection refused/reset/dropped, timeouts, HTTP 5xx,
  408 and 429. Retriable: the same request may succeed later or elsewhere.
* ``EngineRequestError``: any other 4xx. The request itself is bad; retrying it
  unchanged is pointless (poison input → dead letters).
* ``EngineProtocolError`` (an ``EngineUnavailable``): a 200 answer that breaks
  the protocol: not JSON, no ``meta_info``, an unknown finish reason, token ids
  outside the vocabulary or int32, log-probs that are not finite floats or not one
  per token, ``completion_tokens`` disagreeing with the tokens, ``output_ids``
  disagreeing with the ids in ``output_token_logprobs``, more tokens than
  ``max_new_tokens`` asked for, a body larger than ``answer_limit`` after
  decompression, a redirect (never followed). Retriable like
  ``EngineUnavailable`` (the same request may reach a healthy engine), but it is a
  protocol error, never a sample; ``head`` holds the answer's first bytes
  (workers/engine_answers.py checks answers).
* ``EngineStreamCut`` (an ``EngineUnavailable``): a streamed answer ended before its
  final chunk (connection reset, the engine killed, ``[DONE]`` too early). Retriable.
* ``EngineError``: the base class. Raised while a streamed answer was being read, every
  one of them carries in ``partial`` what the stream delivered before (a
  ``workers.engine_stream.StreamProgress``: every token received and checked); None
  for a request that was not streamed.
* ``EngineControlError``: an ``EngineSet`` control call failed on some engines;
  lists each failing engine URL with its error.
"""
from __future__ import annotations

from typing import Any


class EngineError(Exception):
    """Base class for everything this module raises about an engine."""

    def __init__(self, message: str, url: str | None = None, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status
        self.partial: Any = None  # a streamed answer's StreamProgress before the error (workers/engine_stream.py)


class EngineUnavailable(EngineError):
    """The engine could not answer (network, timeout, 5xx). Retriable."""


def nothing_there(exc: EngineUnavailable) -> str | None:
    """Why a connection was never made, when the address itself may be wrong: nothing
    listens there (refused) or its host name does not resolve; None for a server that
    is there but cannot answer yet (a timeout or a 503 while a model loads)."""
    import socket

    reason = getattr(exc.__cause__, "os_error", None)  # aiohttp's ClientConnectorError
    if isinstance(reason, ConnectionRefusedError):
        return "nothing listens there (connection refused)"
    if isinstance(reason, socket.gaierror):
        return "its host name does not resolve"
    return None


class EngineStreamCut(EngineUnavailable):
    """A streamed answer ended before its final chunk. Retriable; `partial` holds what came."""


class EngineRequestError(EngineError):
    """The engine rejected the request (4xx). Not retriable as is."""


class EngineProtocolError(EngineUnavailable):
    """A 200 answer that is not a valid SGLang answer. Retriable; never a sample.
    `head` is the answer's first characters (engine_answers.HEAD_CHARS), for the dead letter."""

    def __init__(self, message: str, url: str | None = None, head: str = ""):
        super().__init__(f"{message}; the answer began {head!r}" if head else message, url=url)
        self.head = head


class EngineControlError(EngineError):
    """A fanned-out control call failed on at least one engine.

    ``errors`` maps each failing engine URL to its exception, ``results`` holds
    the answers of the engines that succeeded (so the caller can see exactly
    which engines already paused / loaded the new weights).
    """

    def __init__(self, operation: str, errors: dict[str, BaseException], results: dict[str, Any]):
        total = len(errors) + len(results)
        details = "; ".join(f"engine {url} failed: {err}" for url, err in errors.items())
        super().__init__(
            f"{operation} failed on {len(errors)} of {total} engine(s): {details}",
            url=next(iter(errors), None),
        )
        self.operation = operation
        self.errors = errors
        self.results = results
