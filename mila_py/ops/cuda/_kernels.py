"""What the CUDA ops share: their kernel sources, compiling and launching them, row views.

Each op's kernels live in a ``.cu`` file beside its module (``rope.cu`` beside ``rope.py``),
compiled after the shared header :data:`HEADER` (``common.cuh``: block reductions and macros)
as one NVRTC program per file: ``extern "C"`` kernels, or templates launched by their
instantiations' names (``rope_qk<float, 4, false>``, listed up front as NVRTC name
expressions). CuPy compiles a file lazily (a ``RawModule``), once per device and set of name
expressions. Every launch goes through :func:`launch`: the ``RawKernel`` called on the
execution context's device and stream, with device arrays and scalars at explicit widths
(``np.int32``, ``np.int64``, ``np.float32``), since CuPy turns a Python int into 64 bits and
checks nothing against the kernel's signature.

The arithmetic that the CPU ops do in float32 is written with ``__fmul_rn``/``__fadd_rn``/
``__fdiv_rn`` where the order of operations matters, so that the compiler does not contract it
into FMAs and the elementwise results follow NumPy's roundings; reductions (sums over a row)
differ from NumPy's pairwise order by a few ulps.

Storage precisions: a kernel file's templates over the storage type ``T`` (``float``,
``mila_half``, ``mila_bf16``: the 16-bit types of ``common.cuh``, carried as raw bits) are
instantiated per precision (:func:`kernel_names`); :class:`KernelOp` launches an op's
instantiations by template name. FP16 and BF16 layer ops need CuPy arrays of those dtypes
(``ml_dtypes.bfloat16`` from CuPy 14 on) for their 2-D matrix products (cuBLAS with float32
accumulation) and elementwise sums; a CuPy that carries bfloat16 as ``uint16`` is refused when
the op is made (:func:`refuse_carried_bfloat16`).

This module never imports CuPy at import time. The helpers take the execution context and use
``ctx.xp``, so that the ops' host-side logic also runs with NumPy arrays (the kernel emulator
of the CPU test suite swaps :func:`launch` and compiles the same files, read by
:func:`source`; see ``tests/kernel_emulator.py``).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from mila_py.ops.operation import Operation
from mila_py.ops.registry import OpNotFoundError
from mila_py.precision import Precision

__all__ = [
    "CTYPES",
    "CUDA_PRECISIONS",
    "HEADER",
    "NULL",
    "NVRTC_OPTIONS",
    "ROW_THREADS",
    "THREADS",
    "KernelOp",
    "address",
    "as_dtype",
    "contiguous_rows",
    "gemm_accumulate",
    "grid_1d",
    "kernel",
    "kernel_names",
    "launch",
    "matmul",
    "module",
    "refuse_carried_bfloat16",
    "source",
]

#: threads per block of the elementwise (grid-stride) kernels
THREADS = 256
#: threads per block of the one-block-per-row kernels (a multiple of 32, at most 1024)
ROW_THREADS = 256
#: blocks of a grid-stride launch at most (enough to fill any current GPU several times)
MAX_BLOCKS = 8192
#: a null pointer argument: 8 zero bytes. ``None`` is no substitute: CuPy 13.x passes it as an
#: unspecified value, not as NULL (cupy/cupy#9046).
NULL = np.uint64(0)
#: NVRTC options of every kernel source (CuPy adds the device's ``-arch``)
NVRTC_OPTIONS = ("--std=c++17",)
#: the header every kernel file is compiled after
HEADER = "common.cuh"

#: the C++ type of each storage precision in the kernels (``common.cuh``)
CTYPES = {Precision.FP32: "float", Precision.FP16: "mila_half", Precision.BF16: "mila_bf16"}
#: the precisions of the CUDA layer ops
CUDA_PRECISIONS = tuple(CTYPES)

_HERE = Path(__file__).parent
_MODULES: dict[tuple[str, tuple[str, ...], int], Any] = {}
_FUNCTIONS: dict[tuple[str, int, str], Any] = {}


@functools.cache
def source(name: str) -> str:
    """The text of the kernel file ``name`` (``"rope.cu"``, or :data:`HEADER`) of this package."""
    return (_HERE / name).read_text(encoding="utf-8")


def module(file: str, device_index: int, name_expressions: tuple[str, ...] = ()) -> Any:
    """The compiled ``RawModule`` of the kernel file ``file`` (after :data:`HEADER`) on a
    device, compiled once.

    Args:
        name_expressions: the template instantiations the module must contain (NVRTC
            instantiates and names only these); empty for files of ``extern "C"`` kernels.
    """
    key = (file, name_expressions, device_index)
    compiled = _MODULES.get(key)
    if compiled is None:
        import cupy

        compiled = cupy.RawModule(
            code=source(HEADER) + source(file),
            options=NVRTC_OPTIONS,
            name_expressions=list(name_expressions) or None,
        )
        with cupy.cuda.Device(device_index):
            compiled.compile()
        compiled = _MODULES.setdefault(key, compiled)
    return compiled


def kernel(file: str, name: str, device_index: int, name_expressions: tuple[str, ...] = ()) -> Any:
    """The ``RawKernel`` ``name`` of the kernel file ``file`` on a device (compiled once).

    Cached by file, device and name: ``RawModule.get_function`` builds a new object per call. A
    template instantiation's ``name`` must be one of ``name_expressions``.
    """
    key = (file, device_index, name)
    function = _FUNCTIONS.get(key)
    if function is None:
        import cupy

        compiled = module(file, device_index, name_expressions)
        with cupy.cuda.Device(device_index):  # the kernel loads for the current device
            function = _FUNCTIONS.setdefault(key, compiled.get_function(name))
    return function


def launch(
    ctx: Any,
    file: str,
    name: str,
    grid: tuple[int, ...],
    block: int,
    args: tuple[Any, ...],
    *,
    shared_mem: int = 0,
    name_expressions: tuple[str, ...] = (),
) -> None:
    """Launch kernel ``name`` of the kernel file ``file`` on ``ctx``'s device and stream.

    Args:
        ctx: the op's CUDA execution context.
        grid: blocks per grid dimension (every entry >= 1).
        block: threads per block (1-D blocks).
        args: device arrays and NumPy scalars of the kernel's exact types, in order.
        shared_mem: bytes of dynamic shared memory per block (``extern __shared__``).
        name_expressions: every template instantiation of ``file`` the ops launch (see
            :func:`module`); ``name`` is one of them.
    """
    function = kernel(file, name, ctx.device_id.index, name_expressions)
    with ctx.activate():  # a RawKernel runs on the current device and stream
        function(grid, (block,), args, shared_mem=shared_mem)


def address(x: Any) -> int:
    """The address of ``x``'s first element: what a raw kernel receives for the array."""
    if isinstance(x, np.ndarray):
        return int(x.ctypes.data)
    return int(x.data.ptr)


def grid_1d(n: int, threads: int = THREADS) -> tuple[int]:
    """Blocks for a grid-stride loop over ``n`` items (at least 1, at most :data:`MAX_BLOCKS`)."""
    return (max(1, min(MAX_BLOCKS, math.ceil(n / threads))),)


def contiguous_rows(xp: Any, x: Any) -> Any:
    """``x [..., C]`` as a C-contiguous ``[N, C]`` array: a view when ``x`` allows, else a copy.

    Raw kernels index rows as ``row * C``, so inputs must be C-contiguous (views of a fused
    buffer or batch slices of a larger one are copied).
    """
    return xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))


def gemm_accumulate(xp: Any, a: Any, b: Any, out: Any) -> None:
    """``out += a.T @ b`` for 2-D ``a [K, M]``, ``b [K, N]``, ``out [M, N]`` (C or F order).

    On CuPy one cuBLAS GEMM with ``beta = 1`` (no temporary the size of ``out``); with NumPy
    (the emulated path of the tests) the plain expression.
    """
    if xp is np:
        out += a.T @ b
        return
    import cupy.cublas

    cupy.cublas.gemm("T", "N", a, b, out=out, alpha=1.0, beta=1.0)


def kernel_names(templates: tuple[str, ...], precision: Precision) -> tuple[str, ...]:
    """The instantiations ``name<T>`` of the template kernels ``templates`` for ``precision``'s
    storage type (NVRTC name expressions)."""
    return tuple(f"{name}<{CTYPES[precision]}>" for name in templates)


def refuse_carried_bfloat16(ctx: Any, precision: Precision, who: str) -> None:
    """Raise :class:`OpNotFoundError` for BF16 on a context whose CuPy carries bfloat16 as
    ``uint16`` bits (CuPy < 14): its matrix products and elementwise arithmetic would treat
    the bits as integers.

    Raises:
        OpNotFoundError: naming the op, with FP32 and FP16 as the precisions that work.
    """
    if precision is Precision.BF16 and not getattr(ctx, "bfloat16_native", True):
        error = OpNotFoundError(
            f"{who}: BF16 needs CuPy arrays of ml_dtypes.bfloat16 (CuPy >= 14); this CuPy "
            "carries bfloat16 as uint16 bits"
        )
        error.other_precisions = frozenset({Precision.FP32, Precision.FP16})
        raise error


class KernelOp(Operation):
    """A CUDA op whose kernel file ``FILE`` holds templates over the storage type: ``TEMPLATES``
    are launched as their instantiation for the op's precision (:meth:`_launch`); other kernels
    of the file (``extern "C"``) by their own names.

    Raises:
        OpNotFoundError: BF16 on a CuPy without bfloat16 (see
            :func:`refuse_carried_bfloat16`).
    """

    FILE: ClassVar[str]
    TEMPLATES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, context: Any, config: Any, precision: Precision) -> None:
        refuse_carried_bfloat16(context, precision, type(self).__name__)
        super().__init__(context, config, precision)
        self._names = kernel_names(self.TEMPLATES, precision)
        self._instance = dict(zip(self.TEMPLATES, self._names, strict=True))
        self.dtype = np.dtype(precision.numpy_dtype)

    def _launch(
        self, name: str, grid: tuple[int, ...], block: int, args: tuple[Any, ...], **kw: Any
    ) -> None:
        """:func:`launch` of kernel ``name`` of ``FILE`` (a template's instantiation for this
        op's precision) on the op's context."""
        name = self._instance.get(name, name)
        launch(self.context, self.FILE, name, grid, block, args, name_expressions=self._names, **kw)

    def _storage(self, x: Any) -> Any:
        """``x`` in the op's storage dtype: itself, or a converted copy (a float32 gradient
        handed to a 16-bit op)."""
        return as_dtype(self.context.xp, x, self.dtype)


def as_dtype(xp: Any, x: Any, dtype: Any) -> Any:
    """``x`` itself when it has ``dtype``, else ``x.astype(dtype)`` (rounded to nearest)."""
    return x if x.dtype == dtype else x.astype(dtype)


_REDUCED = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def matmul(xp: Any, a: Any, b: Any, out: Any) -> None:
    """``out = a @ b`` for 2-D ``a``, ``b`` of one float dtype and a C-contiguous ``out`` of
    theirs or a 16-bit one.

    float32 and CuPy's FP16/BF16: one ``xp.matmul`` (cuBLAS; 16-bit operands accumulate in
    float32 and the result is rounded once). With NumPy (the emulated GPU of the tests), 16-bit
    operands are multiplied as float32 copies and the product rounded once, as cuBLAS does.
    """
    if xp is np and out.dtype in _REDUCED:
        # the tests' emulated device stands in for cuBLAS here, and refuses as CuPy does
        # where its arrays say so (a stream capturing a graph)
        refuse = getattr(out, "library_call", None)
        if refuse is not None:
            refuse("cuBLAS")
        out[...] = np.matmul(a.astype(np.float32), b.astype(np.float32))
        return
    xp.matmul(a, b, out=out)  # (float32 operands into a 16-bit out: cast once, by CuPy)
