"""The policy's weights in shared memory for a generation process: a few slots, each one version of every
parameter, in one flat buffer per dtype. The trainer writes a slot; the generation process points its parameters
at a slot's views, so taking new weights costs it no copy.

One lock guards a table of ints that both processes read: the slot the generation process is using, the newest
slot published, and each slot's version (the optimizer step of its weights; -1 while empty or being written).
The table itself has no lock of its own: the trainer reads the entries only it writes (versions, newest) without
one, so that a generation process killed while holding the lock can never block the trainer; every wait for the
lock is bounded and checks that the other side is alive.

- Publishing picks a slot that is neither in use, nor the newest, nor pinned (named by a request not yet
  answered), marks it empty under the lock, copies the weights in without the lock (no reader may take an empty
  slot) and then, under the lock, gives it its version and makes it the newest.
- The generation process takes a slot (the newest, or the one a request names) under the lock and marks it in
  use; the trainer never writes that slot until the generation process has moved on.
"""

from __future__ import annotations

import contextlib
import multiprocessing

import torch

__all__ = ["SharedWeights", "shared_bytes"]

USING, NEWEST, VERSIONS = 0, 1, 2  # positions in the table
LOCK_WAIT_S = 1.0  # how long a lock attempt waits before the caller checks that the other side is alive


def shared_bytes(model, num_slots: int) -> int:
    """Bytes of shared memory `num_slots` slots of `model`'s parameters take."""
    return num_slots * sum(p.numel() * p.element_size() for p in model.parameters())


class SharedWeights:
    """`num_slots` slots of the parameters of `model`, whose own parameters become views of slot 0 (so the
    model, sent to the generation process, carries no memory of its own). Picklable to a spawned process."""

    def __init__(self, model, num_slots: int, context) -> None:
        params = [p for _, p in model.named_parameters()]
        self.layout = [(p.dtype, p.shape, p.numel()) for p in params]
        sizes: dict[torch.dtype, int] = {}
        for dtype, _, numel in self.layout:
            sizes[dtype] = sizes.get(dtype, 0) + numel
        self.buffers = [
            {dtype: torch.empty(size, dtype=dtype).share_memory_() for dtype, size in sizes.items()}
            for _ in range(num_slots)
        ]
        self.table = context.Array("q", [-1] * (VERSIONS + num_slots), lock=False)
        self.lock = context.RLock()
        self._views: dict[int, list[torch.Tensor]] = {}
        with torch.no_grad():
            for param, view in zip(params, self.views(0)):
                view.copy_(param)
                param.data = view

    @property
    def num_slots(self) -> int:
        return len(self.buffers)

    def views(self, slot: int) -> list[torch.Tensor]:
        """The parameters of `slot`, in `named_parameters` order."""
        if slot not in self._views:
            offsets = dict.fromkeys(self.buffers[slot], 0)
            views = []
            for dtype, shape, numel in self.layout:
                start = offsets[dtype]
                views.append(self.buffers[slot][dtype][start : start + numel].view(shape))
                offsets[dtype] = start + numel
            self._views[slot] = views
        return self._views[slot]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_views": {}}

    # -- the trainer's side -----------------------------------------------------------------------------------
    def version(self, slot: int) -> int:
        return self.table[VERSIONS + slot]

    def slot_of(self, version: int) -> int | None:
        """The slot holding `version`, if one does."""
        for slot in range(self.num_slots):
            if self.table[VERSIONS + slot] == version:
                return slot
        return None

    def publish(self, params: list[torch.Tensor], version: int, pinned: set[int], alive=lambda: True) -> int:
        """Copies `params` (in `named_parameters` order) into a free slot as `version`, makes it the newest and
        returns it. `pinned`: slots that requests not yet answered name. `alive()` says whether the generation
        process still lives (a dead one cannot release the lock; the caller restarts it, with a new table)."""
        with self._locked(alive):
            busy = {self.table[USING], self.table[NEWEST], *pinned}
            free = [slot for slot in range(self.num_slots) if slot not in busy]
            if not free:
                raise RuntimeError(f"No free weight slot: {self.num_slots} slots, busy {sorted(busy)}.")
            slot = min(free, key=self.version)  # the oldest
            self.table[VERSIONS + slot] = -1
        with torch.no_grad():
            for view, param in zip(self.views(slot), params):
                view.copy_(param)
        with self._locked(alive):
            self.table[VERSIONS + slot] = version
            self.table[NEWEST] = slot
        return slot

    def reset_table(self, context) -> None:
        """A new table and lock with the same versions and nothing in use (after the generation process died,
        perhaps holding the old lock)."""
        table = context.Array("q", self.table[:], lock=False)
        table[USING] = -1
        self.table, self.lock = table, context.RLock()

    # -- the generation process's side -----------------------------------------------------------------------
    def take(self, params: list[torch.Tensor], slot: int | None, current: int, block: bool) -> int:
        """Points `params` at `slot` (None: the newest) when it holds a version other than `current`; returns
        the version `params` now hold. Without `block`, a busy lock leaves the weights as they are."""
        lock = self.lock
        if not block and not lock.acquire(False):
            return current
        while block and not lock.acquire(timeout=LOCK_WAIT_S):
            parent = multiprocessing.parent_process()
            if parent is not None and not parent.is_alive():  # the trainer died, perhaps holding the lock
                raise SystemExit(1)
        try:
            slot = self.table[NEWEST] if slot is None else slot
            version = -1 if slot < 0 else self.table[VERSIONS + slot]
            if version < 0 or (version == current and self.table[USING] == slot):
                return current
            for param, view in zip(params, self.views(slot)):
                param.data = view
            self.table[USING] = slot
            return version
        finally:
            lock.release()

    @contextlib.contextmanager
    def _locked(self, alive):
        lock = self.lock
        while not lock.acquire(timeout=LOCK_WAIT_S):
            if not alive():
                raise GenerationProcessDied("the generation process died holding the weights' lock")
        try:
            yield
        finally:
            lock.release()


class GenerationProcessDied(RuntimeError):
    """The generation process ended while the trainer needed it (it is restarted)."""
