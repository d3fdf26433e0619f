"""Run the CUDA ops of ``mila_py/ops/cuda`` on the CPU: their raw kernels compiled as C++.

:func:`emulated_context` returns an execution context whose array module is NumPy and whose
kernel launches (:func:`mila_py.ops.cuda._kernels.launch`, patched while the context is in
use) run the kernels' own CUDA source, compiled with ``g++`` against ``kernel_emulator.h``:
every block's threads run as fibers with real barriers and warp-shuffle exchanges. So a CUDA
op's host logic (shapes, strides, launch geometry, argument types) and its kernels' indexing
and arithmetic are checked against the CPU ops on a machine without a GPU.

The sources are the ops' own kernel files, read through :func:`mila_py.ops.cuda._kernels.source`
(each compiled after the shared header ``common.cuh``, as the ops compile them). Kernels are
``extern "C"`` functions, or templates whose instantiations are named as NVRTC name expressions
(``rope_qk<float, 4, false>``), given to :class:`KernelLibrary` as CuPy's RawModule takes them.
Three mechanical rewrites make a source C++: ``extern __shared__`` arrays become the launch's
dynamic shared memory, the PTX instructions of :data:`PTX` (inline ``asm``) become calls to
their bit-exact emulations (any other ``asm`` is refused), and ``reinterpret_cast`` checks the
alignment the GPU requires (a misaligned vector access raises).

Every launch checks what CuPy would not: the kernel file it names defines the kernel; each
array argument has a dtype of its pointer parameter (``float*`` float32, ``int*`` int32,
``long long*`` int64, ``mila_bf16*`` bfloat16 or its uint16 bits, ...), is C-contiguous unless
the parameter is marked ``MILA_STRIDED`` (the kernel takes its strides), and is writeable
unless the parameter is ``const``; a null pointer is ``_kernels.NULL`` (CuPy does not pass
``None`` as NULL everywhere); each scalar has the exact NumPy type of its parameter (``int``
int32, ``long long`` int64, ``float`` float32), as a raw kernel reads its arguments by position
and width. The block size must respect
``__launch_bounds__`` and the dynamic shared memory the default 48 KiB limit. And each launch
runs on fenced copies of its arrays (:class:`_Fences`): poison (signaling NaNs of the arrays'
type) before and after every array and in the gaps of strided views, so an out-of-bounds read
gives NaN where a GPU would read a neighbour's values unseen, and an out-of-bounds write raises.

One difference is left: CuPy compiles raw kernels with ``-ftz=true``, so on a GPU float32
subnormals (below ~1.2e-38) flush to zero, where the emulation keeps them. The tests' data are
far from that range; a bit-exact comparison of subnormal inputs would differ.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import emulated_cupy
import ml_dtypes
import numpy as np
from emulated_cupy import DeviceArray, Stream, refuse

from mila_py.devices.device import DeviceId, DeviceType
from mila_py.devices.execution_context import ExecutionContext
from mila_py.ops.cuda import _kernels

HEADER = Path(__file__).with_name("kernel_emulator.h")
COMPILER = shutil.which("g++")

_KERNEL = re.compile(
    r"(?:template\s*<(?P<template>[^<>]*)>\s*)?(?P<extern>extern\s+\"C\"\s+)?__global__\s+void\s+"
    r"(?:__launch_bounds__\s*\((?P<bounds>[^()]*)\)\s*)?(?P<name>\w+)\s*\((?P<params>[^)]*)\)",
    re.S,
)
_BF16 = np.dtype(ml_dtypes.bfloat16)
#: dtypes an array may have for a pointer parameter (the raw 16-bit types of ops/cuda/common.cuh:
#: ``mila_bf16`` arrays are bfloat16, or their uint16 bits as CuPy < 14 carries them)
_POINTERS: dict[str, tuple[np.dtype, ...]] = {
    "float": (np.dtype(np.float32),),
    "double": (np.dtype(np.float64),),
    "long long": (np.dtype(np.int64),),
    "int": (np.dtype(np.int32),),
    "unsigned short": (np.dtype(np.uint16),),
    "mila_half": (np.dtype(np.float16),),
    "mila_bf16": (_BF16, np.dtype(np.uint16)),
}
_SCALARS = {
    "int": (np.int32, ctypes.c_int),
    "long long": (np.int64, ctypes.c_longlong),
    "float": (np.float32, ctypes.c_float),
    "double": (np.float64, ctypes.c_double),
}
#: inline PTX the emulator knows: ``asm("<op> %0, %1;" : "=<out>"(y) : "<in>"(x))`` becomes
#: ``y = <function>(x)`` when the constraints match
PTX = {
    "cvt.f32.f16": ("f", "h", "mila_emu::ptx_cvt_f32_f16"),
    "cvt.rn.f16.f32": ("h", "f", "mila_emu::ptx_cvt_rn_f16_f32"),
}
_ASM = re.compile(
    r"\basm\s*(?:volatile\s*)?\(\s*\"\s*(?P<op>[\w.]+)\s+%0\s*,\s*%1\s*;?\s*\"\s*"
    r":\s*\"=(?P<out_c>\w)\"\s*\((?P<out>[^()]*)\)\s*:\s*\"(?P<in_c>\w)\"\s*\((?P<in>[^()]*)\)\s*\)"
)
_EXTERN_SHARED = re.compile(
    r"\bextern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?(?P<type>\w[\w ]*?)\s+"
    r"(?P<name>\w+)\s*\[\s*\]\s*;"
)
#: the default per-block limit of dynamic shared memory (more needs cudaFuncSetAttribute)
MAX_DYNAMIC_SHARED = 48 * 1024
MAX_THREADS = 1024
#: strict aliasing off: kernels move T arrays as aligned structs of T, as CUDA code does
FLAGS = (
    "-std=c++17", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared",
    "-U_FORTIFY_SOURCE", "-Wno-unknown-pragmas",
)  # fmt: skip


def emulable(source: str) -> str:
    """``source`` with the rewrites the module docstring lists (ValueError for unknown asm)."""

    def ptx(match: re.Match[str]) -> str:
        op = match["op"]
        if op not in PTX:
            raise ValueError(f"kernel emulator: no emulation of the PTX instruction {op!r}")
        out_c, in_c, function = PTX[op]
        if (match["out_c"], match["in_c"]) != (out_c, in_c):
            raise ValueError(
                f"kernel emulator: {op} with constraints {match['out_c']!r}/{match['in_c']!r}, "
                f"expected {out_c!r}/{in_c!r}"
            )
        return f"({match['out']}) = {function}({match['in']})"

    source = _ASM.sub(ptx, source)
    left = re.search(r"\basm\b.*", source)
    if left is not None:
        raise ValueError(f"kernel emulator: cannot emulate inline assembly {left.group(0)!r}")
    source = _EXTERN_SHARED.sub(
        lambda m: f"{m['type']}* {m['name']} = mila_emu::dynamic_shared<{m['type']}>();", source
    )
    return re.sub(r"\breinterpret_cast\s*<", "mila_emu::aligned_cast<", source)


class _Param:
    def __init__(self, text: str, types: dict[str, str]) -> None:
        text = text.replace("\n", " ")
        words = text.replace("__restrict__", " ").replace("*", " * ").split()
        self.strided = "MILA_STRIDED" in words
        words = [types.get(w, w) for w in words if w != "MILA_STRIDED"]
        match = re.fullmatch(r"(const )?([A-Za-z_][\w <>]*?) ?(\*?) ?(\w+)", " ".join(words))
        if match is None:
            raise ValueError(f"kernel emulator: cannot parse parameter {text!r}")
        self.const = bool(match.group(1))
        self.base, self.pointer, self.name = match.group(2), bool(match.group(3)), match.group(4)
        if self.pointer and self.base not in _POINTERS:
            raise ValueError(f"kernel emulator: no array dtype for {self.base}* ({text!r})")
        if not self.pointer and self.base not in _SCALARS:
            raise ValueError(f"kernel emulator: no scalar type for {self.base} ({text!r})")
        if self.strided and not self.pointer:
            raise ValueError(f"kernel emulator: MILA_STRIDED on a scalar ({text!r})")


class _Kernel:
    def __init__(
        self, name: str, params: list[_Param], max_threads: int, static_shared: int, function: Any
    ) -> None:
        self.name, self.params, self.function = name, params, function
        self.max_threads = max_threads  # __launch_bounds__, else the GPU's limit
        self.static_shared = static_shared  # bytes of the kernel's own __shared__ arrays
        function.restype = ctypes.c_char_p
        function.argtypes = (
            [ctypes.c_uint] * 4
            + [ctypes.c_size_t]
            + [ctypes.c_void_p if p.pointer else _SCALARS[p.base][1] for p in params]
        )

    def __call__(
        self, grid: tuple[int, ...], block: int, args: tuple[Any, ...], shared_mem: int = 0
    ) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        values: list[Any] = []
        fenced: list[tuple[int, np.ndarray, _Param]] = []
        for param, arg in zip(self.params, args, strict=True):
            where = f"{self.name}({param.name})"
            if param.pointer:
                if arg is None:
                    raise TypeError(f"{where}: None is not NULL for CuPy; pass _kernels.NULL")
                if type(arg) is np.uint64 and arg == _kernels.NULL:
                    values.append(None)
                    continue
                if not isinstance(arg, np.ndarray):
                    raise TypeError(f"{where}: expected an array, got {type(arg).__name__}")
                if arg.dtype not in _POINTERS[param.base]:
                    raise TypeError(f"{where}: {param.base}* given a {arg.dtype} array")
                if not (param.strided or arg.flags.c_contiguous):
                    raise ValueError(f"{where}: array is not C-contiguous (strides {arg.strides})")
                if not (param.const or arg.flags.writeable):
                    raise ValueError(f"{where}: {param.base}* given a read-only array")
                values.append(arg.ctypes.data)
                fenced.append((len(values) - 1, arg, param))
            else:
                expected = _SCALARS[param.base][0]
                if type(arg) is not expected:
                    raise TypeError(f"{where}: {param.base} given {type(arg).__name__}")
                values.append(arg.item())
        grid3 = (*grid, 1, 1)[:3]
        if min(grid3) < 1 or block < 1:
            raise ValueError(f"{self.name}: empty launch grid={grid} block={block}")
        if grid3[0] >= 2**31 or max(grid3[1:]) > 65535:
            raise ValueError(f"{self.name}: grid {grid} exceeds the GPU's limits")
        if block > self.max_threads:
            raise ValueError(
                f"{self.name}: {block} threads per block, the kernel allows {self.max_threads}"
            )
        if not 0 <= shared_mem <= MAX_DYNAMIC_SHARED - self.static_shared:
            raise ValueError(
                f"{self.name}: {shared_mem} bytes of dynamic shared memory beside its "
                f"{self.static_shared} static bytes (at most {MAX_DYNAMIC_SHARED} in all without "
                "opting in)"
            )
        fences = _Fences(self.name, fenced)
        for i, address in fences.addresses.items():
            values[i] = address
        fault = self.function(*grid3, block, shared_mem, *values)
        if fault is not None:
            raise RuntimeError(f"{self.name}: {fault.decode()}")
        fences.check_and_copy_back()


#: bytes of poison on either side of the arrays of a launch (see :data:`_POISON`)
FENCE = 256
#: the fenced copies keep their address modulo this (the op chose its access width by it)
_ALIGN = 256
#: the poison of a fenced copy by its arrays' dtype: signaling NaNs (quieted by arithmetic, so
#: a kernel's write of a value it computed from them changes the bytes); -1 for the rest
_POISON = {
    np.dtype(np.float32): np.array(0x7FA00000, np.uint32).tobytes(),
    np.dtype(np.float64): np.array(0x7FF4000000000000, np.uint64).tobytes(),
    np.dtype(np.float16): np.array(0x7D00, np.uint16).tobytes(),
    _BF16: np.array(0x7FA0, np.uint16).tobytes(),
}


class _Fences:
    """The array arguments of one launch, moved into poisoned memory for it, so that what a GPU
    would let pass unseen fails here. Arrays whose bytes overlap (``q`` and ``q_out`` in place)
    share one copy, as on the GPU. Each copy holds the arrays' element bytes and poison
    everywhere else: ``FENCE`` bytes before and after, and the gaps of strided views (the V of a
    fused QKV buffer seen through Q's view). The poison is a signaling NaN of the arrays' float
    type (-1 for integers): a kernel that reads it gets NaN, which the tests' comparisons
    catch, and arithmetic on it gives a quiet NaN, other bytes. A kernel that changes a byte
    outside its arrays fails the launch with :class:`RuntimeError`; a copy's element bytes go
    back where any of its arrays is a writeable (non-``const``) parameter, nothing else does."""

    def __init__(self, kernel: str, arrays: list[tuple[int, np.ndarray, _Param]]) -> None:
        self.kernel = kernel
        self.addresses: dict[int, int] = {}  # value index -> the address in the fenced copy
        spans = []
        for i, array, param in arrays:
            lo, hi = _byte_extent(array)
            if hi > lo:
                start = array.ctypes.data + lo
                spans.append([start, start + hi - lo, [(i, array, param)]])
        spans.sort(key=lambda span: span[0])
        merged: list[list[Any]] = []
        for span in spans:
            if merged and span[0] < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], span[1])
                merged[-1][2] += span[2]
            else:
                merged.append(span)
        self.copies = [self._fence(start, end, members) for start, end, members in merged]

    def _fence(
        self, start: int, end: int, members: list[tuple[int, np.ndarray, _Param]]
    ) -> _FencedCopy:
        size = end - start
        original = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(start))
        buffer = np.empty(size + 2 * FENCE + _ALIGN, dtype=np.uint8)
        offset = FENCE + (start - (buffer.ctypes.data + FENCE)) % _ALIGN
        poison = _POISON.get(members[0][1].dtype, b"\xff")  # in step with the elements
        repeated = np.frombuffer(poison * (buffer.size // len(poison) + 2), np.uint8)
        phase = -offset % len(poison)
        buffer[...] = repeated[phase : phase + buffer.size]
        inner = buffer[offset : offset + size]
        for i, array, _ in members:
            self.addresses[i] = inner.ctypes.data + (array.ctypes.data - start)
        # the bytes of the arrays' elements, and of the writeable (non-const) ones among them;
        # None where that is every byte of the span (no gaps)
        elements = self._bytes(start, size, [a for _, a, _ in members])
        writers = [a for _, a, param in members if not param.const]
        writable: np.ndarray | bool | None = elements
        if not writers:  # inputs alone: a const pointer cannot write (no check, nothing back)
            writable = False
        elif len(writers) < len(members):  # const arrays beside writeable ones
            writable = self._bytes(start, size, writers)
        if elements is None:
            inner[...] = original
        else:
            inner[elements] = original[elements]
        before = inner.copy() if isinstance(writable, np.ndarray) else None
        fences = buffer[:offset].copy(), buffer[offset + size :].copy()
        names = ", ".join(param.name for _, _, param in members)
        return _FencedCopy(buffer, inner, original, writable, before, fences, names)

    @staticmethod
    def _bytes(start: int, size: int, arrays: list[np.ndarray]) -> np.ndarray | None:
        """The bytes of ``arrays``' elements in the span of ``size`` bytes at ``start``, as a
        bool mask, or None where they are all of it."""
        if len(arrays) == 1 and arrays[0].nbytes == size and arrays[0].flags.c_contiguous:
            return None
        mask = np.zeros(size, dtype=bool)
        for array in arrays:
            _byte_view(mask, array.ctypes.data - start, array)[...] = True
        return None if mask.all() else mask

    def check_and_copy_back(self) -> None:
        for c in self.copies:
            start = c.inner.ctypes.data - c.buffer.ctypes.data
            stray = int(np.count_nonzero(c.buffer[:start] != c.fences[0]))
            stray += int(np.count_nonzero(c.buffer[start + c.inner.size :] != c.fences[1]))
            if isinstance(c.writable, np.ndarray):
                stray += int(np.count_nonzero((c.inner != c.before) & ~c.writable))
            if stray:
                raise RuntimeError(
                    f"{self.kernel}: wrote outside the elements of its writeable array "
                    f"argument(s) among {c.names}: {stray} bytes changed past their ends, in "
                    "the gaps of a strided view or in a const array"
                )
        for c in self.copies:
            if c.writable is None:
                c.original[...] = c.inner
            elif c.writable is not False:
                np.copyto(c.original, c.inner, where=c.writable)


class _FencedCopy(NamedTuple):
    buffer: np.ndarray  # the poisoned allocation
    inner: np.ndarray  # its bytes in place of the arrays' span
    original: np.ndarray  # the span's bytes where the arrays live
    #: the non-const arrays' element bytes: a mask, None for the whole span, False for none
    writable: np.ndarray | bool | None
    before: np.ndarray | None  # ``inner`` before the launch, where ``writable`` is a mask
    fences: tuple[np.ndarray, np.ndarray]  # the poison before and after ``inner``
    names: str  # the parameters it serves


def _byte_extent(array: np.ndarray) -> tuple[int, int]:
    """Bytes from ``array``'s first element's address to the lowest and past the highest byte
    of its elements: ``(lo, hi)``, ``lo <= 0 < hi`` (``(0, 0)`` for an empty array)."""
    if array.size == 0:
        return 0, 0
    lo = sum(min(0, (n - 1) * st) for n, st in zip(array.shape, array.strides, strict=True))
    hi = sum(max(0, (n - 1) * st) for n, st in zip(array.shape, array.strides, strict=True))
    return lo, hi + array.itemsize


def _byte_view(raw: np.ndarray, at: int, array: np.ndarray) -> np.ndarray:
    """The bytes of ``array``'s elements within ``raw`` (uint8 or bool), whose byte ``at``
    is ``array``'s first element: a view ``[*shape, itemsize]``."""
    return np.lib.stride_tricks.as_strided(
        raw[at:], shape=(*array.shape, array.itemsize), strides=(*array.strides, 1)
    )


_SHARED_ARRAY = re.compile(
    r"(?<!extern )__shared__\s+([A-Za-z_][\w ]*?)\s+\w+\s*((?:\[\s*\d+\s*\]\s*)+);"
)
_SIZES = {"float": 4, "double": 8, "int": 4, "unsigned int": 4, "long long": 8, "unsigned short": 2}


def _static_shared(source: str, start: int) -> int:
    """Bytes of the fixed-size ``__shared__`` arrays in the body of the kernel whose signature
    ends at ``start`` in ``source`` (the braces after it, matched)."""
    open_at = source.index("{", start)
    depth, end = 0, open_at
    for end in range(open_at, len(source)):
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        if depth == 0:
            break
    body = source[open_at:end]
    if "__shared__" in body.replace("extern __shared__", "") and not _SHARED_ARRAY.search(body):
        raise ValueError("kernel emulator: a __shared__ declaration it cannot size")
    return sum(
        _SIZES[t.strip()] * math.prod(int(n) for n in re.findall(r"\d+", dims))
        for t, dims in _SHARED_ARRAY.findall(body)
    )


def _template_args(expression: str) -> tuple[str, list[str]]:
    """``"rope_qk<float, 4, false>"`` -> ``("rope_qk", ["float", "4", "false"])``."""
    match = re.fullmatch(r"\s*(\w+)\s*<([^<>]*)>\s*", expression)
    if match is None:
        raise ValueError(f"kernel emulator: cannot parse the name expression {expression!r}")
    return match.group(1), [a.strip() for a in match.group(2).split(",")]


class KernelLibrary:
    """The given CUDA sources' kernels, compiled for the CPU (one shared library, cached on disk).

    Args:
        sources: kernel sources (each is compiled after the ops' header ``common.cuh``, as
            ``_kernels`` compiles them).
        name_expressions: the template instantiations to compile, as the ops name them at launch.
    """

    def __init__(self, sources: Sequence[str], name_expressions: Sequence[str] = ()) -> None:
        if COMPILER is None:
            raise RuntimeError("the kernel emulator needs g++")
        found: dict[str, tuple[re.Match[str], str | None, str]] = {}
        kernels: list[tuple[str, str, list[_Param], int, int]] = []  # launch name, callee, ...
        for source in sources:
            for match in _KERNEL.finditer(source):
                found[match["name"]] = (match, match["template"], source)
                if match["extern"] and match["template"] is None:
                    kernels.append(
                        (match["name"], match["name"], *self._signature(match, {}, source))
                    )
                elif match["template"] is None:
                    raise ValueError(
                        f'kernel emulator: __global__ {match["name"]} is neither extern "C" nor '
                        "a template"
                    )
        for expression in name_expressions:
            base, args = _template_args(expression)
            if base not in found or found[base][1] is None:
                raise ValueError(f"kernel emulator: no template kernel {base!r} for {expression!r}")
            match, template, where = found[base]
            names = [p.split()[-1] for p in template.split(",")]  # type: ignore[union-attr]
            kinds = [p.split()[0] for p in template.split(",")]  # type: ignore[union-attr]
            typenames = ("typename", "class")
            if len(args) != len(names):
                raise ValueError(f"kernel emulator: {expression!r} for template <{template}>")
            types = {n: a for n, a, k in zip(names, args, kinds, strict=True) if k in typenames}
            callee = f"{base}<{', '.join(args)}>"
            kernels.append((expression, callee, *self._signature(match, types, where)))
        wrappers = []
        for i, (_, callee, params, _, _) in enumerate(kernels):
            decl = "".join(
                f", {'const ' if p.pointer else ''}{p.base}{'*' if p.pointer else ''} {p.name}"
                for p in params
            )
            call = ", ".join(
                f"const_cast<{p.base}*>({p.name})" if p.pointer else p.name for p in params
            )
            wrappers.append(
                f'extern "C" const char* emu_{i}(unsigned gx, unsigned gy, unsigned gz, '
                f"unsigned bx, std::size_t shared{decl}) {{\n"
                f"    return mila_emu::launch(dim3{{gx, gy, gz}}, dim3{{bx, 1, 1}}, shared, "
                f"[&] {{ {callee}({call}); }});\n}}\n"
            )
        body = [emulable(_kernels.source(_kernels.HEADER)), *(emulable(s) for s in sources)]
        code = "\n".join([f'#include "{HEADER}"', *body, *wrappers])
        library = self._compile(code)
        handle = ctypes.CDLL(str(library))
        self.kernels = {
            name: _Kernel(name, params, bounds, static, getattr(handle, f"emu_{i}"))
            for i, (name, _, params, bounds, static) in enumerate(kernels)
        }

    @staticmethod
    def _signature(
        match: re.Match[str], types: dict[str, str], source: str
    ) -> tuple[list[_Param], int, int]:
        """Parameters, the most threads a block may have, and the bytes of the kernel's own
        (static, fixed-size) ``__shared__`` arrays, which count against the 48 KiB too.
        ``types``: the instantiation's type template arguments."""
        params = [_Param(p, types) for p in match["params"].split(",") if p.strip()]
        bounds = match["bounds"]
        max_threads = MAX_THREADS if bounds is None else int(bounds.split(",")[0])
        return params, max_threads, _static_shared(source, match.end())

    @staticmethod
    def _compile(code: str) -> Path:
        key = "\n".join([*FLAGS, HEADER.read_text(), code])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        build = Path(tempfile.gettempdir()) / "mila_py_kernel_emulator"
        build.mkdir(exist_ok=True)
        library = build / f"kernels_{digest}.so"
        if not library.exists():
            source_file = build / f"kernels_{digest}.cpp"
            source_file.write_text(code)
            partial = build / f"kernels_{digest}.{id(code)}.tmp"
            result = subprocess.run(
                [COMPILER, *FLAGS, "-o", str(partial), str(source_file)],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise RuntimeError(
                    f"kernel emulator: g++ failed on {source_file}:\n{result.stderr}"
                )
            partial.replace(library)
        return library

    def launch(
        self,
        ctx: Any,
        file: str,
        name: str,
        grid: tuple[int, ...],
        block: int,
        args: tuple,
        *,
        shared_mem: int = 0,
        name_expressions: tuple[str, ...] = (),
    ) -> None:
        """Drop-in for :func:`mila_py.ops.cuda._kernels.launch`."""
        if "<" in name and name not in name_expressions:
            raise ValueError(
                f"{name}: a template instantiation must be among the launch's name_expressions "
                f"{name_expressions} (NVRTC compiles only those)"
            )
        if name not in self.kernels:
            raise KeyError(
                f"kernel emulator: {name!r} is not compiled; give KernelLibrary its source "
                "(and template instantiations as name_expressions)"
            )
        self.kernels[name](grid, block, args, shared_mem)


class EmulatedContext(ExecutionContext):
    """A CUDA-like execution context over NumPy arrays (host memory, synchronous).

    Its arrays are :class:`emulated_cupy.DeviceArray` s and its stream an
    :class:`emulated_cupy.Stream`, which captures CUDA graphs as a GPU does (the kernel
    launches and the array work of a capture recorded, not run; see ``emulated_cupy``).

    ``bfloat16_native = False`` (on the class or an instance) plays a CuPy older than 14: BF16
    arrays are carried as their ``uint16`` bits, as :class:`CudaExecutionContext` does there.
    """

    bfloat16_native = True

    def __init__(self) -> None:
        self.device_id = DeviceId(DeviceType.CUDA, 0)
        self.xp = np
        self.stream = Stream()
        self.launches: list[str] = []

    def activate(self) -> Any:
        return contextlib.nullcontext(self)

    def synchronize(self) -> None:
        """Everything ran already."""
        refuse("a context synchronized (it waits for work that is only being recorded)")

    def storage_dtype(self, dtype: Any) -> np.dtype:
        """``uint16`` for bfloat16 when ``bfloat16_native`` is False, else ``dtype``."""
        dt = np.dtype(dtype)
        return np.dtype(np.uint16) if dt == _BF16 and not self.bfloat16_native else dt

    def allocate(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = True) -> np.ndarray:
        refuse("a context allocated device memory")
        dt = self.storage_dtype(dtype)
        array = np.zeros(shape, dtype=dt) if zero else np.empty(shape, dtype=dt)
        return array.view(DeviceArray)

    def is_device_array(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def to_device(self, array: Any) -> np.ndarray:
        refuse("a copy of host data to the device (and an allocation)")
        return np.array(array, copy=True).view(DeviceArray)

    def to_host(self, array: Any) -> np.ndarray:
        refuse("a copy of device memory to the host")
        return np.array(np.asarray(array), copy=True)


def _launch_or_record(library: KernelLibrary, c: Any, *launch: Any, **kw: Any) -> None:
    """Run an emulated launch, or record it in the capture under way on ``c``'s stream (a
    launch on another stream during a capture is refused, as relaxed capture refuses launches
    that would order against it)."""
    stream = emulated_cupy.capturing()
    name = launch[1]
    if stream is None:
        c.launches.append(name)
        library.launch(c, *launch, **kw)
        return
    if c.stream is not stream:
        raise emulated_cupy.CaptureError(
            f"{name}: launched on another stream than the one capturing a graph"
        )

    def replay() -> None:
        c.launches.append(name)
        library.launch(c, *launch, **kw)

    stream.record(replay)


@contextlib.contextmanager
def emulated_context(library: KernelLibrary) -> Iterator[EmulatedContext]:
    """An :class:`EmulatedContext`, with every kernel launch of the CUDA ops emulated meanwhile."""
    ctx = EmulatedContext()
    original = _kernels.launch

    def launch(c: Any, file: str, name: str, grid: tuple, block: int, args: tuple, **kw: Any):
        assert c is ctx, "a CUDA op launched on another context"
        check_file(file, name)
        _launch_or_record(library, c, file, name, grid, block, args, **kw)

    _kernels.launch = launch  # type: ignore[assignment]
    try:
        yield ctx
    finally:
        _kernels.launch = original  # type: ignore[assignment]


@contextlib.contextmanager
def emulated_cuda_devices(library: KernelLibrary) -> Iterator[None]:
    """While active, ``"CUDA:0"`` components get :class:`EmulatedContext` s and the CUDA ops.

    Every CUDA op of the registry runs with its kernels emulated (``library`` must hold them;
    each context records its launches). RoPE tables made meanwhile are NumPy arrays: they are
    dropped on exit, as are any made before (which a CUDA Rope must not pick up).
    """
    from mila_py import component as component_module
    from mila_py import devices as devices_module
    from mila_py.components import clear_rope_cache
    from mila_py.devices import cuda as cuda_module
    from mila_py.ops import registry

    registry.registered_ops()  # load every op module
    saved = (
        component_module.create_execution_context,
        devices_module.create_execution_context,
        cuda_module.shared_context,
        _kernels.launch,
    )
    real_factory = saved[0]

    def create(device: Any) -> ExecutionContext:
        device_id = DeviceId.parse(device)
        return (
            EmulatedContext() if device_id.device_type is DeviceType.CUDA else real_factory(device)
        )

    def launch(c: Any, file: str, name: str, grid: tuple, block: int, args: tuple, **kw: Any):
        assert isinstance(c, EmulatedContext), "a CUDA op launched on a real CUDA context"
        check_file(file, name)
        _launch_or_record(library, c, file, name, grid, block, args, **kw)

    clear_rope_cache()
    component_module.create_execution_context = create  # type: ignore[assignment]
    devices_module.create_execution_context = create  # type: ignore[assignment]
    cuda_module.shared_context = lambda device: EmulatedContext()  # type: ignore[assignment]
    _kernels.launch = launch  # type: ignore[assignment]
    try:
        yield
    finally:
        (
            component_module.create_execution_context,
            devices_module.create_execution_context,
            cuda_module.shared_context,
            _kernels.launch,
        ) = saved  # type: ignore[assignment]
        clear_rope_cache()


#: every CUDA op's kernel file, in ``mila_py/ops/cuda``
FILES = (
    "rms_norm.cu",
    "swiglu.cu",
    "token_embedding.cu",
    "softmax_cross_entropy.cu",
    "attention.cu",
    "adamw.cu",
    "rope.cu",
    "linear.cu",
)


def check_file(file: str, name: str) -> None:
    """Raise ``ValueError`` unless the kernel file ``file`` defines kernel ``name`` (an
    instantiation's template), as the module NVRTC compiles from it must."""
    base = _template_args(name)[0] if "<" in name else name
    if base not in {m["name"] for m in _KERNEL.finditer(_kernels.source(file))}:
        raise ValueError(f"{name}: no kernel {base!r} in the kernel file {file!r}")


def rope_name_expressions() -> list[str]:
    """Every template instantiation the RoPE op launches: its kernels for every storage
    precision."""
    from mila_py.ops.cuda import rope
    from mila_py.precision import Precision

    precisions = (Precision.FP32, Precision.FP16, Precision.BF16)
    return [name for precision in precisions for name in rope.kernel_names(precision)]


def layer_name_expressions() -> list[str]:
    """Every template instantiation the other CUDA ops launch (:class:`_kernels.KernelOp`'s
    templates, for each precision the op is registered for)."""
    from mila_py.ops import registry

    names: list[str] = []
    for entry in registry.registered_ops():
        cls = entry.cls
        if entry.device_type is DeviceType.CUDA and issubclass(cls, _kernels.KernelOp):
            for precision in sorted(entry.precisions, key=lambda p: p.value):
                names += _kernels.kernel_names(cls.TEMPLATES, precision)
    return names


def linear_name_expressions() -> list[str]:
    """Every template instantiation the Linear op launches (its decode products, for every
    storage precision)."""
    from mila_py.ops.cuda import linear
    from mila_py.precision import Precision

    precisions = (Precision.FP32, Precision.FP16, Precision.BF16)
    return [name for precision in precisions for name in linear.kernel_names(precision)]


#: every CUDA op's kernel source (the files' text), and the template instantiations the ops launch
SOURCES = [_kernels.source(f) for f in FILES]
NAME_EXPRESSIONS = rope_name_expressions() + layer_name_expressions() + linear_name_expressions()


def names_in(source: str) -> list[str]:
    """The template instantiations of :data:`NAME_EXPRESSIONS` whose kernel ``source`` defines."""
    defined = {m["name"] for m in _KERNEL.finditer(source) if m["template"] is not None}
    return [name for name in NAME_EXPRESSIONS if _template_args(name)[0] in defined]


def ops_library() -> KernelLibrary:
    """All the CUDA ops' kernels in one library (built once per process, cached on disk)."""
    global _OPS_LIBRARY
    if _OPS_LIBRARY is None:
        _OPS_LIBRARY = KernelLibrary(SOURCES, NAME_EXPRESSIONS)
    return _OPS_LIBRARY


_OPS_LIBRARY: KernelLibrary | None = None
