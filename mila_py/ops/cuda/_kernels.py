"""What the CUDA ops share: compiling and launching raw kernels, block reductions, row views.

Kernel sources are module-level strings of ``extern "C"`` kernels (each op module holds its own),
or of templates launched by their instantiations' names (``rope_qk<float, 4, false>``, listed
up front as NVRTC name expressions), prefixed with :data:`CUDA_PRELUDE`, compiled lazily with
CuPy (NVRTC) and cached per source, name expressions and device. Every launch goes through
:func:`launch`, on the execution context's stream, with scalars passed at explicit widths
(``np.int32``, ``np.int64``, ``np.float32``): CuPy turns a Python int into 64 bits and checks
nothing against the kernel's signature.

The arithmetic that the CPU ops do in float32 is written with ``__fmul_rn``/``__fadd_rn``/
``__fdiv_rn`` where the order of operations matters, so that the compiler does not contract it
into FMAs and the elementwise results follow NumPy's roundings; reductions (sums over a row)
differ from NumPy's pairwise order by a few ulps.

This module never imports CuPy at import time. The helpers take the execution context and use
``ctx.xp``, so that the ops' host-side logic also runs with NumPy arrays (the kernel emulator
of the CPU test suite swaps :func:`launch`; see ``tests/kernel_emulator.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "CUDA_PRELUDE",
    "NULL",
    "NVRTC_OPTIONS",
    "POSITION_CAPACITIES",
    "ROW_THREADS",
    "THREADS",
    "ArraySlot",
    "ScalarSlot",
    "address",
    "bind_launch",
    "bind_on_first_call",
    "bind_packed_launch",
    "bound_scalar",
    "capacity_for",
    "contiguous_rows",
    "device_is_current",
    "gemm_accumulate",
    "grid_1d",
    "kernel",
    "launch",
    "module",
    "pack_params",
    "positions_uploaded",
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
#: the capacities (int32 positions) of the kernels that take positions by value (a
#: ``mila_positions<N>`` parameter, written through an :class:`ArraySlot`): a call with that many
#: positions at most passes them in the launch's parameters (256 B or 2 KiB, within the 4 KiB
#: every GPU takes beside the other arguments) and uploads nothing; more go through device memory
POSITION_CAPACITIES: tuple[int, ...] = (64, 512)
#: NVRTC options of every kernel source (CuPy adds the device's ``-arch``)
NVRTC_OPTIONS = ("--std=c++17",)

CUDA_PRELUDE = r"""
#define MILA_FULL_MASK 0xffffffffu
#define MILA_NEG_INF __uint_as_float(0xff800000u)
// Marks a pointer parameter addressed with strides the kernel is given: its array may be a view
// that is not C-contiguous (the pointer is its first element). Expands to nothing; the kernel
// emulator of the tests accepts such views for these parameters only.
#define MILA_STRIDED

// Positions passed by value: N int32 in a kernel's parameters, which the driver copies when the
// launch is made, so a decode step's positions need no upload (ArraySlot on the host). A kernel
// reads its positions, by value or int64 in device memory (null: none), through these.
template <int N> struct mila_positions { int at[N]; };

__device__ __forceinline__ long long position_of(const long long* __restrict__ p, long long i) {
    return p[i];
}
template <int N>
__device__ __forceinline__ long long position_of(const mila_positions<N>& p, long long i) {
    return p.at[i];
}
__device__ __forceinline__ bool has_positions(const long long* p) { return p != nullptr; }
template <int N>
__device__ __forceinline__ bool has_positions(const mila_positions<N>&) { return true; }

template <typename T>  // float, or double where a sum must not overflow (RMSNorm's squares)
__device__ __forceinline__ T mila_warp_sum(T v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(MILA_FULL_MASK, v, offset);
    }
    return v;
}

__device__ __forceinline__ float mila_warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(MILA_FULL_MASK, v, offset));
    }
    return v;
}

// The sum of v over the block, returned to every thread. blockDim.x is a multiple of 32 (at
// most 1024) and every thread of the block calls it; scratch is __shared__ T[32].
template <typename T>
__device__ __forceinline__ T mila_block_sum(T v, T* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = mila_warp_sum(v);
    __syncthreads();  // an earlier reduction may still be reading scratch
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : T(0);
    return mila_warp_sum(v);
}

// The maximum of v over the block, returned to every thread (same contract as mila_block_sum).
__device__ __forceinline__ float mila_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = mila_warp_max(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : MILA_NEG_INF;
    return mila_warp_max(v);
}

// Replaces s[0 .. n) by exp(s[i] - max(s)) and returns their sum to every thread of the block
// (same contract as mila_block_sum; s may be global or shared memory, its writes published by
// the barriers of the sum). The numerator and denominator of a softmax over s.
__device__ __forceinline__ float mila_block_exp_sum(float* s, long long n, float* scratch) {
    float m = MILA_NEG_INF;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        m = fmaxf(m, s[i]);
    }
    m = mila_block_max(m, scratch);
    float sum = 0.0f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(__fsub_rn(s[i], m));
        s[i] = e;
        sum = __fadd_rn(sum, e);
    }
    return mila_block_sum(sum, scratch);
}
"""

_MODULES: dict[tuple[str, tuple[str, ...], int], Any] = {}
_FUNCTIONS: dict[tuple[str, int, str], Any] = {}


@contextlib.contextmanager
def positions_uploaded() -> Iterator[None]:
    """While active, :data:`POSITION_CAPACITIES` is empty: explicit positions go through device
    memory, as before they went by value (the benchmarks' A/B rows). Ops and fast paths read
    the capacities when they are made and when they launch, so both must happen inside."""
    global POSITION_CAPACITIES
    saved, POSITION_CAPACITIES = POSITION_CAPACITIES, ()
    try:
        yield
    finally:
        POSITION_CAPACITIES = saved


def capacity_for(n: int) -> int | None:
    """The smallest of :data:`POSITION_CAPACITIES` that holds ``n`` positions (None: none does)."""
    for cap in POSITION_CAPACITIES:
        if n <= cap:
            return cap
    return None


def module(source: str, device_index: int, name_expressions: tuple[str, ...] = ()) -> Any:
    """The compiled ``RawModule`` of ``CUDA_PRELUDE + source`` on a device (compiled once).

    Args:
        name_expressions: the template instantiations the module must contain (NVRTC
            instantiates and names only these); empty for sources of ``extern "C"`` kernels.
    """
    key = (source, name_expressions, device_index)
    compiled = _MODULES.get(key)
    if compiled is None:
        import cupy

        compiled = cupy.RawModule(
            code=CUDA_PRELUDE + source,
            options=NVRTC_OPTIONS,
            name_expressions=list(name_expressions) or None,
        )
        with cupy.cuda.Device(device_index):
            compiled.compile()
        compiled = _MODULES.setdefault(key, compiled)
    return compiled


def kernel(
    source: str, name: str, device_index: int, name_expressions: tuple[str, ...] = ()
) -> Any:
    """The launchable kernel ``name`` of ``CUDA_PRELUDE + source`` on a device (compiled once).

    Cached by source text, device and name: ``RawModule.get_function`` builds a new object per
    call. A template instantiation's ``name`` must be one of ``name_expressions``.
    """
    key = (source, device_index, name)
    function = _FUNCTIONS.get(key)
    if function is None:
        import cupy

        compiled = module(source, device_index, name_expressions)
        with cupy.cuda.Device(device_index):  # the kernel loads for the current device
            raw = compiled.get_function(name)
            # the driver-level Function: its __call__ takes shared_mem= and stream= directly
            function = _FUNCTIONS.setdefault(key, getattr(raw, "kernel", raw))
    return function


def launch(
    ctx: Any,
    source: str,
    name: str,
    grid: tuple[int, ...],
    block: int,
    args: tuple[Any, ...],
    *,
    shared_mem: int = 0,
    name_expressions: tuple[str, ...] = (),
) -> None:
    """Launch kernel ``name`` of ``source`` on ``ctx``'s device and stream.

    Args:
        ctx: the op's CUDA execution context.
        grid: blocks per grid dimension (every entry >= 1).
        block: threads per block (1-D blocks).
        args: device arrays and NumPy scalars of the kernel's exact types, in order.
        shared_mem: bytes of dynamic shared memory per block (``extern __shared__``).
        name_expressions: every template instantiation of ``source`` the ops launch (see
            :func:`module`); ``name`` is one of them.
    """
    function = kernel(source, name, ctx.device_id.index, name_expressions)
    function(grid, (block,), args, shared_mem=shared_mem, stream=ctx.stream)


def bind_launch(
    ctx: Any,
    source: str,
    name: str,
    grid: tuple[int, ...],
    block: int,
    *,
    shared_mem: int = 0,
    name_expressions: tuple[str, ...] = (),
) -> Callable[..., None]:
    """:func:`launch` with everything but the arguments fixed: ``call(args)`` launches kernel
    ``name`` on ``ctx``'s stream (the kernel looked up once, for calls made again and again
    such as a decode step's); ``call(args, shared)`` with ``shared`` bytes of dynamic shared
    memory instead of ``shared_mem``. The caller keeps ``ctx``'s device current. With NumPy
    arrays (the kernel emulator) each call goes through :func:`launch`, which the emulator
    swaps."""
    if ctx.xp is np:

        def emulated(args: tuple[Any, ...], shared: int = shared_mem) -> None:
            launch(ctx, source, name, grid, block, args, shared_mem=shared,
                   name_expressions=name_expressions)  # fmt: skip

        return emulated
    function = kernel(source, name, ctx.device_id.index, name_expressions)
    threads, stream = (block,), ctx.stream

    def call(args: tuple[Any, ...], shared: int = shared_mem) -> None:
        function(grid, threads, args, shared_mem=shared, stream=stream)

    return call


def bind_on_first_call(make: Callable[..., Callable[..., None]]) -> Callable[..., None]:
    """A call that makes its launch with ``make(*args)`` at its first call (a bound launch, whose
    module NVRTC compiles then) and calls that with its ``args`` then and after: a module is
    compiled only once it is needed, and a failure to compile raises before any launch."""
    bound: Callable[..., None] | None = None

    def call(*args: Any) -> None:
        nonlocal bound
        if bound is None:
            bound = make(*args)
        bound(*args)

    return call


def pack_params(args: Sequence[Any]) -> tuple[np.ndarray, list[np.ndarray]]:
    """``cuLaunchKernel``'s ``kernelParams`` for ``args``, packed once: ``(params, cells)``,
    where ``cells[i]`` holds argument ``i`` as its C value and ``params`` (``uint64``) their
    addresses. Device arrays (anything with ``.data.ptr``) become their address; NumPy scalars
    keep their exact type; a :class:`ScalarSlot` is its own cell, and an :class:`ArraySlot` its
    struct, so ``slot(value)`` changes the next launch's argument. Keep both alive while a
    launch may use them.

    Raises:
        TypeError: an argument of another kind (a host array, a Python number).
    """
    cells = [_packed_argument(i, arg, emulated=False) for i, arg in enumerate(args)]
    return np.array([c.ctypes.data for c in cells], dtype=np.uint64), cells


def bind_packed_launch(
    ctx: Any,
    source: str,
    name: str,
    grid: tuple[int, ...],
    block: int,
    args: Sequence[Any],
    *,
    shared_mem: int = 0,
    name_expressions: tuple[str, ...] = (),
) -> Callable[[], None]:
    """:func:`bind_launch` with the arguments fixed too: ``call()`` launches kernel ``name`` on
    ``ctx``'s stream by ``cuLaunchKernel`` (CuPy's driver binding) with ``args`` packed once
    (:func:`pack_params`: arrays by their address, so the caller keeps them alive and in
    place; a :class:`ScalarSlot` among them changes per call). No per-call argument conversion
    at all: on an H100 machine such a launch of the RoPE kernel took 4.3 us against 5.2 us for
    CuPy's launch of prebuilt arguments. The caller keeps ``ctx``'s device current; in a
    thread where its context is not current yet, the call makes it current.

    With NumPy arrays (the kernel emulator) each call goes through :func:`launch` with the
    values ``args`` hold then (a :class:`ScalarSlot` its last write). The emulated launch holds
    its arrays weakly, as the packed one holds their addresses alone, and raises where one is
    gone (where a real launch would write freed memory)."""
    if ctx.xp is np:  # each call: launch() with the values the arguments hold then
        getters = [_packed_argument(i, arg, emulated=True) for i, arg in enumerate(args)]

        def emulated() -> None:
            values = tuple(get() for get in getters)
            if any(v is None for v in values):
                raise RuntimeError(f"packed launch of {name}: an array it was bound to is gone")
            launch(ctx, source, name, grid, block, values, shared_mem=shared_mem,
                   name_expressions=name_expressions)  # fmt: skip

        return emulated
    from cupy_backends.cuda.api import driver, runtime

    device = ctx.device_id.index
    function = kernel(source, name, device, name_expressions)
    params, cells = pack_params(args)
    stream = ctx.stream
    protocol = getattr(stream, "__cuda_stream__", None)  # CuPy 14; older CuPy: .ptr
    handle = int(protocol()[1]) if protocol is not None else int(stream.ptr)
    gx, gy, gz = (*grid, 1, 1)[:3]
    fn, address, launch_kernel = function.ptr, params.ctypes.data, driver.launchKernel

    def call(keep: tuple[Any, ...] = (params, cells, function)) -> None:  # keep: what it points to
        try:
            launch_kernel(fn, gx, gy, gz, block, 1, 1, shared_mem, handle, address, 0)
        except driver.CUDADriverError:
            # a thread where the runtime has not made the device's context current yet (it does
            # so lazily, and cuLaunchKernel needs it; CuPy's launch makes it first): make it
            # current and launch again (any other error is raised again)
            runtime.setDevice(device)
            launch_kernel(fn, gx, gy, gz, block, 1, 1, shared_mem, handle, address, 0)

    return call


def _same(value: Any) -> Any:
    return value


def _packed_argument(i: int, arg: Any, *, emulated: bool) -> Any:
    """Argument ``i`` of a packed launch (:func:`pack_params`): its cell, the C value the
    parameters point to; ``emulated`` (NumPy arrays, the kernel emulator), a callable giving
    the value to launch with at each call (an array held weakly: None once it is gone)."""
    if isinstance(arg, ScalarSlot):
        return arg.value if emulated else arg._cell
    if isinstance(arg, ArraySlot):
        return functools.partial(_same, arg.cell) if emulated else arg.cell
    if isinstance(arg, np.generic):
        return functools.partial(_same, arg) if emulated else np.full(1, arg, dtype=arg.dtype)
    if isinstance(arg, np.ndarray):
        if emulated:
            return weakref.ref(arg)
    elif not emulated and hasattr(getattr(arg, "data", None), "ptr"):
        return np.full(1, arg.data.ptr, dtype=np.uint64)
    raise TypeError(
        f"argument {i} ({type(arg).__name__}) is not a device array, a NumPy scalar, a "
        "ScalarSlot or an ArraySlot"
    )


#: cuBLAS ``cublasOperation_t``: the matrix as stored (N), or transposed (T)
OP_N, OP_T = 0, 1


def _gemm_operand(x: Any) -> tuple[int, int] | None:
    """``(op, ld)`` under which cuBLAS (column-major) reads the float32 ``x [R, C]`` (2-D,
    row-major meaning) as ``x^T [C, R]``: op N where its rows are contiguous (the memory is
    ``x^T`` column-major, ``ld`` the row stride), op T where its columns are (the memory is ``x``
    column-major, ``ld`` the column stride); None for other layouts. Axes of length 1 are never
    stepped: their strides do not count, and ``ld`` is then the least cuBLAS accepts."""
    rows, cols = int(x.shape[0]), int(x.shape[1])
    row_stride, col_stride = (int(st) // 4 for st in x.strides)
    if address(x) % 4 or any(
        n > 1 and int(st) % 4 for n, st in zip(x.shape, x.strides, strict=True)
    ):
        return None  # not at whole float32 elements
    if cols == 1 or col_stride == 1:
        ld = cols if rows == 1 else row_stride
        return (OP_N, ld) if ld >= max(1, cols) else None
    if rows == 1 or row_stride == 1:
        ld = rows if cols == 1 else col_stride
        return (OP_T, ld) if ld >= max(1, rows) else None
    return None


def gemm_arguments(a: Any, b: Any, out: Any) -> tuple[int, ...] | None:
    """cuBLAS ``sgemm``'s arguments for ``out [M, N] = a [M, K] @ b [K, N]`` (2-D float32
    views, row-major meaning, any strides cuBLAS can read): ``(op_a, op_b, m, n, k, A, lda, B,
    ldb, C, ldc)`` with A, B, C addresses, computed as ``out^T = b^T a^T`` in cuBLAS's
    column-major terms (``m = N``, ``n = M``). None where that does not apply: another dtype,
    a size 0, an ``out`` whose rows are not contiguous, an operand whose rows and columns are
    both strided."""
    if not (a.dtype == b.dtype == out.dtype == np.float32) or 0 in (*a.shape, *b.shape):
        return None
    (n_m, n_k), n_n = a.shape, b.shape[1]
    if b.shape[0] != n_k or out.shape != (n_m, n_n):
        return None
    first, second, result = _gemm_operand(b), _gemm_operand(a), _gemm_operand(out)
    if first is None or second is None or result is None or result[0] != OP_N:
        return None
    if _overlap(out, a) or _overlap(out, b):  # cuBLAS leaves an aliased product undefined
        return None
    return (
        first[0], second[0], int(n_n), int(n_m), int(n_k),
        address(b), first[1], address(a), second[1], address(out), result[1],
    )  # fmt: skip


def _overlap(x: Any, y: Any) -> bool:
    """Whether the byte spans of arrays ``x`` and ``y`` (first to last element) overlap."""

    def span(z: Any) -> tuple[int, int]:
        low = sum(min(0, (n - 1) * st) for n, st in zip(z.shape, z.strides, strict=True))
        high = sum(max(0, (n - 1) * st) for n, st in zip(z.shape, z.strides, strict=True))
        return address(z) + low, address(z) + high + z.itemsize

    (x0, x1), (y0, y1) = span(x), span(y)
    return x0 < y1 and y0 < x1


def sgemm(ctx: Any, arguments: tuple[int, ...]) -> None:
    """One cuBLAS ``sgemm`` of :func:`gemm_arguments`' ``arguments`` (``alpha`` 1, ``beta`` 0) on
    ``ctx``'s device and current stream (CuPy sets the handle's stream to the current one at
    each call: run it with ``ctx`` active). The kernel emulator swaps this for a NumPy one."""
    bind_gemm_arguments(ctx, arguments)()


def bind_gemm(ctx: Any, a: Any, b: Any, out: Any) -> Callable[[], None] | None:
    """``call()``: ``out [M, N] = a [M, K] @ b [K, N]`` by one cuBLAS ``sgemm`` with every
    argument made here (a decode plan's matrix product, without :func:`cupy.matmul`'s checks
    and dispatch at each call; the arrays are kept alive with it), on ``ctx``'s device and
    current stream (run it with ``ctx`` active). None where :func:`gemm_arguments` does not
    apply. With NumPy arrays (the kernel emulator) each call goes through :func:`sgemm`. The
    callable carries its arguments as ``call.gemm_arguments`` (what a plan's steps are)."""
    arguments = gemm_arguments(a, b, out)
    if arguments is None:
        return None
    if ctx.xp is np:

        def run(keep: tuple[Any, ...] = (a, b, out)) -> None:
            sgemm(ctx, arguments)

    else:
        call = bind_gemm_arguments(ctx, arguments)

        def run(keep: tuple[Any, ...] = (a, b, out)) -> None:
            call()

    run.gemm_arguments = arguments  # type: ignore[attr-defined]
    return run


def bind_gemm_arguments(ctx: Any, arguments: tuple[int, ...]) -> Callable[[], None]:
    """The cuBLAS call of :func:`gemm_arguments`' ``arguments``, its scalars made once
    (``alpha`` 1 and ``beta`` 0 in host memory, the handle's pointer mode set to host at each
    call as CuPy's own calls do). The caller keeps the arrays alive."""
    from cupy.cuda import device as cuda_device
    from cupy_backends.cuda.libs import cublas

    op_a, op_b, m, n, k, a_ptr, lda, b_ptr, ldb, c_ptr, ldc = arguments
    scalars = np.array([1.0, 0.0], dtype=np.float32)  # alpha, beta
    alpha: int | float = scalars.ctypes.data
    beta: int | float = scalars.ctypes.data + 4
    if "float alpha" in (cublas.sgemm.__doc__ or ""):  # a CuPy whose binding takes the values
        alpha, beta = 1.0, 0.0
    handle_of, set_mode, host = cuda_device.get_cublas_handle, cublas.setPointerMode, 0
    gemm = cublas.sgemm

    def call(keep: np.ndarray = scalars) -> None:
        handle = handle_of()
        set_mode(handle, host)  # CUBLAS_POINTER_MODE_HOST: alpha and beta are host values
        gemm(handle, op_a, op_b, m, n, k, alpha, a_ptr, lda, b_ptr, ldb, beta, c_ptr, ldc)

    return call


def bound_scalar(xp: Any, value: np.generic) -> Any:
    """``value`` (a NumPy scalar of the kernel parameter's exact type) as a launch argument made
    once, for launches that pass it again and again.

    CuPy turns every NumPy scalar argument into a C value object at each launch (~0.35 us a
    scalar on a 2-core Xeon VM; the RoPE kernel takes 20) and passes its own argument objects
    through unchanged. This makes that object once: a one-element array passed by value, as
    CuPy's ``cupy.cuda.function.CNumpyArray`` holds it (the array kept alive with it). With
    NumPy (the kernel emulator), or a CuPy without that class, ``value`` itself.
    """
    if xp is np:
        return value
    by_value = _by_value_class()
    if by_value is None:
        return value
    return by_value(np.full(1, value, dtype=value.dtype))


class ScalarSlot:
    """A scalar launch argument that changes at every launch (a decode step's position) without
    a new object per launch: ``slot(value)`` writes ``value`` into a one-element array whose
    CuPy by-value object (made once) is the argument it returns. The driver copies argument
    values when a launch is made, so the next write cannot reach a launched kernel. With NumPy
    (the kernel emulator) or a CuPy without that class, ``slot(value)`` is the NumPy scalar.
    One slot serves one launch at a time (a component's calls are not thread-safe anyway)."""

    __slots__ = ("_arg", "_cell", "_type")

    def __init__(self, xp: Any, scalar_type: type[np.generic]) -> None:
        self._type = scalar_type
        self._cell = np.zeros(1, dtype=scalar_type)
        by_value = None if xp is np else _by_value_class()
        self._arg = None if by_value is None else by_value(self._cell)

    def __call__(self, value: int | float) -> Any:
        self._cell[0] = value  # also a packed launch's parameter (pack_params)
        if self._arg is None:
            return self._type(value)
        return self._arg

    def value(self) -> np.generic:
        """The value last written, as a NumPy scalar of the slot's type."""
        return self._type(self._cell[0])

    def c_value(self) -> Any:
        """A ctypes scalar over the slot's cell: ``c.value = v`` writes what ``slot(v)`` does
        at a fraction of its cost (a packed launch's per-call write). Keep the slot alive."""
        return np.ctypeslib.as_ctypes_type(self._cell.dtype).from_address(self._cell.ctypes.data)


class ArraySlot:
    """A by-value array launch argument that changes at every launch (a decode step's position
    per sequence), passed in the launch's parameters: ``slot(values)`` writes ``values`` into
    the first ``values.size`` elements of a struct of ``capacity`` elements of ``dtype`` (the
    kernel's parameter, e.g. ``mila_positions<capacity>``: ``{ int at[capacity]; }``) and
    returns its launch argument, made once (CuPy's by-value object over the struct, a
    one-element NumPy array of a structured dtype, as CuPy passes such an array). The driver
    copies the parameters when a launch is made, so the next write cannot reach a launched
    kernel and nothing is uploaded. With NumPy (the kernel emulator) the argument is the
    struct array itself. One slot serves one launch at a time."""

    __slots__ = ("_arg", "cell", "values")

    def __init__(self, xp: Any, dtype: Any, capacity: int) -> None:
        #: the struct: one element of a structured dtype with the field ``at``
        self.cell = np.zeros(1, dtype=np.dtype([("at", dtype, (capacity,))]))
        #: its ``capacity`` elements, a view
        self.values = self.cell["at"][0]
        by_value = None if xp is np else _by_value_class()
        self._arg = self.cell if by_value is None else by_value(self.cell)

    @property
    def capacity(self) -> int:
        return int(self.values.shape[0])

    def __call__(self, values: np.ndarray) -> Any:
        """Write ``values`` (any shape, at most :attr:`capacity` elements, cast as C casts
        them: the caller knows they fit) and return the launch argument."""
        if values.ndim == 1:
            self.values[: values.size] = values  # NumPy casts on assignment
        else:
            np.copyto(self.values[: values.size].reshape(values.shape), values, casting="unsafe")
        return self._arg


_BY_VALUE: list[Any] = []


def _by_value_class() -> Any:
    """CuPy's by-value argument class (None if this CuPy has none), looked up once."""
    if not _BY_VALUE:
        try:
            from cupy.cuda.function import CNumpyArray
        except ImportError:  # pragma: no cover - CuPy 14 has it (and passes size-1 arrays by value)
            CNumpyArray = None
        _BY_VALUE.append(CNumpyArray)
    return _BY_VALUE[0]


def device_is_current(ctx: Any) -> bool:
    """True when ``ctx``'s GPU is CuPy's current device (always for NumPy arrays: the emulator).

    A launch needs only that (it names its stream); ``ctx.activate()`` costs more per call.
    """
    if ctx.xp is np:
        return True
    return bool(ctx.xp.cuda.runtime.getDevice() == ctx.device_id.index)


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
