"""slime's own rollout path over a data source, as a stand-in that follows slime's control
flow step by step (THUDM/slime main 624b824; slime needs Ray, Megatron and GPUs):

- `generate_rollout` / `generate_rollout_async` / `GenerateState` / `generate_and_rm_group` /
  `generate_and_rm` / `abort`: slime/rollout/sglang_rollout.py (its default rollout);
- `async_rm` / `batched_async_rm`: slime/rollout/rm_hub/__init__.py;
- `apply_rollout_sample_hooks`: slime/rollout/sample_hooks.py;
- `call_dynamic_filter` / `MetricGatherer`: slime/rollout/filter_hub/base_types.py;
- `call_rollout_fn`: slime/rollout/base_types.py;
- `RolloutManager`: slime/ray/rollout.py (generate, eval, save, load, the reward
  post-processing and the checks of `_convert_samples_to_train_data`);
- `create_rollout_manager` / `create_training_models`' load: slime/ray/placement_group.py;
- `train_async`: train_async.py's loop; `slime_args`: slime/utils/arguments.py's defaults of
  every attribute this path reads, and parse_args' derived values.

The adapter's tests run slime's path through these over RedisDataSource, as slime does.
Where it differs, it is because the tests run without engines or Ray:
- Ray's remote calls are plain calls in train_async.py's order (`generate(r + 1)` is called
  before step r trains; its exception surfaces at the call, where slime's surfaces at ray.get);
- `asyncio.wait`'s done set is taken in submission order (slime takes it in the set's order:
  one of the orders slime can take);
- `generate` (slime's own SGLang call for a pending sample) is not implemented: over
  RedisDataSource every sample arrives finished, and a pending one reaching it fails the test;
- `abort` aborts the engines behind `--sglang-router-ip/port` as slime does when they are
  set (tests without engines leave them None); RolloutManager starts no engines and keeps
  each rollout's metrics and samples for the tests (`logged`, `train_data["samples"]`).
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import json
import statistics
import sys
import time
import urllib.request
import uuid
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

#: slime/utils/arguments.py defaults of the attributes slime's rollout path reads.
SLIME_DEFAULTS: dict[str, Any] = dict(
    rollout_function_path="slime.rollout.sglang_rollout.generate_rollout", eval_function_path=None,
    data_source_path="slime.rollout.data_source.RolloutDataSourceWithBuffer", rollout_global_dataset=True,
    rollout_batch_size=None, n_samples_per_prompt=1, over_sampling_batch_size=None,
    dynamic_sampling_filter_path=None, partial_rollout=False, mask_offpolicy_in_partial_rollout=False,
    custom_generate_function_path=None, rollout_sample_hook_path=[], buffer_filter_path=None,
    rollout_sample_filter_path=None, rollout_all_samples_process_path=None, rm_type=None, reward_key=None,
    eval_reward_key=None, group_rm=False, rm_url=None, custom_rm_path=None, custom_reward_post_process_path=None,
    custom_convert_samples_to_train_data_path=None, advantage_estimator="grpo", rewards_normalization=True,
    grpo_std_normalization=True, rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1,
    rollout_max_response_len=None, rollout_stop=None, rollout_stop_token_ids=None,
    rollout_skip_special_tokens=False, sglang_server_concurrency=512, sglang_router_ip=None,
    sglang_router_port=None, sglang_dp_size=None, hf_checkpoint=None, num_rollout=None, num_epoch=None,
    start_rollout_id=None, save=None, save_interval=None, async_save=False, eval_interval=None,
    update_weights_interval=1, release_train=False, use_critic=False, debug_train_only=False,
    debug_rollout_only=False, load_debug_rollout_data=None, ci_test=False, use_fault_tolerance=False,
    sglang_enable_deterministic_inference=False, rollout_seed=42, use_rollout_routing_replay=False,
)


def slime_args(**overrides: Any) -> SimpleNamespace:
    """slime's args: its defaults, the overrides, then what parse_args derives."""
    args = SimpleNamespace(**{**SLIME_DEFAULTS, **overrides})
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    assert args.over_sampling_batch_size >= args.rollout_batch_size
    return args


def load_function(path: str) -> Any:
    """slime/utils/misc.py"""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def _sample_type() -> type:
    return sys.modules["slime.utils.types"].Sample


_loop: asyncio.AbstractEventLoop | None = None


def run(coro: Any) -> Any:
    """slime/utils/async_utils.py: every rollout on one long-lived event loop."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop.run_until_complete(coro)


# -- slime/rollout/filter_hub/base_types.py, slime/rollout/base_types.py -----------------------


def call_dynamic_filter(fn: Any, *args: Any, **kwargs: Any) -> Any:
    filter_types = sys.modules["slime.rollout.filter_hub.base_types"]
    if fn is None:
        return filter_types.DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    if not isinstance(output, filter_types.DynamicFilterOutput):  # compatibility for legacy version
        output = filter_types.DynamicFilterOutput(keep=output)
    return output


class MetricGatherer:
    def __init__(self) -> None:
        self._dynamic_filter_drop_reason_count: dict[str, int] = defaultdict(lambda: 0)

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        if reason:
            self._dynamic_filter_drop_reason_count[reason] += 1

    def collect(self) -> dict[str, int]:
        return {f"rollout/dynamic_filter/drop_{r}": c for r, c in self._dynamic_filter_drop_reason_count.items()}


def call_rollout_fn(fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> Any:
    base = sys.modules["slime.rollout.base_types"]
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (base.RolloutFnTrainOutput, base.RolloutFnEvalOutput)):  # legacy
        output = base.RolloutFnEvalOutput(data=output) if evaluation else base.RolloutFnTrainOutput(samples=output)
    return output


# -- slime/rollout/rm_hub/__init__.py, slime/rollout/sample_hooks.py ----------------------------


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    if getattr(sample, "custom_rm_path", None):  # per-sample (eval dataset config) first
        return await load_function(sample.custom_rm_path)(args, sample, **kwargs)
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
    if rm_type == "math":
        return 1 if sample.response.strip() == str(sample.label).strip() else 0
    if rm_type:
        raise NotImplementedError(f"Rule-based RM for {rm_type} is not implemented.")
    raise NotImplementedError("Rule-based RM type is not specified.")


async def batched_async_rm(args: Any, samples: list, **kwargs: Any) -> list:
    if args.custom_rm_path is not None:  # the custom reward function in batch mode
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples))


async def apply_rollout_sample_hooks(args: Any, value: Any, **kwargs: Any) -> Any:
    paths = getattr(args, "rollout_sample_hook_path", None) or []
    if not paths:
        return value
    kwargs.setdefault("rollout_id", sys.modules["slime.rollout.sample_hooks"]._current_rollout_id)
    if isinstance(value, list):
        return [await apply_rollout_sample_hooks(args, item, **kwargs) for item in value]
    for path in paths:
        hook = load_function(path)
        accepted = {k: v for k, v in kwargs.items() if k in inspect.signature(hook).parameters}
        result = hook(args, value, **accepted)
        if inspect.isawaitable(result):
            result = await result
        if result is not None:
            value = result
    return value


# -- slime/rollout/sglang_rollout.py ---------------------------------------------------------------


class GenerateState:
    """The global state of the generation process (a singleton in slime)."""

    instance: GenerateState | None = None

    def __new__(cls, args: Any) -> GenerateState:
        if cls.instance is None:
            cls.instance = super().__new__(cls)
            cls.instance._init(args)
        return cls.instance

    def _init(self, args: Any) -> None:
        self.args = args
        self.tokenizer = sys.modules["slime.utils.processing_utils"].load_tokenizer(args.hf_checkpoint)
        # sglang_server_concurrency × engines (0 without slime-launched engines: a finished
        # sample never takes it)
        self.semaphore = asyncio.Semaphore(args.sglang_server_concurrency * 0)
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.order = itertools.count()  # (stand-in) the submission order, for a deterministic done order
        self.aborted = False

    def submit_generate_tasks(self, samples: list[list[Any]]) -> None:
        for group in samples:
            task = asyncio.ensure_future(generate_and_rm_group(self.args, group, sampling_params={},
                                                               evaluation=False))
            task.submitted = next(self.order)
            self.pendings.add(task)
        self.remaining_batch_size += len(samples)


async def generate(args: Any, sample: Any, sampling_params: dict) -> Any:
    raise AssertionError(f"slime's own generate was called for sample {sample.index} ({sample.status}): the data "
                         f"source handed slime's rollout a sample to generate")


async def generate_and_rm(args: Any, sample: Any, sampling_params: dict, evaluation: bool = False) -> Any:
    Sample = _sample_type()
    # mask previous off-policy generation for partial rollout
    if args.partial_rollout and args.mask_offpolicy_in_partial_rollout and sample.response_length > 0:
        sample.loss_mask = [0] * sample.response_length
    # For samples with existing response, check if they're complete
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        assert sample.response is not None
        if not args.group_rm:
            assert sample.reward is not None
        return sample
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        custom_func_path = getattr(sample, "generate_function_path", None) or args.custom_generate_function_path
        if custom_func_path is not None:
            custom_generate_func = load_function(custom_func_path)
            if "evaluation" in inspect.signature(custom_generate_func).parameters:
                sample = await custom_generate_func(args, sample, sampling_params, evaluation=evaluation)
            else:
                sample = await custom_generate_func(args, sample, sampling_params)
        else:
            sample = await generate(args, sample, sampling_params)
    sample = await apply_rollout_sample_hooks(args, sample, evaluation=evaluation)
    if args.group_rm:  # the rm that needs the whole group runs in generate_and_rm_group
        return sample
    if isinstance(sample, list):
        if any(s.status == Sample.Status.ABORTED for s in sample):
            return sample
        need = [s for s in sample if s.reward is None]
        for s, reward in zip(need, await batched_async_rm(args, need)):
            s.reward = reward
        return sample
    if sample.status == Sample.Status.ABORTED:
        return sample
    if sample.reward is None:
        sample.reward = await async_rm(args, sample)
    return sample


async def generate_and_rm_group(args: Any, group: list, sampling_params: dict, evaluation: bool = False) -> list:
    state = GenerateState(args)
    if state.aborted:
        return group
    for sample in group:
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())
    group = list(await asyncio.gather(*(generate_and_rm(args, s, dict(sampling_params), evaluation=evaluation)
                                        for s in group)))
    # for the rm that needs the whole group, the rm runs here
    if not state.aborted and args.group_rm:
        for sample, reward in zip(group, await batched_async_rm(args, group)):
            sample.reward = reward
    return group


def _http(url: str, payload: dict | None = None) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read() or b"null")


def num_requests_from_load(load: Any) -> int:
    """slime/backends/sglang_utils/server_control.py, for the /v1/loads answer."""
    if isinstance(load, list):
        return sum(num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (waiting if isinstance(waiting, int) else 0)


#: slime/backends/sglang_utils/server_control.py
ABORT_RETRY_INTERVAL_SECONDS = 3


def abort_server_until_idle(url: str) -> None:
    """slime/backends/sglang_utils/server_control.py: abort all, read the load, again until idle."""
    while True:
        _http(f"{url}/abort_request", {"abort_all": True})
        if num_requests_from_load(_http(f"{url}/v1/loads?include=core")) <= 0:
            return
        time.sleep(ABORT_RETRY_INTERVAL_SECONDS)


async def abort(args: Any, rollout_id: int) -> list[list[Any]]:
    aborted_samples = []
    state = GenerateState(args)
    assert not state.aborted
    state.aborted = True
    if args.sglang_router_ip is not None:  # (stand-in) tests without engines leave it None
        workers = _http(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/workers")["workers"]
        for url in [w["url"] for w in workers]:
            await asyncio.to_thread(abort_server_until_idle, url)
    while state.pendings:  # make sure all the pending tasks are finished
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        if not args.partial_rollout:
            continue
        for task in sorted(done, key=lambda t: t.submitted):  # collect the partial samples
            group = task.result()
            for sample in group:
                if sample.response and "start_rollout_id" not in sample.metadata:
                    sample.metadata["start_rollout_id"] = rollout_id
            aborted_samples.append(group)
    return aborted_samples


async def generate_rollout_async(args: Any, rollout_id: int, data_source: Any) -> tuple[Any, list]:
    assert args.rollout_global_dataset
    base = sys.modules["slime.rollout.base_types"]
    should_drop = sys.modules["slime.rollout.filter_hub.base_types"].should_drop_dynamic_filter_output
    state = GenerateState(args)
    dynamic_filter = (load_function(args.dynamic_sampling_filter_path)
                      if args.dynamic_sampling_filter_path is not None else None)
    metric_gatherer = MetricGatherer()
    target_data_size = args.rollout_batch_size
    data, all_data = [], []
    while len(data) < target_data_size:
        while state.remaining_batch_size < target_data_size:
            # get samples from the buffer and submit the generation requests
            state.submit_generate_tasks(data_source(args.over_sampling_batch_size))
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        for task in sorted(done, key=lambda t: t.submitted):
            group = task.result()
            assert len(group) == args.n_samples_per_prompt
            all_data.append(group)
            output = call_dynamic_filter(dynamic_filter, args, group)
            if should_drop(output, remaining_batch_size=state.remaining_batch_size,
                           target_data_size=target_data_size):
                metric_gatherer.on_dynamic_filter_drop(reason=output.reason)
                state.remaining_batch_size -= 1
                continue
            # NOTE (slime's): here we have not stored all the unused samples back to the data buffer.
            if len(data) < target_data_size:
                data.append(group)
    aborted_samples = await abort(args, rollout_id)  # there are still some unfinished requests
    assert len(data) == args.rollout_batch_size
    data = sorted(data, key=lambda group: group[0].index)
    all_samples = sorted(all_data, key=lambda group: group[0].index)
    state.reset()
    if args.rollout_sample_filter_path is not None:
        load_function(args.rollout_sample_filter_path)(args, data)
    if args.rollout_all_samples_process_path is not None:
        load_function(args.rollout_all_samples_process_path)(args, all_samples, data_source)
    return base.RolloutFnTrainOutput(samples=data, metrics=metric_gatherer.collect()), aborted_samples


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    assert args.rollout_global_dataset
    if evaluation:
        raise NotImplementedError("slime's own eval generates on its engines from its own datasets; the stand-in "
                                  "runs no engines")
    output, aborted_samples = run(generate_rollout_async(args, rollout_id, data_source.get_samples))
    if aborted_samples:
        data_source.add_samples(aborted_samples)
    return output


# -- slime/ray/rollout.py, slime/ray/placement_group.py, train_async.py -------------------------------


def validate_rollout_id_annotated(node: Any, depth: int = 0) -> None:
    """slime/observability/rollout_data_utils.py"""
    if isinstance(node, _sample_type()):
        return
    assert isinstance(node, list), f"unexpected rollout output node type: {type(node).__name__}"
    if node and isinstance(node[0], _sample_type()):
        if depth >= 2 and len(node) > 1:
            rids = [s.rollout_id for s in node]
            assert None not in rids and len(set(rids)) == 1, rids
        return
    for item in node:
        validate_rollout_id_annotated(item, depth + 1)


class RolloutManager:
    """slime/ray/rollout.py's RolloutManager (a Ray actor there), without engines."""

    def __init__(self, args: Any, pg: Any = None):
        self.args = args
        if not args.debug_train_only:
            sys.modules["slime.utils.http_utils"].init_http_client(args)
        self.data_source = load_function(args.data_source_path)(args)
        self.generate_rollout = load_function(args.rollout_function_path)
        self.eval_generate_rollout = load_function(args.eval_function_path)
        self.custom_reward_post_process_func = (load_function(args.custom_reward_post_process_path)
                                                if args.custom_reward_post_process_path is not None else None)
        self.rollout_id = -1
        self.logged: dict[int, dict | None] = {}  # (stand-in) what log_rollout_data logs, per rollout

    def get_num_rollout_per_epoch(self) -> int:
        assert self.args.rollout_global_dataset
        return len(self.data_source) // self.args.rollout_batch_size

    def generate(self, rollout_id: int) -> dict:
        self.rollout_id = rollout_id
        sys.modules["slime.rollout.sample_hooks"].set_current_rollout_id(rollout_id)
        data, metrics = self._get_rollout_data(rollout_id)
        self.logged[rollout_id] = metrics
        if self.args.debug_rollout_only:
            return None
        return self._convert_samples_to_train_data(data)

    def eval(self, rollout_id: int) -> Any:
        if self.args.debug_train_only:
            return None
        sys.modules["slime.rollout.sample_hooks"].set_current_rollout_id(rollout_id)
        return call_rollout_fn(self.eval_generate_rollout, self.args, rollout_id, self.data_source, evaluation=True)

    def save(self, rollout_id: int) -> None:
        self.data_source.save(rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        self.data_source.load(rollout_id)

    def _get_rollout_data(self, rollout_id: int) -> tuple[list, dict | None]:
        output = call_rollout_fn(self.generate_rollout, self.args, rollout_id, self.data_source, evaluation=False)
        data = output.samples
        validate_rollout_id_annotated(data)
        while isinstance(data[0], list):  # flatten the data if it is a list of lists
            data = list(itertools.chain.from_iterable(data))
        return data, output.metrics

    def _post_process_rewards(self, samples: list) -> tuple[list, list]:
        if self.custom_reward_post_process_func is not None:
            return self.custom_reward_post_process_func(self.args, samples)
        args = self.args
        raw_rewards = [s.get_reward_value(args) for s in samples]
        if args.advantage_estimator in ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline") \
                and args.rewards_normalization:
            n = args.n_samples_per_prompt if len(raw_rewards) == args.n_samples_per_prompt * args.rollout_batch_size \
                else len(raw_rewards)
            rewards = []
            for i in range(0, len(raw_rewards), n):  # group norm (torch's std is the unbiased one)
                group = [float(r) for r in raw_rewards[i:i + n]]
                mean = sum(group) / len(group)
                centered = [r - mean for r in group]
                if args.advantage_estimator in ("grpo", "gspo", "cispo") and args.grpo_std_normalization:
                    std = statistics.stdev(group) if len(group) > 1 else float("nan")
                    centered = [r / (std + 1e-6) for r in centered]
                rewards += centered
            return raw_rewards, rewards
        return raw_rewards, raw_rewards

    def _convert_samples_to_train_data(self, samples: list) -> dict:
        raw_rewards, rewards = self._post_process_rewards(samples)
        assert len(raw_rewards) == len(samples) and len(rewards) == len(samples)
        train_data = {
            "tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples],
            "rewards": rewards, "raw_reward": raw_rewards,
            "truncated": [1 if s.status == _sample_type().Status.TRUNCATED else 0 for s in samples],
            "sample_indices": [s.index for s in samples],
        }
        loss_masks = []
        for s in samples:
            if s.loss_mask is None:
                s.loss_mask = [1] * s.response_length
            assert len(s.loss_mask) == s.response_length, \
                f"loss mask length {len(s.loss_mask)} != response length {s.response_length}"
            if s.remove_sample:
                s.loss_mask = [0] * s.response_length
            loss_masks.append(s.loss_mask)
        train_data["loss_masks"] = loss_masks
        if samples[0].rollout_log_probs is not None:
            train_data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
        if getattr(self.args, "rollout_top_p", 1.0) != 1.0:
            for s in samples:
                assert s.rollout_top_p_token_ids is not None and s.rollout_top_p_token_offsets is not None
        train_data["samples"] = samples  # (stand-in) for the tests' ledgers
        return train_data


def create_rollout_manager(args: Any) -> tuple[RolloutManager, int | None]:
    manager = RolloutManager(args)
    num_rollout_per_epoch = None
    if args.num_rollout is None:  # calculate num_rollout from num_epoch
        num_rollout_per_epoch = manager.get_num_rollout_per_epoch()
        args.num_rollout = num_rollout_per_epoch * args.num_epoch
        assert args.num_rollout > 0
    return manager, num_rollout_per_epoch


def should_run_periodic_action(rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None = None,
                               num_rollout: int | None = None) -> bool:
    """slime/utils/misc.py"""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    step = rollout_id + 1
    return step % interval == 0 or (num_rollout_per_epoch is not None and step % num_rollout_per_epoch == 0)


def train_async(args: Any, *, train: Any, update_weights: Any, save_model: Any = None,
                start_rollout_id: int = 0) -> RolloutManager:
    """train_async.py's loop. `start_rollout_id` is what the checkpoint loaded says (the
    actor's create); `train(rollout_id, train_data)` is the step, `update_weights()` pushes the
    weights to the engines, `save_model(rollout_id)` saves the model's checkpoint."""
    manager, num_rollout_per_epoch = create_rollout_manager(args)
    if args.start_rollout_id is None:  # create_training_models
        args.start_rollout_id = start_rollout_id
    if args.rollout_global_dataset:
        manager.load(args.start_rollout_id - 1)
    update_weights()  # always push actor weights to rollout once weights are loaded
    next_data = manager.generate(args.start_rollout_id)
    current = None
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        if next_data is not None:  # sync the last generation
            current = next_data
        next_data = manager.generate(rollout_id + 1) if rollout_id + 1 < args.num_rollout else None
        train(rollout_id, current)
        if args.release_train or should_run_periodic_action(rollout_id, args.save_interval, num_rollout_per_epoch,
                                                            args.num_rollout):
            if save_model is not None:
                save_model(rollout_id)
            if args.rollout_global_dataset:
                manager.save(rollout_id)
        if args.release_train or (rollout_id + 1) % args.update_weights_interval == 0:
            # sync generate before update weights to prevent update weight in the middle of generation
            current = next_data if next_data is not None else None
            next_data = None
            update_weights()
        if should_run_periodic_action(rollout_id, args.eval_interval, num_rollout_per_epoch):
            manager.eval(rollout_id)
    return manager
