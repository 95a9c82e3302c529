"""The generation process's cores lent to training while it waits for its next request.

With the 1 + 1 split of a two-core machine the generation process finishes a round sooner than training finishes
a step (sampling gains little from a second thread, the training forward and backward gain much), so its core
would sit idle for the rest of the step. The generation process raises a shared flag while it samples; during the
update's forward and backward the training process looks at the flag at every decoder layer (entering its forward,
and its gradient arriving in the backward) and, while it is down, runs on both sides' cores with both sides'
threads, going back to its own as soon as the flag is up again. Outside the update (scoring, the optimizer,
logging) training keeps to its own cores.

Only with in-flight weight updates, which already make a run depend on timing: the thread count changes how a
reduction is summed, so a run that borrows cores is not bitwise reproducible.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from posttrain.runtime.cores import CoreSplit, pin_process

__all__ = ["CoreLender", "decoder_layers"]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks of `model`'s largest `nn.ModuleList` (a decoder's layers, whatever the family or wrapper)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


class CoreLender:
    """Borrows the generation cores of `split` for the update while `busy` (a shared byte the generation process
    sets while it samples) is 0. `threads`: the training process's own thread count; the borrowed count adds the
    generation side's, within `limit` (the threads the run was given)."""

    def __init__(self, split: CoreSplit, busy, threads: int, limit: int) -> None:
        self.busy = busy
        self.own = (tuple(split.training), threads)
        both = tuple(sorted({*split.training, *split.generation}))
        self.borrowed = (both, min(threads + split.generation_threads, limit))
        self.lending = False
        self.since = 0.0  # when the current loan began
        self.lent_seconds = 0.0  # time run on the borrowed cores since the last `take_lent_seconds` (a metric)

    @property
    def useful(self) -> bool:
        """Whether borrowing adds a thread (not when the run was given no more threads than training has)."""
        return self.borrowed[1] > self.own[1]

    @contextlib.contextmanager
    def update(self, model: nn.Module):
        """Borrows the idle generation cores during the forward and backward run inside the block."""
        if not self.useful:
            yield
            return
        handles = []
        for layer in decoder_layers(model):
            handles.append(layer.register_forward_pre_hook(self._look_before))
            handles.append(layer.register_forward_hook(self._look_after))
        try:
            self.look()
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._set(False)

    def look(self) -> None:
        """Borrows or gives back the generation cores, by the flag."""
        self._set(self.busy.value == 0)

    def _set(self, lend: bool) -> None:
        if lend == self.lending:
            return
        cpus, threads = self.borrowed if lend else self.own
        pin_process(cpus)
        torch.set_num_threads(threads)
        self.lending = lend
        now = time.perf_counter()
        if lend:
            self.since = now
        else:
            self.lent_seconds += now - self.since

    def take_lent_seconds(self) -> float:
        """Seconds run on the borrowed cores since the last call."""
        seconds, self.lent_seconds = self.lent_seconds, 0.0
        return seconds

    def _look_before(self, module, args) -> None:
        self.look()

    def _look_after(self, module, args, output) -> None:
        """In the backward the layers come back in reverse: the gradient of a layer's output is the boundary."""
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._look_in_backward)

    def _look_in_backward(self, grad: torch.Tensor) -> None:
        self.look()
