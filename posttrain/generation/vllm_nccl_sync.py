"""Server mode's fast weight sync on GPUs: NCCL through vLLM's native weight-transfer API.

Used when the server was started with `posttrain vllm-serve MODEL --weight-transfer nccl` (the handshake reports
it) and the trainer's weights are on CUDA; otherwise the weights go through safetensors files (vllm_backend.py).
vLLM's trainer-side engine (`vllm.distributed.weight_transfer.nccl_engine.NCCLTrainerWeightTransferEngine`)
does the transfer: the trainer's rank 0 opens an NCCL group with the server's workers (it is rank 0 of it; its
TCP store listens on this machine at `vllm_group_port`, TRL's meaning of that field), once, and each sync is
`/start_weight_update`, `/update_weights` while rank 0 broadcasts, then `/finish_weight_update` with the version.

What is sent is what the file sync writes: the policy's weights under the base model's names (a PEFT adapter
merged for the sync, the trainer's weights left bit-identical), a tied weight once, floating tensors in the
server's dtype. Under FSDP2 every rank gathers every parameter (`full_tensor`, a collective of the training
group, in the same order everywhere), all before rank 0 sends: a send between two gathers, on a group the other
ranks are not in, is how syncs hang without an error (TRL #7103/#7131).

Every wait has a deadline (`timeout_s`, the client's timeout): the HTTP calls, the group's rendezvous and the
broadcast. A failure raises `VLLMServerError` naming the server's URL and the version, on every rank (rank 0
hands its outcome to the others). A server that went away is waited for by the backend; the group is then
opened again and the weights of the last sync are pushed again from a host copy kept on rank 0 (the file
sync's directory plays that part there).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlparse

import torch

from posttrain.errors import ConfigError
from posttrain.generation.vllm_client import VLLMClient, VLLMServerError, VLLMServerUnreachable
from posttrain.generation.vllm_weights import full_tensor, is_sharded, policy_weights

logger = logging.getLogger(__name__)

NCCL = "nccl"  # the value of the handshake's "weight_transfer" for `--weight-transfer nccl`
Weights = list[tuple[str, torch.Tensor]]


def is_main_process() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def from_main_process(*values):
    """`values` as the main process has them (every process calls this)."""
    if not torch.distributed.is_initialized():
        return values
    objects = list(values)
    torch.distributed.broadcast_object_list(objects, src=0)
    return tuple(objects)


def check_nccl_trainer(server_info: dict, device: torch.device, url: str) -> bool:
    """Whether to sync over NCCL: the server was started with NCCL weight transfer. Refuses, before training, a
    trainer whose weights are not on a GPU (NCCL moves GPU memory)."""
    if server_info.get("weight_transfer") != NCCL:
        return False
    if device.type != "cuda":
        raise ConfigError(
            f"The vLLM server at {url} was started with `--weight-transfer nccl`, which syncs weights over NCCL "
            f"from a trainer on a GPU, but this trainer's weights are on {device.type}. Restart the server without "
            "--weight-transfer (weights then go through files, which works everywhere), or train on a GPU."
        )
    return True


def trainer_address(base_url: str) -> str:
    """The address of this machine that the server reaches it at: the local end of a route to the server (a UDP
    socket's connect sends nothing); 127.0.0.1 for a server on this machine."""
    host = urlparse(base_url).hostname or "127.0.0.1"
    if host in ("localhost", "0.0.0.0") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, urlparse(base_url).port or 80))
            return probe.getsockname()[0]
    except OSError as error:
        raise ConfigError(
            f"Cannot find this machine's address on the way to the vLLM server at {base_url} ({error}), which the "
            "NCCL weight sync (--weight-transfer nccl) needs. Check vllm_server_base_url / vllm_server_host."
        ) from None


class SyncTimeout(VLLMServerError):
    """A wait of the NCCL sync passed its deadline."""


def with_deadline(operation: Callable, timeout_s: float, failure: str):
    """`operation()` run on a daemon thread and waited for at most `timeout_s`; raises SyncTimeout(`failure` ...)
    past that (the thread is left to NCCL's abort when the group is dropped), and re-raises its error. The thread
    works on the caller's CUDA device (a new thread starts on device 0, and NCCL's group lives on one device)."""
    outcome: dict = {}
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def run():
        try:
            if device is not None:
                torch.cuda.set_device(device)
            outcome["value"] = operation()
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True, name="posttrain-nccl-sync")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise SyncTimeout(f"{failure}: no answer within {timeout_s:g} s (vllm_server_timeout).")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def await_version(client: VLLMClient, version: str, timeout_s: float, context: str) -> None:
    """Waits, at most `timeout_s`, until the server holds `version`: what a rank other than 0 does when it finds a
    restarted server, since only rank 0 is in the group that pushes the weights again."""
    deadline = time.monotonic() + timeout_s
    while (held := client.engine_weight_version(context)) != version:
        if time.monotonic() >= deadline:
            raise VLLMServerError(
                f"The vLLM server at {client.base_url} holds weights {held!r}, not version {version} ({context}), "
                f"{timeout_s:g} s after it was found restarted: the trainer's rank 0 did not push them again "
                "(vllm_server_timeout)."
            )
        time.sleep(0.5)


class SyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol over posttrain's client: each call names the sync (`context`), and
    `finish_weight_update` carries the sync's version (vLLM's engine calls it without one)."""

    def __init__(self, client: VLLMClient) -> None:
        self.client, self.version, self.context = client, None, ""

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.init_weight_transfer_engine(init_info, context=self.context)

    def start_weight_update(self) -> None:
        self.client.start_weight_update(context=self.context)

    def update_weights(self, update_info: dict) -> None:
        self.client.update_weights(update_info, context=self.context)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version or self.version, context=self.context)


class WeightsSource:
    """vLLM's `WeightSource` over one sync's tensors, already whole: `metadata()` and iteration read the same list,
    so they agree element for element, as vLLM's engine checks."""

    def __init__(self, meta_cls) -> None:
        self.meta_cls, self.weights = meta_cls, []

    def metadata(self) -> list:
        return [self.meta_cls(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.weights]

    def __iter__(self):
        return iter(list(self.weights))

    def held_names(self):
        return None


def _vllm_engine():
    """vLLM's trainer-side NCCL engine, its init info and its parameter metadata classes."""
    try:
        from vllm.distributed.weight_transfer.base import ParamMeta
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
    except ImportError as error:
        raise ConfigError(
            f"The vLLM server was started with `--weight-transfer nccl`, whose trainer side is vLLM's NCCL engine, "
            f"but vLLM cannot be imported in the trainer's environment ({error}). Install vLLM here (the server's "
            "version), or restart the server without --weight-transfer to sync through files."
        ) from None
    return NCCLTrainerWeightTransferEngine, NCCLTrainerInitInfo, ParamMeta


class NCCLWeightSync:
    """The NCCL sync of one server. `push` is called on every rank, once per sync; rank 0 alone talks to the server.

    `engine_cls`, `init_info_cls` and `meta_cls` default to vLLM's (tests pass fakes); `group_port` is the
    trainer's TCP store port of the group (vllm_group_port)."""

    def __init__(
        self,
        client: VLLMClient,
        group_port: int,
        dtype: torch.dtype | None,
        timeout_s: float,
        master_address: str | None = None,
        classes: tuple | None = None,
    ) -> None:
        self.client, self.group_port, self.dtype, self.timeout_s = client, group_port, dtype, timeout_s
        self.engine_cls, self.init_info_cls, meta_cls = classes or _vllm_engine()
        self.master_address = master_address or trainer_address(client.base_url)
        self.sync_client = SyncClient(client)
        self.source = WeightsSource(meta_cls)
        self.engine = None
        self.last: Weights | None = None  # rank 0: a host copy of the weights pushed last, for a restarted server
        self.seconds = 0.0  # of the last send (rank 0)

    def push(self, model, version: str, context: str, on_unreachable: Callable) -> None:
        """Sends the policy's current weights as `version`. Every rank calls it: under FSDP2 each gathers every
        parameter first. `on_unreachable(error)` waits for a server that went away (then the push is retried)."""
        failure, whole = None, None
        if is_main_process() or is_sharded(model):
            with policy_weights(model) as weights:
                whole = [(name, self._wire(full_tensor(tensor))) for name, tensor in weights]  # every rank, in order
                if is_main_process():
                    failure = self._send_retrying(whole, version, context, on_unreachable)
                    if failure is None:
                        self.last = [(name, tensor.to("cpu", copy=True)) for name, tensor in whole]
            del whole
        (failure,) = from_main_process(failure)
        if failure is not None:
            raise VLLMServerError(failure)

    def restore(self, version: str, context: str) -> None:
        """Rank 0: pushes the weights of the last sync again, as `version`, to a server that lost them (restarted),
        over a new group."""
        if self.last is None:
            raise VLLMServerError(
                f"The vLLM server at {self.client.base_url} lost weights version {version} ({context}), but no NCCL "
                "push has completed on this trainer to push again."
            )
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        whole = [(name, tensor.to(device) if device else tensor) for name, tensor in self.last or []]
        self.reset()
        try:
            self._send(whole, version, context)
        except VLLMServerUnreachable:
            raise
        except (RuntimeError, ValueError) as error:
            self.reset()
            if isinstance(error, VLLMServerError) and self.client.base_url in str(error):
                raise
            raise VLLMServerError(
                f"Restoring the weights: the {self._where(version, context)} failed: {error}"
            ) from None

    def reset(self) -> None:
        """Drops the group (after the server went away): the next send opens a new one, as a restarted server
        needs. Frees the store's port for it."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        group = getattr(engine, "model_update_group", None)
        try:
            with_deadline(engine.shutdown, 10.0, "closing the NCCL group")
        except Exception as error:  # the group is dropped either way
            logger.warning("Closing the NCCL weight-transfer group failed (%s); dropping it.", error)
        store_group = getattr(group, "group", None)
        if store_group is not None:  # vLLM's StatelessProcessGroup keeps the TCP store (and its port) alive
            store_group.store = store_group.socket = None

    # -- rank 0 ---------------------------------------------------------------------------------------------------
    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """As the server holds it: floating tensors in its dtype, contiguous."""
        if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        return tensor.contiguous()

    def _send_retrying(self, whole: Weights, version: str, context: str, on_unreachable: Callable) -> str | None:
        """`_send`, waiting for a server that went away and trying again; the error message on failure."""
        while True:
            try:
                self._send(whole, version, context)
                return None
            except VLLMServerUnreachable as error:
                self.reset()
                try:
                    on_unreachable(error)
                except VLLMServerError as final:
                    return str(final)
            except (VLLMServerError, RuntimeError, ValueError) as error:
                self.reset()  # a group that failed mid-transfer cannot be reused
                if isinstance(error, SyncTimeout):  # names the sync already
                    return str(error)
                return f"The {self._where(version, context)} failed: {error}"

    def _where(self, version: str, context: str) -> str:
        return f"NCCL weight sync of version {version} ({context}) to the vLLM server at {self.client.base_url}"

    def _send(self, whole: Weights, version: str, context: str) -> None:
        where = self._where(version, context)
        self.sync_client.version, self.sync_client.context = version, f"{context}, version {version}"
        if self.engine is None:
            self.engine = with_deadline(
                self._open, self.timeout_s, f"Opening the group for the {where} (vllm_group_port)"
            )
        self.source.weights = whole
        started = time.perf_counter()
        self.client.pause(context)
        try:
            with_deadline(self.engine.send_weights, self.timeout_s, f"The {where}")
            self.client.reset_prefix_cache(context)  # KV blocks computed with the old weights
        finally:
            self.source.weights = []
            self.client.resume(context)
        self.seconds = time.perf_counter() - started

    def _open(self):
        """Joins the server's workers in a new NCCL group (rank 0, the workers after it)."""
        workers = self.client.world_size(self.sync_client.context)
        info = self.init_info_cls(
            master_address=self.master_address, master_port=self.group_port, world_size=workers + 1, rank=0
        )
        try:
            return self.engine_cls.trainer_init(info, client=self.sync_client, source=self.source)
        except VLLMServerError:  # the server's side of the rendezvous, named by the client
            raise
        except (OSError, RuntimeError) as error:  # the store: its port taken, or not reachable from the server
            raise VLLMServerError(
                f"Could not open the NCCL group on {self.master_address}:{self.group_port} ({error}). Set "
                "vllm_group_port to a free port of this machine that the server can reach."
            ) from None
