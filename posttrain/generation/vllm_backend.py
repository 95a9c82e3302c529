"""vLLM generation for the online trainers, in two modes behind the `GenerationBackend` interface.

- server: a vLLM server started with `posttrain vllm-serve` (same or another machine); the trainer talks to
  it over HTTP (`VLLMClient`) and needs no vLLM itself. Weights are synced by writing safetensors into a
  directory both sides can read and asking the server to reload them; or, for a GPU trainer and a server
  started with `--weight-transfer nccl`, over NCCL through vLLM's weight-transfer engine (vllm_nccl_sync.py).
- colocate: `vllm.LLM` inside the training process (needs vLLM in the trainer's environment), with its
  KV cache capped so that training keeps its memory; weights are handed over in process.

Either way the weights sent are the policy's current ones under the base model's parameter names (a PEFT
adapter is merged for the sync and unmerged after, leaving the trainer's weights bit-identical), every
`vllm_sync_steps` optimizer steps. vLLM returns its log-prob of every sampled token; the engine compares
them with its own (`sampler_mismatch_metrics`) and can correct for the difference with truncated
importance sampling.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from posttrain.errors import ConfigError
from posttrain.generation.base import Completion, GenerationBackend, SamplingParams, completion_seeds
from posttrain.generation.sampler_logps import sampler_logps_tensor, sampler_mismatch_metrics
from posttrain.generation.vllm_client import (
    WORKER_EXTENSION,
    VLLMClient,
    VLLMServerError,
    VLLMServerUnreachable,
    completion_from_output,
)
from posttrain.generation.vllm_memory import CPU_KV_CACHE_GB, colocate_memory
from posttrain.generation.vllm_nccl_sync import NCCLWeightSync, await_version, check_nccl_trainer, from_main_process
from posttrain.generation.vllm_nccl_sync import is_main_process as _is_main_process
from posttrain.generation.vllm_weights import full_tensor, is_sharded, policy_module, policy_weights, save_weights
from posttrain.models.reference import is_peft_model

logger = logging.getLogger(__name__)

VLLM_MODES = ("server", "colocate")


# -- the backends ------------------------------------------------------------------------------------------------
class _SyncSchedule:
    """Which calls of `sync_weights` push weights: the first one (the engine may hold other weights: a
    checkpoint resumed after start-up, a server started from another one), then every `sync_steps` optimizer
    steps. The engine calls `sync_weights` once per generation round, every `steps_per_round` optimizer steps."""

    def __init__(self, sync_steps: int, steps_per_round: int) -> None:
        if sync_steps < 1:
            raise ConfigError(f"vllm_sync_steps={sync_steps} must be at least 1 (1: sync before every generation).")
        self.sync_steps, self.steps_per_round = sync_steps, steps_per_round
        self.step = 0  # the optimizer step at which the current round started (counted from the rounds seen)
        self._rounds = 0
        self.last_sync: int | None = None

    def due(self) -> bool:
        """Called once per round, before its generation: whether to sync now."""
        self.step = self._rounds * self.steps_per_round
        self._rounds += 1
        if self.last_sync is None or self.step - self.last_sync >= self.sync_steps:
            self.last_sync = self.step
            return True
        return False


def _wait_for_main_process() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


class VLLMServerBackend(GenerationBackend):
    """Generates with a running vLLM server; syncs weights through a directory the server can read, or over NCCL
    when the server was started with `--weight-transfer nccl` and `trainer_device` is a GPU (`self.nccl`, with
    `group_port` its group's port; a CPU trainer is refused then: vllm_nccl_sync.py).

    `sync_dir` must be visible to the server under the same path (the default, a temporary directory, is
    right when both run on one machine). In a multi-process run every process sends its own prompts; only the
    main process writes and pushes the weights (once per round) while the others wait, and all of them use its
    directory, so that any of them can make a restarted server reload the weights pushed last.

    A server that goes away (connection refused or reset) is waited for, at most `reconnect_timeout_s`
    (default: the client's connect_timeout_s, which is vllm_server_timeout); once it answers it is checked
    again, reloads the weights pushed last (a restarted server holds its start-up weights), and the
    interrupted request is sent again. Every push carries a version that the server remembers, so a server
    restarted between two requests is noticed as well. `reconnects` counts both kinds of event.
    """

    def __init__(
        self,
        client: VLLMClient,
        stop_token_ids: Sequence[int],
        sync_steps: int = 1,
        steps_per_round: int = 1,
        sync_dir: str | os.PathLike | None = None,
        vocab_size: int | None = None,
        reconnect_timeout_s: float | None = None,
        trainer_device: torch.device | None = None,
        group_port: int = 51216,
    ) -> None:
        self.client = client
        self.stop_token_ids = list(stop_token_ids)
        self.schedule = _SyncSchedule(sync_steps, steps_per_round)
        self._default_dir = None
        if not sync_dir and _is_main_process():
            self._default_dir = tempfile.TemporaryDirectory(prefix="posttrain-vllm-weights-")
            sync_dir = self._default_dir.name
        sync_dir, self._run_id = from_main_process(str(sync_dir), uuid.uuid4().hex[:12])
        self.sync_dir = Path(sync_dir)
        self.reconnect_timeout_s = client.connect_timeout_s if reconnect_timeout_s is None else reconnect_timeout_s
        self.pushes = 0  # weight pushes so far, counted alike on every process (the version of the last one)
        self.reconnects = 0
        self._unreported = 0  # reconnects not yet handed to the trainer's logs (pop_metrics)
        self._stale = False  # the server does not hold the weights pushed last: reload them before the next request
        info = client.wait_until_ready()
        self.max_model_len = int(info["max_model_len"])
        self.dtype = getattr(torch, info["dtype"], None)
        served_vocab = info.get("vocab_size")
        if vocab_size is not None and served_vocab is not None and served_vocab != vocab_size:
            raise ConfigError(
                f"The vLLM server at {client.base_url} serves {info['model']!r} with a vocabulary of "
                f"{served_vocab} tokens, but the trained model has {vocab_size}: it serves another "
                "model. Start the server with the model you train."
            )
        self._served = (info["model"], served_vocab)
        self.rounds = 0
        self.nccl = None  # the NCCL sync, when the server offers it and the trainer is on a GPU (else files)
        if trainer_device is not None and check_nccl_trainer(info, torch.device(trainer_device), client.base_url):
            self.nccl = NCCLWeightSync(client, group_port, self.dtype, client.timeout_s)

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[Completion]:
        _check_lengths(prompt_ids, sampling, self.max_model_len, f"the vLLM server at {self.client.base_url}")
        self.rounds += 1
        context = f"generation round {self.rounds}, at optimizer step {self.schedule.step}"
        seeds = completion_seeds(seed, len(prompt_ids), 1)
        return self._call(
            lambda: self.client.generate(prompt_ids, n, sampling, seeds, self.stop_token_ids, context=context), context
        )

    def sync_weights(self, model, force: bool = False) -> None:
        if not force and not self.schedule.due():
            return
        self.pushes += 1
        context = "weight sync for evaluation" if force else f"weight sync at optimizer step {self.schedule.step}"
        if self.nccl is not None:  # every rank: FSDP2 shards are gathered everywhere, then rank 0 sends
            self.nccl.push(model, self._version, context, self._wait_for_server)
            self._stale = False
            return
        if _is_main_process() or is_sharded(model):  # FSDP2: every rank gathers, in the same order
            with policy_weights(model) as weights:
                whole = [(name, full_tensor(tensor)) for name, tensor in weights]
                if _is_main_process():
                    save_weights(whole, self.sync_dir, self.dtype)
        if _is_main_process():
            self._stale = True
            self._call(None, context)
        _wait_for_main_process()

    def pop_metrics(self) -> dict[str, float]:
        """For the trainer's logs: `vllm/reconnects`, the server losses recovered from since the last call."""
        count, self._unreported = self._unreported, 0
        return {"vllm/reconnects": float(count)}

    # -- a server that goes away ---------------------------------------------------------------------------------
    @property
    def _version(self) -> str:
        return f"{self._run_id}-{self.pushes}"

    def _call(self, operation, context: str):
        """`operation()` (if any) once the server holds the weights pushed last, waiting for a server that went
        away and retrying."""
        while True:
            try:
                if self.pushes and not self._stale and self._held_version(context) != self._version:
                    self._count_reconnect()
                    logger.warning(
                        "The vLLM server at %s no longer holds the weights pushed last (%s): it was "
                        "restarted. Pushing them again (reconnect %d of this run).",
                        self.client.base_url,
                        context,
                        self.reconnects,
                    )
                    self._stale = True
                if self._stale:
                    self._restore(context)
                    self._stale = False
                return None if operation is None else operation()
            except VLLMServerUnreachable as error:
                self._wait_for_server(error)

    def _held_version(self, context: str) -> str | None:
        if self.nccl is not None:  # vLLM's own version, set by finish_weight_update
            return self.client.engine_weight_version(context)
        return self.client.weights_version(context)["version"]

    def _restore(self, context: str) -> None:
        """Makes the server hold the weights pushed last again (it was restarted, or a reload is pending)."""
        if self.nccl is None:
            self.client.reload_weights(str(self.sync_dir), context, version=self._version)
        elif _is_main_process():  # over a new group, from rank 0's host copy
            self.nccl.restore(self._version, context)
        else:  # only rank 0 is in the group: wait for it to push them
            await_version(self.client, self._version, self.reconnect_timeout_s, context)

    def _wait_for_server(self, error: VLLMServerUnreachable) -> None:
        """Waits for the server to answer again and checks it (model, posttrain's worker extension); raises the
        original error, saying so, if it does not come back in time."""
        url, timeout = self.client.base_url, self.reconnect_timeout_s
        logger.warning(
            "%s Waiting up to %g s (vllm_server_timeout) for it to come back; restart it on the same "
            "host and port to continue the run.",
            error,
            timeout,
        )
        started = time.monotonic()
        try:
            info = self.client.wait_until_ready(timeout)
        except VLLMServerError as failure:
            if time.monotonic() - started < timeout:  # it answered, but not as a posttrain server of this model
                raise
            raise VLLMServerError(
                f"{error} It did not come back within {timeout:g} s (vllm_server_timeout)."
            ) from failure
        if (info["model"], info.get("vocab_size")) != self._served:
            raise VLLMServerError(
                f"The vLLM server at {url} came back serving {info['model']!r} (vocabulary "
                f"{info.get('vocab_size')}) instead of {self._served[0]!r} (vocabulary "
                f"{self._served[1]}). Restart it with the model you train."
            )
        self._count_reconnect()
        if self.nccl is not None:
            self.nccl.reset()  # a restarted server's workers are in no group: open a new one
        self._stale = self.pushes > 0  # a restarted server holds its start-up weights
        logger.warning(
            "Reconnected to the vLLM server at %s after %.0f s (reconnect %d of this run)%s.",
            url,
            time.monotonic() - started,
            self.reconnects,
            "; pushing the weights of the last sync again" if self._stale else "",
        )

    def _count_reconnect(self) -> None:
        self.reconnects += 1
        self._unreported += 1


class VLLMColocateBackend(GenerationBackend):
    """Generates with a `vllm.LLM` in this process, built from the policy's weights at start-up.

    vLLM runs without its engine subprocess (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that weights can be
    handed over as tensors, eagerly (no compilation: start-up in seconds, and no slower for small models).
    The KV cache is capped at `kv_cache_gb`; when it is None (on a GPU only), `gpu_memory_utilization` sizes
    vLLM's memory (see `colocate_memory`).
    """

    def __init__(
        self,
        model,
        tokenizer,
        stop_token_ids: Sequence[int],
        max_model_len: int,
        sync_steps: int = 1,
        steps_per_round: int = 1,
        kv_cache_gb: float | None = CPU_KV_CACHE_GB,
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        model_impl: str = "vllm",
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            from vllm import LLM
        except ImportError as err:
            raise ConfigError(
                f"vllm_mode='colocate' runs vLLM inside the trainer, but vLLM cannot be imported here "
                f"({err}). Run the trainer in the vLLM environment (scripts/setup_vllm.sh makes "
                "`.venv-vllm`), or use vllm_mode='server'."
            ) from None
        self.stop_token_ids = list(stop_token_ids)
        self.schedule = _SyncSchedule(sync_steps, steps_per_round)
        self.max_model_len = max_model_len
        self.enable_sleep_mode = enable_sleep_mode
        self._directory = tempfile.TemporaryDirectory(prefix="posttrain-vllm-model-")
        dtype = _save_checkpoint(model, tokenizer, self._directory.name)
        memory = (  # resolved by colocate_memory: the one setting the run asked for
            {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
            if kv_cache_gb is not None
            else {"gpu_memory_utilization": gpu_memory_utilization}
        )
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker makes it a no-op in its process (ours)
        self.llm = LLM(
            model=self._directory.name,
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=True,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            enable_sleep_mode=enable_sleep_mode,
            seed=seed,
            model_impl=model_impl,
            **memory,
        )
        torch.set_num_threads = set_num_threads
        if enable_sleep_mode:
            self.llm.sleep(level=1)

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        _check_lengths(prompt_ids, sampling, self.max_model_len, "the colocated vLLM engine")
        seeds = completion_seeds(seed, len(prompt_ids), 1) or [None] * len(prompt_ids)
        structured = {}
        if sampling.regex is not None:
            from vllm.sampling_params import StructuredOutputsParams

            structured["structured_outputs"] = StructuredOutputsParams(regex=sampling.regex)
        params = [
            VLLMSamplingParams(
                **sampling.extra,
                **structured,
                n=n,
                seed=s,
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                repetition_penalty=sampling.repetition_penalty,
                stop_token_ids=self.stop_token_ids,
                logprobs=0,
                detokenize=False,
            )
            for s in seeds
        ]
        with self._awake():
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids], params, use_tqdm=False
            )
        return [
            completion_from_output(i, sample.token_ids, _sampled_logprobs(sample), self.stop_token_ids)
            for i, output in enumerate(outputs)
            for sample in output.outputs
        ]

    def sync_weights(self, model, force: bool = False) -> None:
        if not force and not self.schedule.due():
            return
        with self._awake(), policy_weights(model) as weights:
            self.llm.collective_rpc("posttrain_reload_from_tensors", args=(weights,))
        self.llm.reset_prefix_cache()

    @contextmanager
    def _awake(self):
        """With sleep mode (GPU), vLLM's weights and KV cache leave the GPU between generation rounds."""
        if self.enable_sleep_mode:
            self.llm.wake_up()
        try:
            yield
        finally:
            if self.enable_sleep_mode:
                self.llm.sleep(level=1)


def _sampled_logprobs(sample) -> list[float] | None:
    """vLLM's log-prob of each sampled token (with logprobs=0 each position holds just that token)."""
    if sample.logprobs is None:
        return None
    return [position[token].logprob for token, position in zip(sample.token_ids, sample.logprobs)]


def _save_checkpoint(model, tokenizer, directory: str) -> str:
    """Saves config, tokenizer and the policy's weights where vLLM can load them; returns the dtype name."""
    base = policy_module(model)
    base = base.get_base_model() if is_peft_model(base) else base
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    dtype = next(base.parameters()).dtype
    with policy_weights(model) as weights:
        save_weights(weights, directory)
    return str(dtype).removeprefix("torch.")


def _check_lengths(
    prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, max_model_len: int, engine: str
) -> None:
    longest = max((len(ids) for ids in prompt_ids), default=0)
    if longest + sampling.max_tokens > max_model_len:
        raise ConfigError(
            f"A prompt of {longest} tokens plus max_completion_length={sampling.max_tokens} exceeds the "
            f"{max_model_len}-token context of {engine}. Lower max_prompt_length or "
            "max_completion_length, or start vLLM with a larger --max-model-len."
        )


# -- the factory's entry point ----------------------------------------------------------------------------------
def check_cpu_head_dim(config) -> None:
    """vLLM's CPU attention kernels need a head size of at least 32; a smaller one fails deep inside the engine."""
    import torch

    if torch.cuda.is_available():
        return
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < 32:
        raise ConfigError(
            f"vLLM on a CPU needs attention heads of at least 32 dimensions, but this model's are "
            f"{head_dim} (hidden_size {config.hidden_size} / {config.num_attention_heads} heads). "
            "Generate with transformers (use_vllm=False), or use a model with head_dim >= 32."
        )


def create_vllm_backend(model, tokenizer, args, stop_token_ids: Sequence[int]) -> GenerationBackend:
    """The vLLM backend that `args` (an OnlineConfig with use_vllm=True) asks for."""
    mode = args.vllm_mode
    if mode not in VLLM_MODES:
        raise ConfigError(
            f"vllm_mode={mode!r} is not one of {VLLM_MODES}: 'server' for a vLLM server started with "
            "`posttrain vllm-serve`, 'colocate' for vLLM inside the training process."
        )
    common = dict(sync_steps=args.vllm_sync_steps, steps_per_round=args.optimizer_steps_per_generation)
    if mode == "server":
        url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        client = VLLMClient(url, timeout_s=args.vllm_server_timeout, connect_timeout_s=args.vllm_server_timeout)
        vocab_size = getattr(policy_module(model).config, "vocab_size", None)
        nccl = dict(trainer_device=next(model.parameters()).device, group_port=getattr(args, "vllm_group_port", 51216))
        backend = VLLMServerBackend(
            client, stop_token_ids, sync_dir=args.vllm_sync_dir, vocab_size=vocab_size, **nccl, **common
        )
        if backend.nccl is None and nccl["group_port"] != 51216:
            logger.warning(
                "vllm_group_port=%d is unused: the vLLM server at %s gets the weights through files (it was started "
                "without --weight-transfer nccl).",
                nccl["group_port"],
                url,
            )
        return backend
    check_cpu_head_dim(policy_module(model).config)
    context = policy_module(model).config.max_position_embeddings
    kv_cache_gb, fraction = colocate_memory(args, next(model.parameters()).device.type)
    max_model_len = args.vllm_max_model_length or min(
        context, (args.max_prompt_length or context) + args.max_completion_length
    )
    return VLLMColocateBackend(
        model,
        tokenizer,
        stop_token_ids,
        max_model_len=max_model_len,
        model_impl=args.vllm_model_impl,
        kv_cache_gb=kv_cache_gb,
        gpu_memory_utilization=fraction,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        seed=args.seed,
        **common,
    )


__all__ = [
    "VLLMColocateBackend",
    "VLLMServerBackend",
    "VLLMServerError",
    "create_vllm_backend",
    "policy_weights",
    "sampler_logps_tensor",
    "sampler_mismatch_metrics",
    "save_weights",
]
