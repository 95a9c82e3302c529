"""An asyncio event loop on a daemon thread (for async reward functions and tools called from synchronous
training code), and the test of whether a callable is async."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading


def start_event_loop_in_daemon(name: str | None = None):
    """(thread, loop, ready): a new event loop running forever on a daemon thread; `ready` is set once it runs.
    Submit work with `asyncio.run_coroutine_threadsafe(coro, loop)`."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, loop, ready


def shutdown_event_loop_in_daemon(thread: threading.Thread | None, loop: asyncio.AbstractEventLoop | None) -> None:
    """Stops `loop` (started by `start_event_loop_in_daemon`), waits for its thread, and closes it; None is a no-op."""
    if loop is None:
        return
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    if thread is not None:
        thread.join()
    if not loop.is_running():
        loop.close()


def is_async_callable(func) -> bool:
    """Whether calling `func` returns a coroutine: an `async def` function, a `functools.partial` of one, or an
    instance whose `__call__` is `async def`."""
    while isinstance(func, functools.partial):
        func = func.func
    if inspect.iscoroutinefunction(func):
        return True
    if not callable(func) or inspect.isroutine(func):
        return False
    return inspect.iscoroutinefunction(type(func).__call__)


__all__ = ["is_async_callable", "shutdown_event_loop_in_daemon", "start_event_loop_in_daemon"]
