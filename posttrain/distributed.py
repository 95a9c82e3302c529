"""TRL's `trl.distributed` import path; the backend lives in `posttrain.runtime.distributed_backend`."""

from posttrain.runtime.distributed_backend import DistributedBackend

__all__ = ["DistributedBackend"]
