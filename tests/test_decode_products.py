"""A decode step's products: ``linear.cu``'s ``linear_rows``.

A decode plan's Linear products (at most 16 rows, one per sequence) and its tied head are one
launch each of ``linear_rows`` (``mila_py/ops/cuda/linear.py``), not ``cupy.matmul``: CuPy
refuses cuBLAS calls while a stream captures a CUDA graph, and so does the emulated stream
(``tests/emulated_cupy.py``). Checked on ``CUDA:0`` (a GPU, or the kernel emulator's: the
kernel's 16-byte loads, warp shuffles and 16-bit unpacking only show on a GPU): the kernel
against a float64 product of the same stored values in FP32, BF16 and FP16, for 1 to 16 rows,
on the views the plans pass (rows of larger buffers, at an offset), with and without a bias,
where the 16-byte loads apply and where the scalar fallback does. On the emulator only (it
counts launches and graph replays): a Llama's decode steps captured as graphs in each
precision, their replays equal to the eager step; greedy generation equal to the CPU's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from cuda_arrays import EMULATED, cupy, dev, host, skip_bf16_without_arrays
from kernel_emulator import COMPILER, EmulatedContext
from layer_helpers import move_optional_parameters, never_capture

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Linear, LinearConfig
from mila_py.models import Llama, LlamaConfig
from mila_py.ops.cuda import _kernels
from mila_py.ops.cuda.linear import DECODE_MAX_ROWS, CudaLinearOp

pytestmark = pytest.mark.skipif(COMPILER is None, reason="the kernel emulator needs g++")

PRECISIONS = [Precision.FP32, Precision.BF16, Precision.FP16]
#: one rounding of the storage type (float32: the sum's own roundings dominate)
ULP = {Precision.FP32: 2.0**-20, Precision.BF16: 2.0**-8, Precision.FP16: 2.0**-10}
CFG = LlamaConfig(
    vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)


def stored(rng: Any, precision: Precision, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(precision.numpy_dtype)


def reference(x: Any, w: Any, b: Any) -> np.ndarray:
    """``x W^T + b`` in float64 from the stored values."""
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    return want if b is None else want + np.asarray(b, np.float64)


def agree(actual: Any, expected: np.ndarray, precision: Precision, k_in: int) -> None:
    """Within one rounding of the storage type plus the float32 sum's roundings."""
    a = np.asarray(host(actual), np.float64)
    bound = ULP[precision] * np.abs(expected) + 1e-6 * k_in
    excess = float(np.max(np.abs(a - expected) - bound))
    assert excess <= 0, f"{precision}: off by {np.abs(a - expected).max():.3g} beyond the bound"


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("k_in", [40, 36, 13], ids=["K%8=0", "K%4=0", "K odd"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_rows_matches_float64_on_the_plans_views(
    cuda_ctx: Any, precision: Precision, k_in: int, bias: bool
) -> None:
    """1..16 rows, each in the smallest row tile that holds them, on three views: ``[m, 1, K]``
    rows of a contiguous buffer, rows ``K + 8`` apart at an offset of a row (aligned for the
    16-byte loads where K allows), and a column slice at an offset of 3 elements (never
    aligned: the scalar fallback). N = 37: more than one block, not a multiple of a block's
    outputs. Rows of the output outside the view stay untouched. (On a GPU, the 16-byte loads,
    the warp shuffles and the 16-bit unpacking run as the hardware does them.)"""
    skip_bf16_without_arrays("CUDA:0", precision)
    rng = np.random.default_rng(k_in + 100 * bias)
    n_out, item = 37, precision.numpy_dtype.itemsize
    w = stored(rng, precision, n_out, k_in)
    b = stored(rng, precision, n_out) if bias else None
    op = CudaLinearOp(cuda_ctx, LinearConfig(k_in, n_out, bias=bias), precision)
    gw, gb = dev(w), None if b is None else dev(b)
    ctype = _kernels.CTYPES[precision]
    for m in range(1, DECODE_MAX_ROWS + 1):
        tile = next(t for t in (1, 2, 4, 8, 16) if m <= t)
        big = stored(rng, precision, m + 1, 2, k_in + 8)
        nan = np.full((m + 1, 2, n_out), np.nan, precision.numpy_dtype)
        g_big, g_out_big = dev(big), dev(nan)
        # (host x, its device twin, the output view, whether the 16-byte loads may apply)
        views = [
            (np.ascontiguousarray(big[:m, :1, :k_in]), None, (slice(m), slice(1)), True),
            (big[1:, 1, :k_in], g_big[1:, 1, :k_in], (slice(1, None), 1), True),
            (big[:m, 0, 3 : 3 + k_in], g_big[:m, 0, 3 : 3 + k_in], (slice(m), 0), False),
        ]
        for x, gx, rows, aligned in views:
            gx = dev(x) if gx is None else gx
            out = g_out_big[rows]
            out[...] = dev(nan)[rows]
            before = len(cuda_ctx.launches) if EMULATED else 0
            with cuda_ctx.activate():
                op.bind_forward(gx, gw, gb, out)()
            vec = aligned and k_in % (16 // item) == 0
            if EMULATED:
                kernel = f"linear_rows<{ctype}, {tile}, {'true' if vec else 'false'}>"
                assert cuda_ctx.launches[before:] == [kernel]
            agree(out, reference(x, w, b), precision, k_in)
        assert np.isnan(np.asarray(host(g_out_big)[0, 1], np.float64)).all()


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.name)
def test_a_wide_product_spans_many_blocks_and_loads(cuda_ctx: Any, precision: Precision) -> None:
    """A product longer than one round of 16-byte loads per lane (K = 1040: the unrolled loop
    and its remainder) and wider than a few blocks, for 1, 3 and 9 rows."""
    skip_bf16_without_arrays("CUDA:0", precision)
    rng = np.random.default_rng(5)
    n_out, k_in = 75, 1040
    w = stored(rng, precision, n_out, k_in)
    gw = dev(w)
    op = CudaLinearOp(cuda_ctx, LinearConfig(k_in, n_out), precision)
    for m in (1, 3, 9):
        x = stored(rng, precision, m, 1, k_in)
        out = dev(np.full((m, 1, n_out), np.nan, precision.numpy_dtype))
        with cuda_ctx.activate():
            op.bind_forward(dev(x), gw, None, out)()
        if EMULATED:
            assert cuda_ctx.launches[-1].endswith(", true>")
        agree(out, reference(x, w, None), precision, k_in)


def test_more_rows_or_transposed_weights_stay_on_the_matrix_product(cuda_ctx: Any) -> None:
    """Past 16 rows, and for a weight whose rows are not contiguous (no CUDA build stores one),
    the bound product is the matrix product again: no kernel launch, the same values."""
    rng = np.random.default_rng(2)
    n_in, n_out = 8, 5
    w = stored(rng, Precision.FP32, n_out, n_in)
    op = CudaLinearOp(cuda_ctx, LinearConfig(n_in, n_out), Precision.FP32)
    for x, weight in (
        (stored(rng, Precision.FP32, 17, n_in), dev(w)),
        (stored(rng, Precision.FP32, 2, n_in), cupy.asfortranarray(dev(w))),
    ):
        out = dev(np.empty((x.shape[0], n_out), np.float32))
        with cuda_ctx.activate():
            op.bind_forward(dev(x), weight, None, out)()
        agree(out, reference(x, w, None), Precision.FP32, n_in)
    if EMULATED:
        assert cuda_ctx.launches == []


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.name)
def test_cuda_inference_builds_keep_every_weight_as_out_in_rows(
    cuda: None, precision: Precision
) -> None:
    """A widening Linear (stored ``[in, out]`` on an FP32 CPU build) and a narrowing one keep
    ``[out, in]`` rows on CUDA, the layout ``linear_rows`` reads; so do a Llama's projections."""
    for n_in, n_out in ((8, 24), (24, 8)):
        lin = Linear("w", LinearConfig(n_in, n_out), device="CUDA:0", precision=precision)
        lin.build(BuildContext((2, 1, n_in), RuntimeMode.INFERENCE))
        assert lin.weight.shape == (n_out, n_in) and lin.weight.flags.c_contiguous
    model = Llama("llama", CFG, device="CUDA:0", precision=precision)
    model.build(BuildContext((2, 16), RuntimeMode.INFERENCE, prefill_size=4))
    weights = [a for name, a in model.named_parameters() if "proj" in name]
    assert len(weights) == 5 * CFG.n_layers
    assert all(w.strides[-1] == w.itemsize for w in weights)


def inference(cfg: LlamaConfig, path: Any, device: str, precision: Precision) -> Llama:
    model = Llama("llama", cfg, device=device, precision=precision)
    model.build(BuildContext((2, 40), RuntimeMode.INFERENCE, prefill_size=4))
    model.load(path)
    return model


@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("tie", [False, True], ids=["head", "tied"])
def test_decode_steps_are_captured_and_replay_the_eager_logits(
    cuda_device: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    precision: Precision,
    tie: bool,
) -> None:
    """A Llama's decode step on CUDA:0 (whose stream refuses a matrix product while it captures,
    CuPy's cuBLAS on a GPU, the emulated stream likewise) is captured once per batch size and
    replayed: its products are ``linear_rows`` launches (every projection and the head, tied or
    not), and its logits equal those of the same step run eagerly, bit for bit."""
    skip_bf16_without_arrays(cuda_device, precision)
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, qkv_bias=tie, out_bias=tie)
    trained = Llama("llama", cfg, device="CPU")
    trained.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    move_optional_parameters(trained, np.random.default_rng(3))
    path = tmp_path / "w.safetensors"
    trained.save(path)
    graphed, eager = (inference(cfg, path, "CUDA:0", precision) for _ in range(2))
    never_capture(monkeypatch, eager)
    x = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 20))
    for model in (graphed, eager):
        model.prefill(x[:, :5])
    program: list[tuple[int, Any]] = [(2, p) for p in range(5, 9)] + [(1, 6), (1, 7)]
    program += [(2, np.array([p - 2, p])) for p in range(9, 12)]
    for n_b, where in program:
        column = x[:n_b, np.max(where)]
        got, want = host(graphed.decode(column, where)), host(eager.decode(column, where))
        assert np.abs(np.asarray(want, np.float64)).max() > 0.1
        np.testing.assert_array_equal(got, want)
    assert graphed._plans is not None and sorted(graphed._plans) == [1, 2]
    assert eager._plans is not None and all(p.step.graph is None for p in eager._plans.values())
    for n_b, plan in graphed._plans.items():
        assert plan.step.captures == 1 and plan.step.graph is not None
        if EMULATED:
            runs = sum(1 for b, _ in program if b == n_b)
            assert plan.step.graph.launches == runs - 1
    if not EMULATED:
        return
    products = [n for n in graphed.execution_context.launches if n.startswith("linear_rows<")]
    per_step = 1 + 5 * cfg.n_layers  # q/k/v fused, o, gate, up, down per layer, and the head
    assert len(products) == per_step * len(program)


def test_greedy_generation_on_the_gpu_equals_the_cpu(cuda: None, tmp_path: Any) -> None:
    """The same weights generate the same greedy tokens on the emulated GPU (captured decode
    steps, ``linear_rows`` products) as on the CPU, for a batch of two prompts and for one."""
    trained = Llama("llama", CFG, device="CPU")
    trained.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    move_optional_parameters(trained, np.random.default_rng(11))
    path = tmp_path / "w.safetensors"
    trained.save(path)
    gpu, cpu = (inference(CFG, path, d, Precision.FP32) for d in ("CUDA:0", "CPU"))
    prompts = np.random.default_rng(12).integers(0, CFG.vocab_size, size=(2, 5))
    for prompt in (prompts, prompts[1]):
        got = gpu.generate(prompt, max_new_tokens=8)
        want = cpu.generate(prompt, max_new_tokens=8)
        np.testing.assert_array_equal(got, want)
    assert isinstance(gpu.execution_context, EmulatedContext)
    assert gpu._plans is not None and all(p.step.graph is not None for p in gpu._plans.values())
    assert any(n.startswith("linear_rows<float,") for n in gpu.execution_context.launches)
