"""Operation base class, the protocol for ops that take explicit positions, and the base of
the fused AdamW update ops."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.devices.device import DeviceType
from mila_py.devices.execution_context import ExecutionContext
from mila_py.devices.graph import reads_host
from mila_py.precision import Precision

__all__ = [
    "DecodePositions",
    "FusedAdamW",
    "Operation",
    "PositionalPairedOp",
    "bind_attention_decode",
    "bind_cache_write",
    "bind_rope_decode",
    "write_ints",
]


class DecodePositions:
    """The positions of one decode step, which the bound calls of a decode plan read per call.

    Args:
        n_sequences: ``B``.
        context: the plan's execution context; on a GPU the positions are kept in its memory
            too (:attr:`device`), where the step's kernels read them.
        limit: every position of the plan's steps is below it (the KV cache's length), so
            that an op can choose at bind time what serves every step (one table, one launch
            geometry); None when unknown.

    Attributes:
        each: int64 ``[B]``, the position of every sequence (written in place per step).
        highest: ``max(each)``.
        uniform: every sequence is at ``highest`` (no per-sequence work needed).
        device: int32 ``[B]`` on the context's device, :attr:`each` as of the last :meth:`set`
            (written on the context's stream, ahead of the step's kernels); None on the CPU.
        limit: as given.
    """

    __slots__ = ("_context", "device", "each", "highest", "limit", "uniform")

    def __init__(
        self, n_sequences: int, context: ExecutionContext | None = None, limit: int | None = None
    ) -> None:
        self.each = np.zeros(n_sequences, dtype=np.int64)
        self.highest = 0
        self.uniform = True
        self.limit = limit
        on_device = context is not None and context.device_type is not DeviceType.CPU
        self._context = context if on_device else None
        self.device: Any = None
        if self._context is not None:
            self.device = self._context.allocate((n_sequences,), np.int32)

    def set(self, positions: Any, lowest: int, highest: int) -> None:
        """Take an int (every sequence) or ``[B]`` ints and their range, checked by the caller
        (every position below ``2**31``); run it with the context active."""
        self.each[...] = positions
        self.highest, self.uniform = highest, lowest == highest
        if self._context is not None and self.each.size:
            write_ints(self._context, self.device, self.each)


def write_ints(context: Any, buffer: Any, values: np.ndarray) -> None:
    """Host ints ``values`` into the int32 device array ``buffer`` of the same size, on the
    context's stream (ordered after the work queued before, which may read the old values);
    run it with the context active. The values must fit an int32."""
    host = values.astype(np.int32).reshape(buffer.shape)
    if context.xp is np:  # a device of NumPy arrays (the tests' kernel emulator)
        buffer[...] = host
    else:
        buffer.set(host, stream=context.stream)


def bind_rope_decode(
    apply: Callable[..., None], q: Any, k: Any, positions: DecodePositions
) -> Callable[[], None]:
    """A RoPE op's ``apply`` on ``q``, ``k`` ``[B, 1, width]`` at the step's ``positions`` (read
    at each call), as a callable of no arguments: the decode-plan call of any RoPE op, which
    ops with a cheaper direct call use where that does not apply (it reads the positions on
    the host: see :func:`~mila_py.devices.graph.reads_host`)."""
    each = positions.each.reshape(-1, 1)  # a view: the values of the step

    @reads_host
    def rotate() -> None:
        top = positions.highest
        if positions.uniform:
            apply(q, k, offset=top, seq_len=top + 1)
        else:
            apply(q, k, positions=each, seq_len=top + 1)

    return rotate


def bind_cache_write(
    xp: Any, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any, positions: DecodePositions
) -> Callable[[], None]:
    """The new token's keys and values ``[B, Hk*d]`` into row ``positions.each[b]`` of sequence
    ``b`` of the caches ``[B, T_max, Hk*d]`` (C-contiguous), as a callable of no arguments (a
    decode plan): array assignments of the module ``xp``. Ragged steps index the caches seen as
    ``[B * T_max, Hk*d]`` at ``b * T_max + each[b]`` (one index array, made on the host, so
    the call :func:`~mila_py.devices.graph.reads_host`)."""
    k_rows = k_cache.reshape(-1, k_cache.shape[-1])  # views of the C-contiguous caches
    v_rows = v_cache.reshape(-1, v_cache.shape[-1])
    starts, each = np.arange(k_cache.shape[0]) * k_cache.shape[1], positions.each

    @reads_host
    def write() -> None:
        if positions.uniform:
            k_cache[:, positions.highest] = k_new
            v_cache[:, positions.highest] = v_new
        else:
            at = starts + each
            if xp is not np:  # a device's cache takes a device index (8 bytes a sequence)
                at = xp.asarray(at)
            k_rows[at] = k_new
            v_rows[at] = v_new

    return write


def bind_attention_decode(
    forward: Callable[..., Any],
    q: Any,
    k_cache: Any,
    v_cache: Any,
    n_heads: int,
    n_kv_heads: int,
    scale: float,
    out: Any,
    positions: DecodePositions,
) -> Callable[[], None]:
    """An attention op's ``forward`` of ``q [B, 1, Hq*d]`` over the cached keys and values
    ``[B, T_max, Hk*d]`` up to the step's ``positions`` (read at each call; sequence ``b`` sees
    ``0 .. positions.each[b]``), into ``out``, as a callable of no arguments: the decode-plan
    call of any attention op (it slices the caches by the positions on the host: see
    :func:`~mila_py.devices.graph.reads_host`)."""
    each = positions.each

    @reads_host
    def attend() -> None:
        n = positions.highest + 1
        visible = None if positions.uniform else each + 1
        keys, values = k_cache[:, :n], v_cache[:, :n]
        forward(q, keys, values, n_heads, n_kv_heads, scale, out=out, causal=False, visible=visible)

    return attend


class Operation:
    """A device-specific computation behind a component.

    Ops hold no parameters (components own them) but may own state such as tables or scratch
    buffers; they report it through :meth:`state_arrays`, allocated through the execution context.

    Args:
        context: the execution context the op runs on.
        config: the component's config.
        precision: storage precision of the arrays the op receives.
    """

    def __init__(self, context: ExecutionContext, config: Any, precision: Precision) -> None:
        self.context = context
        self.config = config
        self.precision = precision
        self.build_context: BuildContext | None = None

    def build(self, build_context: BuildContext) -> None:
        """Allocate whatever state the op needs for ``build_context``."""
        self.build_context = build_context

    def state_arrays(self) -> list[Any]:
        """Arrays of state this op owns or shares (counted once each in memory stats)."""
        return []

    def bind_forward(self, *args: Any) -> Callable[[], Any]:
        """``forward(*args)`` as a callable of no arguments, for arrays that stay the same from
        call to call (a decode plan: fixed buffers, new values). Ops override it with a cheaper
        call where the arrays allow one; the result must track the arrays' contents, never copy
        them at bind time. Callers run the result with the execution context active (CUDA: its
        device and stream current), as a decode plan does, so a bound call need not activate
        it again."""
        return functools.partial(self.forward, *args)  # type: ignore[attr-defined]

    def state_nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state_arrays())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.context.device_id}, {self.precision})"


@runtime_checkable
class PositionalPairedOp(Protocol):
    """An op over a pair of tensors (Q, K) that can be told absolute positions."""

    def prefill(self, q: Any, k: Any, position_offset: int) -> None: ...

    def decode(self, q: Any, k: Any, position: Any) -> None: ...


class FusedAdamW(Operation):
    """The fused AdamW update of one parameter, ``AdamWOp`` on every device that has one.

    ``config`` is unused: the hyper-parameters come with each call. The update does NumPy's
    operations of :meth:`mila_py.optim.AdamW.step` in the same order, each rounded to the
    parameter's dtype::

        p = p * decay                              (parameters that decay)
        m = m * beta1 + (1 - beta1) * g
        v = v * beta2 + (1 - beta2) * g * g
        p = p - step_size * (m / (sqrt(v) / sqrt(correction2) + eps))

    A 16-bit parameter ``p`` comes with its FP32 master copy ``master`` (and FP32 ``g``, ``m``,
    ``v``): the update above runs on ``master`` and ``p`` receives the result rounded to its
    dtype (to nearest even), as :class:`mila_py.optim.AdamW`'s array code does.

    Subclasses implement :meth:`_update` and may narrow :meth:`accepts`.
    """

    #: what :meth:`accepts` asks for, in the error message
    requirement = "dense arrays of one shape and one layout"

    def accepts(self, p: Any, g: Any, m: Any, v: Any, master: Any = None) -> bool:
        """True if the kernel can update these arrays: dense, one shape, one layout (with a
        ``master``: all C-contiguous, ``g``, ``m``, ``v`` and ``master`` float32)."""
        if master is not None:
            arrays = (p, master, g, m, v)
            return all(a.shape == p.shape and a.flags.c_contiguous for a in arrays) and all(
                a.dtype == np.float32 for a in arrays[1:]
            )
        dense = bool(p.flags.c_contiguous or p.flags.f_contiguous)
        return dense and all(a.shape == p.shape and a.strides == p.strides for a in (g, m, v))

    def step(
        self,
        p: Any,
        g: Any,
        m: Any,
        v: Any,
        *,
        decay: float | None,
        betas: tuple[float, float],
        correction2: float,
        eps: float,
        step_size: float,
        master: Any = None,
    ) -> None:
        """Update ``p``, ``m``, ``v`` in place from ``g`` (all C- or all F-contiguous, one shape).

        Args:
            master: the FP32 master copy of a 16-bit ``p`` (updated in place; ``p`` receives
                it rounded), or None (``p`` is updated itself).
            decay: the factor ``1 - lr * weight_decay`` for a decaying parameter, else None.
            betas: ``(beta1, beta2)``.
            correction2: ``1 - beta2 ** step``.
            eps: denominator guard.
            step_size: ``lr / (1 - beta1 ** step)``.

        Raises:
            ValueError: the arrays are not ones :meth:`accepts` (nothing is updated).
        """
        if not self.accepts(p, g, m, v, master):
            arrays = (p, g, m, v) if master is None else (p, master, g, m, v)
            names = "p, g, m and v" if master is None else "p, master, g, m and v"
            raise ValueError(
                f"{type(self).__name__}: {names} must be {self.requirement}, got dtypes "
                f"{[str(a.dtype) for a in arrays]}, shapes {[a.shape for a in arrays]} and "
                f"strides {[a.strides for a in arrays]}"
            )
        if int(p.size) == 0:
            return
        beta1, beta2 = betas
        # NumPy rounds each Python float to the dtype of the weights it updates
        t = (p if master is None else master).dtype.type
        scalars = (
            t(1.0 if decay is None else decay), t(beta1), t(1.0 - beta1), t(beta2), t(1.0 - beta2),
            t(math.sqrt(correction2)), t(eps), t(step_size),
        )  # fmt: skip
        self._update(p, g, m, v, decay is not None, scalars, master)

    def _update(
        self,
        p: Any,
        g: Any,
        m: Any,
        v: Any,
        decays: bool,
        scalars: tuple[Any, ...],
        master: Any = None,
    ) -> None:
        """Run the kernel: ``scalars`` are ``(decay, beta1, 1 - beta1, beta2, 1 - beta2,
        sqrt(correction2), eps, step_size)`` in the dtype of the weights updated (``master``'s
        where there is one)."""
        raise NotImplementedError
