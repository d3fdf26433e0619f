"""Vectorizable math for the fused CPU kernels (Numba, the ``jit`` extra).

``exp`` in float32 is :func:`_exp32`, a polynomial that LLVM vectorizes (Numba's ``np.exp`` is a
scalar libm call per element, 5x slower, and made the sigmoid dominate SwiGLU): Cephes' ``expf``
reduction ``x = n ln2 + r`` with ``|r| <= ln2 / 2`` and a degree-7 polynomial for ``e^r``, then
``2^n`` assembled from exponent bits. Within 1.03 ulp of the exact value over the normal range,
within one unit of the smallest subnormal below it, exact inf / 0 / NaN at the ends. float64 uses
``np.exp``. Kernels call ``kernel_exp``, which resolves to one or the other by type.

A kernel that inlines ``kernel_exp`` must not be compiled with ``fastmath`` reassociation (it could
fold the two-part ln2 reduction); reductions that want it (row max, row sum) are separate,
called functions here, so their flags stay off their caller's ``exp``.

Numba's on-disk cache of a kernel is keyed on its own source file, not on the files of what it
inlines: after editing this module, delete the ``*.nbi`` / ``*.nbc`` files in
``mila_py/ops/cpu/__pycache__`` (installed copies are rewritten whole, so they are not affected).

16-bit storage: Numba has no float16 or bfloat16 type, so kernels take FP16 and BF16 arrays as
their ``uint16`` bits (:func:`bits`) and a storage marker ``fmt`` (:func:`storage`: a scalar
whose integer type says the storage, so a kernel compiles once per storage), and convert each
element in registers with :func:`widen` and :func:`narrow`: BF16 widens by shifting its bits
into the top half of a float32 and narrows with round-to-nearest-even (as ``ml_dtypes`` and
PyTorch round; NaN stays a quiet NaN), FP16 with LLVM's ``fpext`` / ``fptrunc`` (F16C
instructions on x86), and float32 or float64 storage passes through. (A marker typed by its
integer width, not the conversion functions as arguments, which Numba's on-disk cache cannot
keep, nor a literal value, whose on-request literal typing failed intermittently.)

Also: :func:`cpu_backend`, the one reader of ``MILA_PY_CPU_BACKEND``, and :func:`backend_allows` /
:func:`enabled`, the switch of the fused ops (see :class:`mila_py.ops.cpu._fused_op.FusedCpuOp`).
Importing this module never fails:
``AVAILABLE`` says whether Numba is installed.
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "AVAILABLE",
    "BACKENDS",
    "BF16_STORAGE",
    "F16_STORAGE",
    "FLOAT_STORAGE",
    "FUSED_DTYPES",
    "REDUCED_DTYPES",
    "backend_allows",
    "bits",
    "compiled",
    "cpu_backend",
    "enabled",
    "exp_rows",
    "kernel_exp",
    "narrow",
    "storage",
    "widen",
]

numba: Any
types: Any
literally: Any
try:
    import numba
    from llvmlite import ir
    from numba import literally, types
    from numba.extending import intrinsic, overload
except ImportError:  # the NumPy paths serve
    numba = types = None

    def _no_literally(obj: Any) -> Any:
        """Numba's ``literally`` (an argument's value becomes a compile-time constant); without
        Numba the kernels run as Python, where it does nothing."""
        return obj

    literally = _no_literally


AVAILABLE = numba is not None


#: the dtypes the fused kernels take
FUSED_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})

#: the 16-bit storage dtypes, which the kernels that take them read as ``uint16`` bits
REDUCED_DTYPES = frozenset({np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})


def bits(x: np.ndarray) -> np.ndarray:
    """``x`` as a kernel takes it: a 16-bit float array as a ``uint16`` view of its bits, any
    other array as it is."""
    return x.view(np.uint16) if x.dtype in REDUCED_DTYPES else x


#: the storage markers of the kernels' ``fmt`` argument, told apart by their integer types
#: (int64, int8, int16), see :func:`storage`; a Python int is the float marker's type
FLOAT_STORAGE, BF16_STORAGE, F16_STORAGE = np.int64(0), np.int8(1), np.int16(2)


def storage(dtype: Any) -> Any:
    """The storage marker a kernel takes for arrays of ``dtype``: :data:`BF16_STORAGE` and
    :data:`F16_STORAGE` for the 16-bit floats (given as their bits, :func:`bits`),
    :data:`FLOAT_STORAGE` for float32 and float64."""
    dt = np.dtype(dtype)
    if dt == np.float16:
        return F16_STORAGE
    if dt == ml_dtypes.bfloat16:
        return BF16_STORAGE
    return FLOAT_STORAGE


def widen(x: Any, fmt: Any) -> Any:
    """Inside the kernels: the stored element ``x`` (storage marker ``fmt``) as the float the
    kernels compute in (float32 for 16-bit storage)."""
    return x


def narrow(v: Any, fmt: Any) -> Any:
    """Inside the kernels: the computed float ``v`` as an element of storage ``fmt`` (a
    marker), rounded to nearest even."""
    return v


#: compiled kernels by (kernel, argument types), see :func:`compiled`
_COMPILED: dict[tuple[Any, ...], Any] = {}


def compiled(kernel: Any, args: tuple[Any, ...]) -> Any:
    """The jitted ``kernel`` compiled for ``args``' types, as a plain function: no per-call
    dispatch, so a decode plan binds it. The function checks little: it must be called with
    arguments of exactly these types."""
    sig = tuple(numba.typeof(a) for a in args)
    key = (id(kernel), sig)
    found = _COMPILED.get(key)
    if found is None:
        kernel.compile(sig)
        found = _COMPILED[key] = kernel.get_overload(sig)
    return found


#: the values of ``MILA_PY_CPU_BACKEND``: ``auto`` (the fused kernels when Numba is installed),
#: ``numpy`` (the NumPy reference paths) or ``fused``
BACKENDS = ("auto", "numpy", "fused")
_BACKEND_VARIABLE = "MILA_PY_CPU_BACKEND"


def cpu_backend() -> str:
    """The CPU backend ``MILA_PY_CPU_BACKEND`` names, read now (``auto`` when unset or empty).

    Case and surrounding spaces are ignored.

    Raises:
        ValueError: a value outside :data:`BACKENDS`, naming the variable and the value.
    """
    raw = os.environ.get(_BACKEND_VARIABLE, "")
    value = raw.strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(
            f"{_BACKEND_VARIABLE}={raw!r} is not a CPU backend; expected one of "
            f"{', '.join(BACKENDS)} (or unset for auto)"
        )
    return value


def backend_allows() -> bool:
    """Numba is installed and ``MILA_PY_CPU_BACKEND`` (read now) is not ``numpy``.

    Raises:
        ValueError: ``MILA_PY_CPU_BACKEND`` is set to an unknown value (see :func:`cpu_backend`).
    """
    return cpu_backend() != "numpy" and AVAILABLE


def enabled(dtype: Any) -> bool:
    """Whether kernels may run now for arrays of ``dtype`` (float32/float64 only)."""
    return backend_allows() and np.dtype(dtype) in FUSED_DTYPES


def kernel_exp(x):
    """``exp`` inside the kernels: :func:`_exp32` for float32, ``np.exp`` otherwise."""
    return np.exp(x)


def _exp32(x):
    xc = min(max(x, np.float32(-104.0)), np.float32(88.75))
    n = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375)  # ln2 in two parts: n * 0.693359375 is exact
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    ni = np.int32(n)
    n1 = ni >> 1  # 2^n = 2^n1 * 2^n2, both factors normal for n in [-150, 128]
    n2 = ni - n1
    y = p * _f32_from_bits((n1 + 127) << 23) * _f32_from_bits((n2 + 127) << 23)
    if x > np.float32(88.72283):  # above log(FLT_MAX)
        y = np.float32(np.inf)
    if x < np.float32(-104.0):  # below half the smallest subnormal
        y = np.float32(0.0)
    if x != x:
        y = x
    return y


def _exp_rows(x, out):
    # x, out [N, C]; the kernels' exp on its own, for the tests
    for r in range(x.shape[0]):
        xr = x[r]
        dst = out[r]
        for i in range(x.shape[1]):
            dst[i] = kernel_exp(xr[i])


def _exp_shifted(x, shift):
    # x = exp(x - shift), in place; a function of its own so that its caller may reassociate
    for i in range(x.size):
        x[i] = kernel_exp(x[i] - shift)


def _row_max(x):
    # eight running maxima: LLVM does not vectorize a max reduction (even with fast-math), but
    # it packs eight independent ones into one vector (2.2x on a causal softmax's rows)
    n = x.size
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = x[0]
    i = 0
    while i + 8 <= n:
        m0 = max(m0, x[i])
        m1 = max(m1, x[i + 1])
        m2 = max(m2, x[i + 2])
        m3 = max(m3, x[i + 3])
        m4 = max(m4, x[i + 4])
        m5 = max(m5, x[i + 5])
        m6 = max(m6, x[i + 6])
        m7 = max(m7, x[i + 7])
        i += 8
    for j in range(i, n):
        m0 = max(m0, x[j])
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


def _row_sum(x):
    total = x.dtype.type(0.0)
    for i in range(x.size):
        total += x[i]
    return total


if AVAILABLE:

    @intrinsic
    def _f32_bits(typingctx, value):
        """The bit pattern of the float32 ``value`` as a uint32."""
        if value != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(value), codegen

    @intrinsic
    def _f16_to_f32(typingctx, bits):
        """The float32 value of the FP16 bit pattern in the low 16 bits of ``bits``."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            value = args[0]
            if bits.bitwidth != 16:
                value = builder.trunc(value, ir.IntType(16))
            return builder.fpext(builder.bitcast(value, ir.HalfType()), ir.FloatType())

        return types.float32(bits), codegen

    @intrinsic
    def _f32_to_f16(typingctx, value):
        """The FP16 bits of the float32 ``value`` rounded to nearest even (inf past the range,
        NaN kept)."""
        if value != types.float32:
            return None

        def codegen(context, builder, signature, args):
            half = builder.fptrunc(args[0], ir.HalfType())
            return builder.bitcast(half, ir.IntType(16))

        return types.uint16(value), codegen

    def _widen_bf16(b):
        return _f32_from_bits(np.uint32(b) << np.uint32(16))

    def _narrow_bf16(v):
        u = _f32_bits(np.float32(v))
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep it, quiet
            return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
        u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
        return np.uint16(u >> np.uint32(16))

    _k_widen_bf16 = numba.njit(inline="always", cache=True)(_widen_bf16)
    # not inlined at the IR level (LLVM inlines it): Numba's IR inlining of its branch into
    # the overloads below trips an internal SSA check that warns on every compilation
    _k_narrow_bf16 = numba.njit(cache=True)(_narrow_bf16)

    @overload(widen, inline="always")
    def _widen_overload(x, fmt):
        if fmt == types.int8:  # BF16_STORAGE
            return lambda x, fmt: _k_widen_bf16(x)
        if fmt == types.int16:  # F16_STORAGE
            return lambda x, fmt: _f16_to_f32(np.uint16(x))
        return lambda x, fmt: x

    @overload(narrow, inline="always")
    def _narrow_overload(v, fmt):
        if fmt == types.int8:  # BF16_STORAGE
            return lambda v, fmt: _k_narrow_bf16(v)
        if fmt == types.int16:  # F16_STORAGE
            return lambda v, fmt: _f32_to_f16(np.float32(v))
        return lambda v, fmt: v

    @intrinsic
    def _f32_from_bits(typingctx, bits):
        """The float32 whose bit pattern is the low 32 bits of the integer ``bits``."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            value = args[0]
            if bits.bitwidth > 32:
                value = builder.trunc(value, ir.IntType(32))
            elif bits.bitwidth < 32:
                value = builder.sext(value, ir.IntType(32))
            return builder.bitcast(value, ir.FloatType())

        return types.float32(bits), codegen

    _k_exp32 = numba.njit(inline="always", cache=True)(_exp32)

    @overload(kernel_exp, inline="always")
    def _exp_overload(x):
        if x == types.float32:
            return lambda x: _k_exp32(x)
        return lambda x: np.exp(x)

    #: no reassociation where exp is inlined; NumPy's error model: x / 0 is inf, not a raised
    #: ZeroDivisionError (which also stops a loop from vectorizing)
    jit_exp = numba.njit(cache=True, fastmath={"contract"}, error_model="numpy")
    exp_rows: Any = jit_exp(_exp_rows)
    k_exp_shifted: Any = jit_exp(_exp_shifted)
    # row reductions: reassociation (and no NaN ordering) lets them vectorize
    _jit_reduce = numba.njit(cache=True, fastmath={"reassoc", "nnan"})
    k_row_max: Any = _jit_reduce(_row_max)
    k_row_sum: Any = _jit_reduce(_row_sum)
else:
    jit_exp = exp_rows = k_exp_shifted = k_row_max = k_row_sum = None
