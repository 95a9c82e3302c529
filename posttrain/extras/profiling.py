"""TRL's `trl.extras.profiling` import path; the timing helpers live in `posttrain.training.profiling`."""

from posttrain.training.profiling import ProfilingContext, profiling_context, profiling_decorator

__all__ = ["ProfilingContext", "profiling_context", "profiling_decorator"]
