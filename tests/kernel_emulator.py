"""Run the CUDA ops of ``mila_py/ops/cuda`` on the CPU: their raw kernels compiled as C++.

:func:`emulated_context` returns an execution context whose array module is NumPy and whose
kernel launches (:func:`mila_py.ops.cuda._kernels.launch`, patched while the context is in
use) run the kernels' own CUDA source, compiled with ``g++`` against ``kernel_emulator.h``:
every block's threads run as fibers with real barriers and warp-shuffle exchanges. So a CUDA
op's host logic (shapes, strides, launch geometry, argument types) and its kernels' indexing
and arithmetic are checked against the CPU ops on a machine without a GPU.

Every launch checks what CuPy would not: each array argument is C-contiguous with the dtype of
its pointer parameter (``float*`` float32, ``long long*`` int64, ``double*`` float64), and each
scalar has the exact NumPy type of its parameter (``int`` int32, ``long long`` int64, ``float``
float32), as a raw kernel reads its arguments by position and width.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceId, DeviceType
from mila_py.devices.execution_context import ExecutionContext
from mila_py.ops.cuda import _kernels

HEADER = Path(__file__).with_name("kernel_emulator.h")
COMPILER = shutil.which("g++")

_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)
_POINTERS = {"float": np.float32, "double": np.float64, "long long": np.int64, "int": np.int32}
_SCALARS = {
    "int": (np.int32, ctypes.c_int),
    "long long": (np.int64, ctypes.c_longlong),
    "float": (np.float32, ctypes.c_float),
    "double": (np.float64, ctypes.c_double),
}


class _Param:
    def __init__(self, text: str) -> None:
        text = " ".join(text.replace("__restrict__", " ").split())
        match = re.fullmatch(r"(?:const )?([a-z ]+?)\s*(\*?)\s*(\w+)", text)
        if match is None:
            raise ValueError(f"kernel emulator: cannot parse parameter {text!r}")
        self.base, self.pointer, self.name = match.group(1), bool(match.group(2)), match.group(3)


class _Kernel:
    def __init__(self, name: str, params: list[_Param], function: Any) -> None:
        self.name, self.params, self.function = name, params, function
        function.restype = None
        function.argtypes = [ctypes.c_uint] * 4 + [
            ctypes.c_void_p if p.pointer else _SCALARS[p.base][1] for p in params
        ]

    def __call__(self, grid: tuple[int, ...], block: int, args: tuple[Any, ...]) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        values: list[Any] = []
        for param, arg in zip(self.params, args, strict=True):
            where = f"{self.name}({param.name})"
            if param.pointer:
                if arg is None:
                    values.append(None)
                    continue
                if not isinstance(arg, np.ndarray):
                    raise TypeError(f"{where}: expected an array, got {type(arg).__name__}")
                if arg.dtype != _POINTERS[param.base]:
                    raise TypeError(f"{where}: {param.base}* given a {arg.dtype} array")
                if not arg.flags.c_contiguous:
                    raise ValueError(f"{where}: array is not C-contiguous (strides {arg.strides})")
                values.append(arg.ctypes.data)
            else:
                expected = _SCALARS[param.base][0]
                if type(arg) is not expected:
                    raise TypeError(f"{where}: {param.base} given {type(arg).__name__}")
                values.append(arg.item())
        grid3 = (*grid, 1, 1)[:3]
        if min(grid3) < 1 or block < 1:
            raise ValueError(f"{self.name}: empty launch grid={grid} block={block}")
        self.function(*grid3, block, *values)


class KernelLibrary:
    """Every ``extern "C"`` kernel of the given CUDA sources, compiled for the CPU."""

    def __init__(self, sources: list[str]) -> None:
        if COMPILER is None:
            raise RuntimeError("the kernel emulator needs g++")
        kernels: list[tuple[str, list[_Param]]] = []
        for source in sources:
            for match in _KERNEL.finditer(source):
                params = [_Param(p) for p in match.group(2).split(",") if p.strip()]
                kernels.append((match.group(1), params))
        wrappers = []
        for name, params in kernels:
            decl = ", ".join(
                f"{'const ' if p.pointer else ''}{p.base}{'*' if p.pointer else ''} {p.name}"
                for p in params
            )
            call = ", ".join(
                f"const_cast<{p.base}*>({p.name})" if p.pointer else p.name for p in params
            )
            wrappers.append(
                f'extern "C" void emu_{name}(unsigned gx, unsigned gy, unsigned gz, '
                f"unsigned bx{', ' if decl else ''}{decl}) {{\n"
                f"    mila_emu::launch(dim3{{gx, gy, gz}}, dim3{{bx, 1, 1}}, "
                f"[&] {{ {name}({call}); }});\n}}\n"
            )
        code = "\n".join([f'#include "{HEADER}"', _kernels.CUDA_PRELUDE, *sources, *wrappers])
        digest = hashlib.sha256((code + HEADER.read_text()).encode()).hexdigest()[:16]
        build = Path(tempfile.gettempdir()) / "mila_py_kernel_emulator"
        build.mkdir(exist_ok=True)
        library = build / f"kernels_{digest}.so"
        if not library.exists():
            source_file = build / f"kernels_{digest}.cpp"
            source_file.write_text(code)
            partial = build / f"kernels_{digest}.{id(self)}.tmp"
            subprocess.run(
                [COMPILER, "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared",
                 "-U_FORTIFY_SOURCE", "-Wno-unknown-pragmas", "-o", str(partial), str(source_file)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            partial.replace(library)
        handle = ctypes.CDLL(str(library))
        self.kernels = {
            name: _Kernel(name, params, getattr(handle, f"emu_{name}")) for name, params in kernels
        }

    def launch(
        self, ctx: Any, source: str, name: str, grid: tuple[int, ...], block: int, args: tuple
    ) -> None:
        """Drop-in for :func:`mila_py.ops.cuda._kernels.launch`."""
        self.kernels[name](grid, block, args)


class EmulatedContext(ExecutionContext):
    """A CUDA-like execution context over NumPy arrays (host memory, synchronous)."""

    def __init__(self) -> None:
        self.device_id = DeviceId(DeviceType.CUDA, 0)
        self.xp = np
        self.stream = None
        self.launches: list[str] = []

    def activate(self) -> Any:
        return contextlib.nullcontext(self)

    def synchronize(self) -> None:
        """Everything ran already."""

    def allocate(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = True) -> np.ndarray:
        return np.zeros(shape, dtype=dtype) if zero else np.empty(shape, dtype=dtype)

    def is_device_array(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def to_device(self, array: Any) -> np.ndarray:
        return np.array(array, copy=True)


@contextlib.contextmanager
def emulated_context(library: KernelLibrary) -> Iterator[EmulatedContext]:
    """An :class:`EmulatedContext`, with every kernel launch of the CUDA ops emulated meanwhile."""
    ctx = EmulatedContext()
    original = _kernels.launch

    def launch(c: Any, source: str, name: str, grid: tuple[int, ...], block: int, args: tuple):
        assert c is ctx, "a CUDA op launched on another context"
        ctx.launches.append(name)
        library.launch(c, source, name, grid, block, args)

    _kernels.launch = launch  # type: ignore[assignment]
    try:
        yield ctx
    finally:
        _kernels.launch = original  # type: ignore[assignment]


@contextlib.contextmanager
def emulated_cuda_devices(library: KernelLibrary) -> Iterator[None]:
    """While active, ``"CUDA:0"`` components get :class:`EmulatedContext` s and the CUDA ops.

    Every CUDA op of the registry runs (kernels emulated) except RoPE, whose CUDA op compiles
    its own kernels with CuPy: the CPU RopeOp stands in for it (it is checked on GPUs by
    ``tests/cuda/test_rope_cuda.py``). RoPE tables made meanwhile are dropped on exit.
    """
    from mila_py import component as component_module
    from mila_py.components import clear_rope_cache
    from mila_py.devices import cuda as cuda_module
    from mila_py.ops import registry
    from mila_py.ops.cpu.rope import CpuRopeOp

    registry.registered_ops()  # load every op module before patching the table
    key = ("RopeOp", DeviceType.CUDA)
    saved_rope = registry._REGISTRY[key]
    saved = (component_module.create_execution_context, cuda_module.shared_context, _kernels.launch)
    real_factory = saved[0]

    def create(device: Any) -> ExecutionContext:
        device_id = DeviceId.parse(device)
        return (
            EmulatedContext() if device_id.device_type is DeviceType.CUDA else real_factory(device)
        )

    clear_rope_cache()
    registry._REGISTRY[key] = registry.RegisteredOp(
        "RopeOp", DeviceType.CUDA, saved_rope.precisions, CpuRopeOp
    )
    component_module.create_execution_context = create  # type: ignore[assignment]
    cuda_module.shared_context = lambda device: EmulatedContext()  # type: ignore[assignment]
    _kernels.launch = library.launch  # type: ignore[assignment]
    try:
        yield
    finally:
        registry._REGISTRY[key] = saved_rope
        (
            component_module.create_execution_context,
            cuda_module.shared_context,
            _kernels.launch,
        ) = saved  # type: ignore[assignment]
        clear_rope_cache()
