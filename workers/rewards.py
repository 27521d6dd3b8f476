"""Reward loading, validation and the built-in reward functions.

slime's reward plug point (`--custom-rm-path`) takes either

* a per-sample function ``async def rm(args, sample) -> float | dict``, or
* with ``--group-rm``, a per-group function ``async def rm(args, samples) -> list[float]``.

Plain (sync) functions are accepted as well and run in a thread so a slow judge
does not block the worker's event loop.

`load_reward(path, group)` resolves a built-in name or a dotted path to such a
function; `Reward` wraps it behind one method, `score(args, samples)`, that always
takes a whole group and returns one validated value per sample.

Validation rules (the worker publishes whatever `score` returns, so it must be
trustworthy; see DESIGN.md invariant 9, "fail loudly"):

* A reward is a real number (int/float, including numpy scalars) or a dict
  (slime's ``--reward-key`` picks the value used for training). Numbers are
  returned as ``float``.
* ``bool`` is rejected: ``True``/``False`` usually means a judge's pass/fail flag
  was returned by mistake, and a bool travelling on the wire as ``true`` breaks
  consumers that expect a number. Return ``float(ok)`` instead.
* NaN and +/-inf are rejected (they poison the advantage computation).
* A dict has string keys. With ``args.reward_key`` (``--reward-key``) it must hold that
  key, whose value is the trained scalar: a finite real number (returned as ``float``;
  numpy scalars included, numpy bools refused as not numbers). Its other values are
  kept as the function returned them when they are JSON (slime stores the dict as it is:
  retool's ``{"score": -1.0, "acc": False, "pred": "5"}``); anything else is an error
  naming the key. Without a reward_key nothing names the trained value, so every value
  must be a finite number.
* A group function must return exactly ``len(samples)`` values.
* Any exception raised by a reward function propagates as `RewardError` carrying
  the original message. It is never turned into a 0 reward: the worker retries the
  group and eventually dead-letters it. `MissingLabel` (a sample without the label
  the reward needs) is not retried: the group is dead-lettered on its first attempt.

Built-ins (usable as ``path``): ``exact_match``, ``math_boxed``, ``remote_rm``, and of
slime's ``--rm-type`` names ``f1`` and ``boxed_f1`` (SQuAD-style token F1, written here).
slime's other rm types (``math``, ``dapo``, ``deepscaler``, ``gpqa``, ``ifbench``) are not
reimplemented: with slime installed on the worker, ``--reward
slime.rollout.rm_hub.async_rm --rm-type math`` runs slime's own. A reward given as a dotted
path gets slime's `Sample` when slime is installed (`uses_slime_samples`), and `args`
carries slime's names of the worker's settings (`rm_type`, `rollout_temperature`, ...).
"""
from __future__ import annotations

import asyncio
import copy
import inspect
import itertools
import logging
import math
import numbers
import re
import string
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

import aiohttp

from pipeline.trainers.slime_types import slime_types, to_slime_sample
from pipeline.types import Sample, json_problem

from .user_code import load_function

logger = logging.getLogger(__name__)

RewardValue = float | dict
#: Synchronous reward calls running at once, unless the worker says (--reward-threads).
DEFAULT_REWARD_THREADS = 16
# A reward function as slime defines it: per-sample (args, sample) or per-group
# (args, samples); sync or async.
RewardFn = Callable[..., Any]

__all__ = [
    "BUILTIN_REWARDS",
    "MissingLabel",
    "Reward",
    "RewardError",
    "RewardFn",
    "RewardValue",
    "boxed_f1",
    "exact_match",
    "extract_boxed",
    "f1",
    "f1_score",
    "load_reward",
    "math_boxed",
    "math_equal",
    "normalize_answer",
    "remote_rm",
    "validate_reward",
]


class RewardError(RuntimeError):
    """A reward could not be computed (the function raised, timed out, or returned
    something that is not a valid reward). The group must not be published; the
    worker retries it, up to its attempt limit."""


class MissingLabel(RewardError):
    """A sample has no label and the reward needs one. The row is wrong, not the
    moment: the worker dead-letters the group at once, without retries. A custom
    reward may raise it too."""


# --------------------------------------------------------------------------- built-ins


async def exact_match(args: Any, sample: Sample) -> float:
    """1.0 when the stripped response equals the stripped label, else 0.0."""
    if sample.label is None:
        raise MissingLabel("exact_match needs a label, but sample.label is None")
    return 1.0 if sample.response.strip() == str(sample.label).strip() else 0.0


#: What extract_boxed looks at: a box opening, or any other brace.
_BOX_OR_BRACE = re.compile(r"\\boxed\{|[{}]")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in `text`, braces balanced.

    Returns None when there is no complete boxed answer (none at all, or the last
    one is unterminated; an unterminated box falls back to the previous one).
    One pass with a stack of open braces: linear in the text, however many boxes a
    degenerate answer opens (re-scanning from each one was quadratic).
    """
    open_braces: list[int] = []  # per open brace: where a box's content starts, or -1
    last_start, last_end = -1, -1
    for m in _BOX_OR_BRACE.finditer(text):
        brace = m.group()
        if brace == "}":
            if open_braces:
                start = open_braces.pop()
                if start > last_start:  # the complete box that starts last wins
                    last_start, last_end = start, m.start()
        else:
            open_braces.append(m.end() if brace != "{" else -1)
    return text[last_start:last_end] if last_start >= 0 else None


_WS = re.compile(r"\s+")
_DECIMAL = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")
_FRACTION = re.compile(r"^([+-]?\d+)/([+-]?\d+)$")
# \frac{a}{b}, \dfrac{a}{b}, \tfrac{a}{b} with integer or decimal a, b (after the
# whitespace removal of normalize_answer); an optional sign in front.
_LATEX_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def normalize_answer(answer: str) -> str:
    """Canonical string form of a final answer: no whitespace, no ``$``, no
    trailing ``.``; a label written as ``\\boxed{...}`` is unboxed."""
    boxed = extract_boxed(answer)
    if boxed is not None:
        answer = boxed
    answer = _WS.sub("", answer).replace("$", "")
    return answer.rstrip(".")


def _parse_number(text: str) -> Fraction | None:
    """Parse an int, a decimal, ``a/b`` or ``\\frac{a}{b}`` exactly; None otherwise."""
    if _DECIMAL.match(text):
        return Fraction(text)
    m = _FRACTION.match(text)
    if m:
        num, den = int(m.group(1)), int(m.group(2))
        return Fraction(num, den) if den != 0 else None
    m = _LATEX_FRAC.match(text)
    if m:
        sign, num_s, den_s = m.groups()
        num, den = _parse_number(num_s), _parse_number(den_s)
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if sign == "-" else value
    return None


def math_equal(answer: str, label: str) -> bool:
    """Compare two final answers after `normalize_answer`.

    Numbers (ints, decimals, ``a/b``, ``\\frac{a}{b}``) compare exactly as
    rationals, so ``\\frac{3}{4}`` == ``0.75`` == ``3/4`` but ``0.333`` != ``1/3``.
    Everything else compares as normalized strings (no symbolic algebra).
    """
    a, b = normalize_answer(answer), normalize_answer(label)
    try:
        num_a, num_b = _parse_number(a), _parse_number(b)
    except ValueError:  # past Python's int digit limit (sys.get_int_max_str_digits): a legitimate answer
        if _DECIMAL.match(a) and _DECIMAL.match(b):
            return Decimal(a) == Decimal(b)  # exact, whatever the number of digits
        return a == b
    if num_a is not None and num_b is not None:
        return num_a == num_b
    return a == b


def math_boxed(args: Any, sample: Sample) -> float:
    """1.0 when the last ``\\boxed{...}`` of the response matches the label.

    No boxed answer in the response gives 0.0 (a formatting failure of the model,
    a legitimate reward); a missing label is a data error and raises. A plain
    function: it runs on the reward threads, never on the worker's event loop (a
    32k-token answer takes milliseconds, but the loop renews the worker's lease).
    """
    if sample.label is None:
        raise MissingLabel("math_boxed needs a label, but sample.label is None")
    answer = extract_boxed(sample.response)
    if answer is None:
        return 0.0
    return 1.0 if math_equal(answer, str(sample.label)) else 0.0


DEFAULT_RM_TIMEOUT = 60.0


async def remote_rm(args: Any, sample: Sample) -> float:
    """POST ``{"prompt", "response", "label"}`` to ``args.rm_url`` (slime's remote_rm).

    The answer must be a JSON number or ``{"reward": number}``. HTTP errors,
    timeouts (``args.rm_timeout`` seconds, default 60) and malformed answers raise
    `RewardError`.
    """
    url = getattr(args, "rm_url", None)
    if not url:
        raise RewardError("remote_rm needs args.rm_url, but it is not set")
    timeout = float(getattr(args, "rm_timeout", None) or DEFAULT_RM_TIMEOUT)
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    try:
        # One session per call, like slime: sessions are bound to an event loop, and
        # the rq offload runs each job in a fresh loop.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.post(url, json=payload) as resp:
                if resp.status >= 400:
                    body = (await resp.text())[:200]
                    raise RewardError(f"remote_rm {url} answered HTTP {resp.status}: {body}")
                answer = await resp.json(content_type=None)
    except asyncio.TimeoutError as exc:
        raise RewardError(f"remote_rm {url} timed out after {timeout:g}s") from exc
    except aiohttp.ClientError as exc:
        raise RewardError(f"remote_rm {url} request failed: {type(exc).__name__}: {exc}") from exc
    except ValueError as exc:  # body is not JSON
        raise RewardError(f"remote_rm {url} answered with invalid JSON: {exc}") from exc
    if isinstance(answer, dict):
        if "reward" not in answer:
            raise RewardError(f"remote_rm {url} answered a dict without 'reward': {answer!r:.200}")
        answer = answer["reward"]
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        raise RewardError(f"remote_rm {url} answered a non-number: {answer!r:.200}")
    return float(answer)


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _f1_tokens(text: str) -> list[str]:
    """SQuAD's answer normalization: lower case, no punctuation, no articles."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def f1_score(prediction: str, truth: str) -> float:
    """Token-overlap F1 of two answers (0.0 when they share no token)."""
    pred, gold = _f1_tokens(prediction), _f1_tokens(truth)
    same = sum((Counter(pred) & Counter(gold)).values())
    if not same:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


async def f1(args: Any, sample: Sample) -> float:
    """slime's `--rm-type f1`: token F1 of the response against the label."""
    if sample.label is None:
        raise RewardError("f1 needs a label, but sample.label is None")
    return f1_score(sample.response, str(sample.label))


async def boxed_f1(args: Any, sample: Sample) -> float:
    """slime's `--rm-type boxed_f1`: token F1 of the last \\boxed{} answer (none: 0)."""
    if sample.label is None:
        raise RewardError("boxed_f1 needs a label, but sample.label is None")
    return f1_score(extract_boxed(sample.response) or "", str(sample.label))


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math_boxed": math_boxed,
    "remote_rm": remote_rm,
    "f1": f1,
    "boxed_f1": boxed_f1,
}


# --------------------------------------------------------------------------- loading


def _per_sample_as_group(fn: RewardFn) -> RewardFn:
    """slime with --group-rm and a built-in reward scores the samples one by one."""

    async def group_rm(args: Any, samples: Sequence[Sample]) -> list[Any]:
        if _is_async(fn):
            return list(await asyncio.gather(*(fn(args, s) for s in samples)))
        return await asyncio.to_thread(lambda: [fn(args, s) for s in samples])  # off the event loop

    group_rm.__name__ = group_rm.__qualname__ = getattr(fn, "__name__", "reward")
    return group_rm


def load_reward(path: str, group: bool = False) -> RewardFn:
    """Resolve `path` to a reward function.

    `path` is a built-in name (see `BUILTIN_REWARDS`) or a dotted path
    ``package.module.func`` / ``package.module:func``. `group` says which slime
    signature the function has (``--group-rm``); it cannot be inferred from the
    function. A built-in with ``group=True`` is adapted to score sample by sample.

    Raises ValueError naming `path` when the module or attribute does not exist or
    is not callable.
    """
    if path in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[path]
        return _per_sample_as_group(fn) if group else fn

    if ":" not in path and "." not in path:
        raise ValueError(
            f"reward path {path!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "nor a dotted path like 'package.module.func' or 'package.module:func'"
        )
    return load_function(path, "reward")


# --------------------------------------------------------------------------- validation


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _finite_number(value: Any, name: str, where: str) -> float:
    """`value` as a float, or RewardError saying `where` (" under key 'k'" or "") it was."""
    if isinstance(value, bool):
        raise RewardError(f"reward {name!r} returned a bool{where} ({value}); return float(...) instead")
    if not _is_real(value):
        raise RewardError(f"reward {name!r} returned {type(value).__name__} {value!r:.100}{where}; "
                          "expected a number")
    number = float(value)
    if not math.isfinite(number):
        raise RewardError(f"reward {name!r} returned {number}{where}, which is not a finite number")
    return number


def validate_reward(value: Any, reward_key: str | None = None, *, name: str = "reward") -> RewardValue:
    """`value` as a valid reward, or RewardError: a finite number (as float), or a dict with
    string keys. The dict's trained value, under `reward_key`, must be a finite number; its
    other values may be any JSON (slime keeps what its rm returns, e.g. math_dapo's
    {"score": 1.0, "acc": True, "pred": "5"}, and trains on reward[reward_key]). Without a
    reward_key nothing says which value is trained: every value must then be a number."""
    if isinstance(value, dict):
        bad_keys = [k for k in value if not isinstance(k, str)]
        if bad_keys:
            raise RewardError(f"reward {name!r} returned a dict with non-string keys {bad_keys!r:.200}")
        if not reward_key:
            try:
                return {k: _finite_number(v, name, f" under key {k!r}") for k, v in value.items()}
            except RewardError as exc:
                raise RewardError(f"{exc} (no --reward-key names the value to train on, so every value must be one; "
                                  f"with --reward-key the others may be any JSON)") from None
        if reward_key not in value:
            raise RewardError(
                f"reward {name!r} returned a dict without reward_key {reward_key!r}: keys {sorted(value)!r:.200}"
            )
        return {k: _finite_number(v, name, f" under reward_key {k!r}") if k == reward_key else _json_value(v, name, k)
                for k, v in value.items()}
    if _is_real(value) or isinstance(value, bool):
        return _finite_number(value, name, "")
    raise RewardError(
        f"reward {name!r} returned {type(value).__name__} {value!r:.200}; expected a number or a dict"
    )


def _json_value(value: Any, name: str, key: str) -> Any:
    """A dict reward's other value as it is when it is JSON (numpy scalars as Python
    numbers), else RewardError naming the key."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
    problem = json_problem(value, f"the value under key {key!r}")
    if problem:
        raise RewardError(f"reward {name!r} returned a dict in which {problem}; a reward's values travel as JSON")
    return value


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _describe(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}.{name}" if module and module != __name__ else name


# --------------------------------------------------------------------------- wrapper


class RewardsHung(RuntimeError):
    """So many reward calls are stuck past their timeout that the reward function, not a
    group, is at fault: the worker stops (a restart frees their threads)."""


class RewardThreads:
    """Where synchronous rewards run: each call on a daemon thread of its own, at most
    `size` at a time. A call its caller stops waiting for (the reward timeout) gives its
    place back at once and its thread is abandoned: Python cannot kill a thread, but a
    reward stuck forever then costs one idle thread, not one of `size` places, so hung
    rewards never starve the groups after them. `abandoned` counts the threads
    abandoned while still running; each is logged. Once `max_hung` (2 x size) of them are
    still running, a new call raises RewardsHung instead of leaking one more thread."""

    def __init__(self, size: int, name: str = "reward"):
        if size < 1:
            raise ValueError(f"reward threads must be at least 1, got {size}")
        self.size = size
        self.name = name
        self.abandoned = 0
        self.max_hung = 2 * size
        self._abandoned_threads: list[threading.Thread] = []
        self._places = asyncio.Semaphore(size)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop _places belongs to
        self._serial = itertools.count()

    @property
    def hung(self) -> int:
        """Abandoned calls still running."""
        self._abandoned_threads = [t for t in self._abandoned_threads if t.is_alive()]
        return len(self._abandoned_threads)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.hung >= self.max_hung:
            raise RewardsHung(f"{self.hung} calls of the reward {getattr(fn, '__name__', fn)} are still running "
                              f"after their timeout (--reward-timeout); the reward function hangs")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a semaphore serves one loop (rq jobs each run in a new one)
            self._places, self._loop = asyncio.Semaphore(self.size), loop
        async with self._places:
            done: asyncio.Future = loop.create_future()

            def settle(result: Any, exc: BaseException | None) -> None:
                if done.cancelled():
                    return
                if exc is not None:
                    done.set_exception(exc)
                else:
                    done.set_result(result)

            def call() -> None:
                try:
                    result, exc = fn(*args), None
                except BaseException as error:  # SystemExit too: it must reach the caller, not end a thread
                    result, exc = None, error
                try:
                    loop.call_soon_threadsafe(settle, result, exc)
                except RuntimeError:  # the loop closed while the reward ran
                    pass

            thread = threading.Thread(target=call, name=f"{self.name}-{next(self._serial)}", daemon=True)
            thread.start()
            try:
                return await done
            except asyncio.CancelledError:
                if thread.is_alive():
                    self.abandoned += 1
                    self._abandoned_threads.append(thread)
                    logger.warning("a synchronous reward call (%s) is still running after its caller gave up; "
                                   "its thread is abandoned (%d so far)", getattr(fn, "__name__", fn),
                                   self.abandoned)
                raise


class Reward:
    """One reward function behind one interface: `score(args, samples)`.

    ``Reward(fn, group=False)`` wraps a per-sample function (samples of a group are
    scored concurrently); ``group=True`` wraps a per-group function.

    A reward is user code, contained: it scores copies of the samples (whatever it
    changes in them never reaches the trainer), anything it raises, BaseException
    included (SystemExit, KeyboardInterrupt), is a RewardError, and a synchronous one
    runs on `threads` (RewardThreads), where a hung call is abandoned.
    """

    def __init__(self, fn: RewardFn, group: bool = False, name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"reward function must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.group = group
        self.name = name or _describe(fn)
        # A reward written for slime calls slime's Sample methods: hand it slime's samples.
        self.slime_samples = False
        # Where sync functions run; the worker sizes it (--reward-threads).
        self.threads = RewardThreads(DEFAULT_REWARD_THREADS)

    @classmethod
    def from_path(cls, path: str, group: bool = False) -> Reward:
        reward = cls(load_reward(path, group=group), group=group, name=path)
        reward.slime_samples = path not in BUILTIN_REWARDS and slime_types().real
        return reward

    def __repr__(self) -> str:
        return f"Reward({self.name!r}, group={self.group})"

    async def _call(self, args: Any, arg: Any) -> Any:
        try:
            if _is_async(self.fn):
                result = await self.fn(args, arg)
            else:
                # sync judges may block (HTTP, subprocess, heavy parsing): keep the loop free
                result = await self.threads.run(self.fn, args, arg)
            if inspect.isawaitable(result):  # e.g. a sync wrapper returning a coroutine
                result = await result
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as exc:
            # Caught here, inside the reward's own coroutine: past this point asyncio would
            # re-raise a SystemExit or KeyboardInterrupt out of the event loop, ending the worker.
            raise RewardError(f"raised {type(exc).__name__}({exc}), which a reward must not") from exc
        return result

    def _error(self, exc: BaseException, where: str) -> RewardError:
        if isinstance(exc, RewardError):
            detail = str(exc)
        else:
            detail = f"{type(exc).__name__}: {exc}"
        kind = MissingLabel if isinstance(exc, MissingLabel) else RewardError  # not retriable stays so
        return kind(f"reward {self.name!r} failed on {where}: {detail}")

    async def score(self, args: Any, samples: Sequence[Sample]) -> list[RewardValue]:
        """One validated reward per sample, in order. Raises RewardError."""
        # Copies: a reward that edits its samples (tokens, log-probs, loss mask) must not
        # change what is trained; no schema check could tell such an edit from generation.
        samples = [copy.deepcopy(s) for s in samples]
        if not samples:
            return []
        reward_key = getattr(args, "reward_key", None)
        if self.slime_samples:
            samples = [to_slime_sample(s) for s in samples]
        if self.group:
            try:
                values = await self._call(args, samples)
            except RewardsHung:
                raise
            except Exception as exc:
                raise self._error(exc, f"group of {len(samples)} samples") from exc
            if not isinstance(values, (list, tuple)) or len(values) != len(samples):
                got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"{type(values).__name__} {values!r:.100}"
                raise RewardError(
                    f"group reward {self.name!r} must return a list of {len(samples)} values, got {got}"
                )
        else:
            # return_exceptions: let every sample finish (sync ones run in threads and
            # cannot be cancelled anyway), then report the first failure.
            results = await asyncio.gather(*(self._call(args, s) for s in samples), return_exceptions=True)
            for sample, result in zip(samples, results):
                if isinstance(result, BaseException):
                    if not isinstance(result, Exception) or isinstance(result, RewardsHung):
                        raise result  # CancelledError (_call turned the rest into RewardError), or the worker's halt
                    where = f"sample group_index={sample.group_index} index={sample.index}"
                    raise self._error(result, where) from result
            values = results
        return [validate_reward(v, reward_key, name=self.name) for v in values]
