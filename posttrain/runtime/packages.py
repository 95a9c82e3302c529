"""Which optional packages are installed (and at what version), without importing them.

TRL exposes these checks as `trl.import_utils.is_<package>_available`; `posttrain.import_utils` re-exports them
under the same names, and posttrain's own code asks the same questions here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import warnings
from contextlib import contextmanager

from packaging.version import Version

LIGER_KERNEL_MIN_VERSION = "0.8.2"
# The vLLM releases the vLLM backend is tested against; another version works but warns.
VLLM_TESTED_RANGE = ("0.22.0", "0.31.0")


def package_version(name: str) -> str | None:
    """The installed version of the importable package `name`, or None if it is not installed. Read from the
    distribution's metadata (found through the import name, so `PIL` finds `pillow`), else `__version__`."""
    if importlib.util.find_spec(name) is None:
        return None
    candidates = importlib.metadata.packages_distributions().get(name, [])
    preferred = [d for d in candidates if d.replace("-", "_").lower() == name.lower()] or candidates
    for distribution in [*preferred, name]:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return getattr(importlib.import_module(name), "__version__", "0")


def is_package_available(name: str, min_version: str | None = None) -> bool:
    """True if `name` can be imported (and, with `min_version`, is at least that version)."""
    if min_version is None:
        return importlib.util.find_spec(name) is not None
    version = package_version(name)
    return version is not None and Version(version) >= Version(min_version)


def is_aiohttp_available() -> bool:
    return is_package_available("aiohttp")


def is_deepspeed_available() -> bool:
    return is_package_available("deepspeed")


def is_harbor_available() -> bool:
    return is_package_available("harbor")


def is_jmespath_available() -> bool:
    return is_package_available("jmespath")


def is_liger_kernel_available(min_version: str = LIGER_KERNEL_MIN_VERSION) -> bool:
    return is_package_available("liger_kernel", min_version)


def is_math_verify_available() -> bool:
    return is_package_available("math_verify")


def is_mergekit_available() -> bool:
    return is_package_available("mergekit")


def is_openreward_available() -> bool:
    return is_package_available("openreward")


def is_requests_available() -> bool:
    return is_package_available("requests")


def is_unsloth_available() -> bool:
    return is_package_available("unsloth")


def is_weave_available() -> bool:
    return is_package_available("weave")


def is_vllm_available(min_version: str | None = None) -> bool:
    """True if vLLM is installed (and at least `min_version`); warns once per call on a release outside the tested
    range."""
    version = package_version("vllm")
    if version is None:
        return False
    base = Version(Version(version).base_version)  # "0.24.0+cu129" compares as 0.24.0
    low, high = VLLM_TESTED_RANGE
    if not Version(low) <= base <= Version(high):
        warnings.warn(
            f"vLLM {version} is installed; the vLLM backend is tested with {low} to {high}.", UserWarning, stacklevel=2
        )
    return min_version is None or Version(version) >= Version(min_version)


class TRLExperimentalWarning(UserWarning):
    """Warns that a name comes from `experimental`, whose API may change (TRL's warning class)."""


@contextmanager
def suppress_warning(category: type[Warning]):
    """Silences warnings of `category` inside the block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=category)
        yield


def suppress_experimental_warning():
    return suppress_warning(TRLExperimentalWarning)
