"""RunLock: the calls on one network from several threads run one at a time.

A network's stateful calls (forward, backward, prefill, decode, generation) share its buffers:
activations, gradients, the KV cache, the decode workspaces. Two threads running them at once
would mix their results silently, so each such call holds its network's lock for its duration
(:func:`serialized`) and the calls of other threads wait their turn.

The lock is re-entrant per thread, as ``threading.RLock`` is: a call may make other calls on
the same network, and one thread may interleave its own calls as it likes.

A token stream (a generator) holds the network for its whole generation, since another
thread's call between two of its steps would rewrite the cache its next step reads. It takes a
*hold* (:meth:`RunLock.hold`): a level of the lock that stays taken while the stream is paused
between tokens and is given back when the stream ends, is closed or is garbage-collected. A
hold is not tied to a thread, so a stream may be advanced from a thread other than the one
that started it (as a server's worker pool does): the lock moves to that thread as soon as the
thread that had it is inside no call, and a hold can be given back from any thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["RunLock", "RunLockHold", "serialized"]

_F = TypeVar("_F", bound=Callable[..., Any])


class RunLock:
    """A re-entrant lock whose levels a paused stream can keep without its thread.

    Args:
        name: what the lock guards, for error messages (e.g. ``"Llama 'llama'"``).

    Use ``with lock:`` around a sequence of calls that must not be interleaved with another
    thread's (a training forward and its backward, for example).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # An RLock underneath: a stream finalized by the garbage collector while this thread is
        # inside one of the methods below gives its hold back through them without deadlock.
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._owner: threading.Thread | None = None  # Thread objects: an ident can be reused
        self._depth = 0  # the levels the owner holds, paused holds included
        self._paused = 0  # the holds whose stream is paused between two tokens

    def acquire(self, blocking: bool = True) -> bool:
        """Take one level of the lock, waiting while another thread holds it (unless
        ``blocking`` is False). Returns whether it was taken."""
        me = threading.current_thread()
        with self._mutex:
            if self._owner is not me:
                if self._owner is not None:
                    if not blocking:
                        return False
                    while self._owner is not None:
                        self._cond.wait()
                self._owner = me
            self._depth += 1
            return True

    def release(self) -> None:
        """Give back one level taken by :meth:`acquire` in this thread.

        Raises:
            RuntimeError: this thread does not hold the lock.
        """
        me = threading.current_thread()
        with self._mutex:
            if self._owner is not me:
                holder = "no thread" if self._owner is None else f"thread {self._owner.name!r}"
                raise RuntimeError(
                    f"{self.name}: its run lock is not held by this thread ({me.name!r}) but by "
                    f"{holder}: release it where it was acquired"
                )
            self._drop()

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def locked(self) -> bool:
        """Whether a thread or a stream holds the lock."""
        return self._owner is not None

    def hold(self) -> RunLockHold:
        """Take one level for a stream (waiting like :meth:`acquire`); see :class:`RunLockHold`."""
        self.acquire()
        return RunLockHold(self)

    def _drop(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
        if self._depth == self._paused:  # free, or only paused streams: a waiter may go on
            self._cond.notify_all()


class RunLockHold:
    """One level of a :class:`RunLock` kept by a stream: :meth:`pause` before each yield,
    :meth:`resume` after it, :meth:`release` in the stream's ``finally``."""

    def __init__(self, lock: RunLock) -> None:
        self._lock = lock
        self._paused = False
        self._held = True

    def pause(self) -> None:
        """The stream is about to yield: its level stays taken, but no call runs under it."""
        lock = self._lock
        with lock._cond:
            self._paused = True
            lock._paused += 1
            lock._cond.notify_all()  # a thread waiting to resume another stream may go on

    def resume(self) -> None:
        """The stream goes on in this thread: if another thread holds the lock, wait until it
        is inside no call (every level it holds is a paused stream's), then take them all."""
        lock = self._lock
        me = threading.current_thread()
        with lock._cond:
            lock._cond.wait_for(lambda: lock._owner is me or lock._depth == lock._paused)
            lock._owner = me
            lock._paused -= 1
            self._paused = False

    def release(self) -> None:
        """Give the level back, from any thread if the stream is paused (closed or collected);
        a second call does nothing."""
        lock = self._lock
        with lock._cond:
            if not self._held:
                return
            self._held = False
            if self._paused:
                self._paused = False
                lock._paused -= 1
            lock._drop()


def serialized(method: _F) -> _F:
    """Run ``method`` of a network while holding the network's :class:`RunLock`
    (``self._run_lock``)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._run_lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]
