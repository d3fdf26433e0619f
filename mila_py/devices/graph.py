"""A step of bound calls, run once eagerly and then replayed as a CUDA graph.

A decode step is a fixed list of calls over fixed buffers (see
:meth:`mila_py.models.Llama.decode`). :func:`capture` turns such a list into one callable: on
a device whose stream can capture (CuPy's ``Stream.begin_capture``), its first call runs the
calls eagerly, which compiles their kernels, then records them into a graph (``stream.begin_capture()``, the calls, ``stream.end_capture()``), and every later
call replays that graph with one ``graph.launch(stream)``. A graph replays what the device did
during the capture: the same kernels with the same arguments on the same memory. So the
calls must read every value that changes from step to step (token ids, positions) from device
buffers, written before each replay; a call that reads host values when it runs instead is
marked with :func:`reads_host`, and a list that holds one runs eagerly every time. So do
calls on the CPU, and on a device whose stream cannot capture.

While the calls are captured, CuPy's allocator refuses every allocation: memory a call takes
then would go back to the pool after the capture, and a replay would write into whatever the
pool handed it to next. And CuPy refuses every cuBLAS call (``NotImplementedError``), which is
why a decode step's products are a kernel of mila_py's own (``linear.cu``, see
:meth:`mila_py.ops.cuda.linear.CudaLinearOp.bind_forward`) and not ``cupy.matmul``. A call of
a library that refuses to be captured in this way leaves its step eager (see
:meth:`Step._record`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["Step", "capture", "reads_host", "replayable"]

_Call = TypeVar("_Call", bound=Callable[..., Any])


def reads_host(call: _Call) -> _Call:
    """Mark the bound call ``call`` (a function or ``functools.partial``) as one that reads host
    values of the step when it runs (positions, lengths, a branch on them), which a graph would
    replay as they were at its capture; returns ``call``."""
    call.reads_host = True  # type: ignore[attr-defined]
    return call


def replayable(call: Callable[[], Any]) -> bool:
    """True unless ``call`` is marked with :func:`reads_host`."""
    return not getattr(call, "reads_host", False)


class Step:
    """Bound calls run in order by calling the step (see :func:`capture`).

    Attributes:
        graph: the captured graph once the first call has recorded it; None before, and
            always for a step that runs eagerly.
        captures: how many times this step began a capture (0 or 1).
    """

    __slots__ = ("_calls", "_context", "_stream", "captures", "graph")

    def __init__(self, context: Any, calls: Sequence[Callable[[], Any]], stream: Any) -> None:
        self._calls = tuple(calls)
        self._context = context
        self._stream = stream  # None: eager
        self.graph: Any = None
        self.captures = 0

    @property
    def eager(self) -> bool:
        """True for a step that never captures (see :func:`capture`)."""
        return self._stream is None

    def __call__(self) -> None:
        """Run the step: replay its graph, or run its calls (then capture them, the first time
        on a stream that can). Run it with the context active."""
        if self.graph is not None:
            self.graph.launch(self._stream)
            return
        for call in self._calls:
            call()
        if self._stream is not None:
            self.graph = self._record()

    def _record(self) -> Any:
        """The calls captured as a graph of the stream; None where the stream refuses to begin a
        capture (then the step stays eager). An error of a call during the capture ends it and
        is raised."""
        stream = self._stream
        try:
            stream.begin_capture()
        except (AttributeError, NotImplementedError, RuntimeError):  # no graphs (HIP)
            self._stream = None
            return None
        self.captures += 1
        try:
            with _refusing_allocations(self._context):
                for call in self._calls:
                    call()
        except NotImplementedError:
            # a library that refuses to be captured (as CuPy refuses cuBLAS calls; a decode
            # step's products are no such call): the warm-up run already gave this step's
            # results, and the step stays eager
            with contextlib.suppress(Exception):
                stream.end_capture()
            self._stream = None
            return None
        except BaseException:
            with contextlib.suppress(Exception):  # the capture is invalid: drop it
                stream.end_capture()
            raise
        return stream.end_capture()


def capture(context: Any, calls: Sequence[Callable[[], Any]]) -> Step:
    """The bound ``calls`` as one :class:`Step` of ``context``: replayed from a CUDA graph after
    its first call where ``context``'s stream can capture one and every call is
    :func:`replayable`, else run eagerly every time (the CPU, a stream without
    ``begin_capture``, a call that reads host values)."""
    stream = getattr(context, "stream", None)
    graphs = stream is not None and callable(getattr(stream, "begin_capture", None))
    if not graphs or not all(replayable(call) for call in calls):
        stream = None
    return Step(context, calls, stream)


def _refusing_allocations(context: Any) -> Any:
    """CuPy's allocator refusing every allocation meanwhile (a context manager); nothing to do
    where the array module has none."""
    cuda = getattr(context.xp, "cuda", None)
    using = getattr(cuda, "using_allocator", None)
    return contextlib.nullcontext() if using is None else using(_refuse)


def _refuse(nbytes: int) -> Any:
    raise RuntimeError(
        f"capture: a call allocated {nbytes} bytes of device memory while its step was being "
        "captured as a CUDA graph; a step's calls must use buffers allocated before (the pool "
        "would hand the memory to other arrays, which each replay would then overwrite)"
    )
