"""The kernel emulator itself (``tests/kernel_emulator.py``): a launch's arguments checked as
a raw kernel would misread them, and reads and writes outside an array's elements caught
where a GPU would silently touch the neighbouring memory."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from kernel_emulator import COMPILER, EmulatedContext, KernelLibrary, emulated_context
from layer_helpers import f32

from mila_py.ops.cuda import _kernels

pytestmark = pytest.mark.skipif(COMPILER is None, reason="the kernel emulator needs g++")


@pytest.fixture
def ctx(library: KernelLibrary) -> Iterator[EmulatedContext]:
    with emulated_context(library) as context:
        yield context


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_launches_check_argument_types(ctx: EmulatedContext, rng) -> None:
    """The emulator rejects what a raw kernel would misread (and so guards the ops' calls)."""
    x = f32(rng, 2, 8)
    good = (x, x.copy(), x.copy(), np.empty(2, np.float32), np.int32(8), np.float32(1e-5))
    file = "rms_norm.cu"
    name = "rms_norm_forward<float>"
    names = (name, "rms_norm_forward<mila_bf16>")

    def launch(args: tuple, kernel_file: str = file, kernel: str = name) -> None:
        _kernels.launch(ctx, kernel_file, kernel, (2,), 32, args, name_expressions=names)

    launch(good)
    with pytest.raises(TypeError, match="int given int"):
        launch((*good[:4], 8, good[5]))
    with pytest.raises(TypeError, match="float64 array"):
        launch((x.astype(np.float64), *good[1:]))
    with pytest.raises(ValueError, match="not C-contiguous"):
        launch((x.T.copy().T, *good[1:]))
    with pytest.raises(ValueError, match="no kernel 'rms_norm_forward' in the kernel file"):
        launch(good, "swiglu.cu")
    with pytest.raises(TypeError, match=r"mila_bf16\* given a float32 array"):
        launch(good, kernel="rms_norm_forward<mila_bf16>")  # the storage type is checked too
    with pytest.raises(ValueError, match="must be among the launch's name_expressions"):
        _kernels.launch(ctx, file, name, (2,), 32, good)


FENCE_SOURCE = r"""
#define MILA_STRIDED
extern "C" __global__ void fence_read(const float* x, float* out, int n, int shift) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i + shift];
}
extern "C" __global__ void fence_write(const float* x, float* out, int n, int shift) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i + shift] = x[i];
}
extern "C" __global__ void fence_rows(
    MILA_STRIDED float* x, int rows, int width, long long stride, int extra) {
    int r = blockIdx.x, c = threadIdx.x;
    if (r < rows && c < width + extra) x[r * stride + c] = x[r * stride + c] + 1.0f;
}
"""


@pytest.fixture(scope="module")
def fence_library() -> KernelLibrary:
    return KernelLibrary([FENCE_SOURCE])


@pytest.mark.parametrize("shift", [-1, 1])
def test_the_emulator_poisons_reads_outside_an_array(fence_library: KernelLibrary, shift: int):
    """A kernel reading one element before or past its array reads poison (a NaN) instead of
    the neighbouring memory a GPU would hand it; within the array it reads the values."""
    ctx = EmulatedContext()
    block = np.arange(10, dtype=np.float32)
    x = block[1:9]  # real memory on either side: the GPU would read 0 or 9 unseen
    out = np.zeros(8, np.float32)
    fence_library.launch(ctx, "", "fence_read", (1,), 32, (x, out, np.int32(8), np.int32(shift)))
    edge = 0 if shift < 0 else 7
    assert np.isnan(out[edge])
    inside = np.delete(np.arange(8), edge)
    assert np.array_equal(out[inside], x[inside + shift])


@pytest.mark.parametrize("shift", [-1, 1])
def test_the_emulator_refuses_writes_outside_an_array(fence_library: KernelLibrary, shift: int):
    """A kernel writing one element before or past its output raises, and neither the output
    nor its neighbours change."""
    ctx = EmulatedContext()
    block = np.zeros(10, np.float32)
    out = block[1:9]
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(
        RuntimeError,
        match=r"wrote outside the elements of its writeable array argument\(s\) among out:",
    ):
        fence_library.launch(ctx, "", "fence_write", (1,), 32,
                             (x, out, np.int32(8), np.int32(shift)))  # fmt: skip
    assert not block.any()
    fence_library.launch(ctx, "", "fence_write", (1,), 32, (x, out, np.int32(8), np.int32(0)))
    assert np.array_equal(out, x) and block[0] == block[9] == 0


def test_the_emulator_keeps_a_const_array_sharing_memory_with_an_output_read_only(
    fence_library: KernelLibrary,
) -> None:
    """A const input and an output over one buffer (overlapping): the kernel's writes to the
    output land, and a write into the bytes that are the input's alone raises, the buffer as
    it was."""
    ctx = EmulatedContext()
    block = np.arange(12, dtype=np.float32)
    x, out = block[:8], block[4:]
    fence_library.launch(ctx, "", "fence_write", (1,), 32, (x, out, np.int32(4), np.int32(0)))
    assert np.array_equal(block, [0, 1, 2, 3, 0, 1, 2, 3, 8, 9, 10, 11])
    before = block.copy()
    with pytest.raises(RuntimeError, match="in a const array"):
        fence_library.launch(ctx, "", "fence_write", (1,), 32,
                             (x, out, np.int32(4), np.int32(-2)))  # fmt: skip
    assert np.array_equal(block, before)


def test_the_emulator_guards_the_gaps_of_a_strided_view(fence_library: KernelLibrary) -> None:
    """Rows of a wider buffer (Q's view of a fused QKV buffer): a kernel touching the columns
    between the view's rows raises and changes nothing; one that keeps to them writes only
    them, the other columns as they were."""
    ctx = EmulatedContext()
    qkv = np.arange(3 * 12, dtype=np.float32).reshape(3, 12)
    before = qkv.copy()
    q = qkv[:, :4]
    args = (q, np.int32(3), np.int32(4), np.int64(12))
    with pytest.raises(RuntimeError, match=r"wrote outside .* gaps of a strided view"):
        fence_library.launch(ctx, "", "fence_rows", (3,), 32, (*args, np.int32(1)))
    assert np.array_equal(qkv, before)
    fence_library.launch(ctx, "", "fence_rows", (3,), 32, (*args, np.int32(0)))
    assert np.array_equal(qkv[:, :4], before[:, :4] + 1)
    assert np.array_equal(qkv[:, 4:], before[:, 4:])
