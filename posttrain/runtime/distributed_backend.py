"""Which sharding engine a run trains under (DeepSpeed ZeRO or FSDP), read once from accelerate's state, with the
operations that differ between them as context managers that do nothing where nothing is sharded."""

from __future__ import annotations

import contextlib


class DistributedBackend:
    """`DistributedBackend(accelerator)`: `zero_stage` (0 without DeepSpeed), `fsdp_version` (None without FSDP),
    `is_zero3`, `is_fsdp`, and `gather_params` / `summon_full_params` to see whole parameters for a block."""

    def __init__(self, accelerator) -> None:
        deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
        fsdp = getattr(accelerator.state, "fsdp_plugin", None)
        self.zero_stage = deepspeed.zero_stage if deepspeed is not None else 0
        self.fsdp_version = getattr(fsdp, "fsdp_version", 1) if fsdp is not None else None

    @property
    def is_zero3(self) -> bool:
        return self.zero_stage == 3

    @property
    def is_fsdp(self) -> bool:
        return self.fsdp_version is not None

    @contextlib.contextmanager
    def gather_params(self, params):
        """Under ZeRO-3, `params` are gathered whole in every process for the block; elsewhere they already are."""
        if not self.is_zero3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params)):
            yield

    @contextlib.contextmanager
    def summon_full_params(self, module, **kwargs):
        """Under FSDP 1, `module`'s full parameters for the block (torch's `summon_full_params`, `kwargs` passed
        on); FSDP 2's parameters are DTensors readable as they are, and other backends hold them whole."""
        if self.fsdp_version != 1:
            yield
            return
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(module, **kwargs):
            yield


def gather_partitioned(*params):
    """A context with each of `params` that ZeRO-3 holds partitioned (not AVAILABLE) gathered whole, each once (a
    parameter may be passed twice: tied embeddings, a shared reference); a null context when none is. For code that
    reads a module's weight directly (a chunked LM head) instead of calling the module, whose hook would gather it;
    code that recomputes in the backward pass must enter it again there. TRL's `maybe_gather_lm_head_ctx`."""
    partitioned = {id(p): p for p in params if p is not None and hasattr(p, "ds_status")}
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    to_gather = [p for p in partitioned.values() if p.ds_status != ZeroParamStatus.AVAILABLE]
    return deepspeed.zero.GatheredParameters(to_gather) if to_gather else contextlib.nullcontext()


__all__ = ["DistributedBackend", "gather_partitioned"]
