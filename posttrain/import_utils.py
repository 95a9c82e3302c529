"""TRL's `trl.import_utils` import path: which optional packages are installed. The checks live in
`posttrain.runtime.packages`; this module only re-exports them."""

from posttrain.runtime.packages import (
    LIGER_KERNEL_MIN_VERSION,
    TRLExperimentalWarning,
    is_aiohttp_available,
    is_deepspeed_available,
    is_harbor_available,
    is_jmespath_available,
    is_liger_kernel_available,
    is_math_verify_available,
    is_mergekit_available,
    is_openreward_available,
    is_requests_available,
    is_unsloth_available,
    is_vllm_available,
    is_weave_available,
    suppress_experimental_warning,
    suppress_warning,
)

__all__ = [
    "LIGER_KERNEL_MIN_VERSION",
    "TRLExperimentalWarning",
    "is_aiohttp_available",
    "is_deepspeed_available",
    "is_harbor_available",
    "is_jmespath_available",
    "is_liger_kernel_available",
    "is_math_verify_available",
    "is_mergekit_available",
    "is_openreward_available",
    "is_requests_available",
    "is_unsloth_available",
    "is_vllm_available",
    "is_weave_available",
    "suppress_experimental_warning",
    "suppress_warning",
]
