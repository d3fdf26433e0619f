"""The Llama ops and the whole Llama on ``CUDA:0`` against the CPU, on a machine with a GPU.

- every CUDA op (Linear, RmsNorm, TokenEmbedding, SwiGLU, SoftmaxCrossEntropy, Attention,
  AdamW), forward and backward, against the CPU op on the same random inputs (fp32);
- a tiny Llama, TRAINING: logits, loss, every gradient and every parameter after AdamW steps
  equal to the CPU model's with the same weights (tied and untied embeddings); the loss a
  standalone component with a context of its own;
- INFERENCE: chunked prefill, uniform and ragged decode logits (the decode steps replayed
  from their CUDA graphs), greedy ``generate`` tokens; a captured step on new inputs, and a
  capture that allocates refused;
- ``get_memory_stats()`` (and ``required_memory``) identical on both devices.

"Equal" is fp32 parity: cuBLAS and the GPU's reductions sum in other orders than NumPy, so
results agree to ~1e-6 relative, checked at 1e-5. The whole module is skipped on machines
without CuPy or a GPU; ``tests/test_cuda_ops_emulated.py`` runs the same ops on the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from layer_helpers import MEMORY_BUILDS, cpu_stats_of_a_cuda_build

from mila_py.devices.cuda import cuda_device_count

if cuda_device_count() == 0:
    pytest.skip("no CUDA GPU / CuPy", allow_module_level=True)

import cupy

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import RmsNormConfig, SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.components.linear import LinearConfig
from mila_py.devices import create_execution_context
from mila_py.devices.graph import capture
from mila_py.models import Llama, LlamaConfig
from mila_py.ops.cpu.attention import attention_backward, attention_forward
from mila_py.ops.cpu.linear import linear_backward, linear_forward
from mila_py.ops.cpu.rms_norm import rms_norm_backward, rms_norm_forward
from mila_py.ops.cpu.softmax_cross_entropy import (
    softmax_cross_entropy_backward,
    softmax_cross_entropy_forward,
)
from mila_py.ops.cpu.swiglu import swiglu_backward, swiglu_forward
from mila_py.ops.cpu.token_embedding import token_embedding_backward, token_embedding_forward
from mila_py.ops.registry import create_op
from mila_py.optim import AdamW, clip_grad_norm

pytestmark = pytest.mark.cuda

DEVICE = "CUDA:0"
FP32 = Precision.FP32
TRAINING, INFERENCE = RuntimeMode.TRAINING, RuntimeMode.INFERENCE
CFG = LlamaConfig(
    vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)


@pytest.fixture(scope="module")
def ctx() -> Any:
    return create_execution_context(DEVICE)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20260601)


def f32(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def host(x: Any) -> np.ndarray:
    """A host copy after every stream of the device finished."""
    cupy.cuda.runtime.deviceSynchronize()
    return cupy.asnumpy(x)


def dev(x: np.ndarray) -> Any:
    out = cupy.asarray(x)
    cupy.cuda.runtime.deviceSynchronize()
    return out


def rel_err(actual: Any, expected: Any) -> float:
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    scale = max(np.linalg.norm(a), np.linalg.norm(e))
    return 0.0 if scale == 0 else float(np.linalg.norm(a - e) / scale)


def close(actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    actual = host(actual) if isinstance(actual, cupy.ndarray) else actual
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------- single ops
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_linear_op(ctx, rng, bias: bool, transposed: bool) -> None:
    n_in, n_out = 48, 40
    op = create_op("LinearOp", ctx, LinearConfig(n_in, n_out, bias=bias), FP32)
    big = f32(rng, 3, 9, n_in)
    x, gx = big[:2, :7], dev(big)[:2, :7]  # batch slices: not contiguous
    if transposed:  # the INFERENCE layout: an [out, in] view of [in, out] storage
        storage = f32(rng, n_in, n_out)
        w, gw = storage.T, dev(storage).T
    else:
        w = f32(rng, n_out, n_in)
        gw = dev(w)
    b = f32(rng, n_out) if bias else None
    out = cupy.empty((2, 7, n_out), cupy.float32)
    op.forward(gx, gw, None if b is None else dev(b), out)
    ref = np.empty((2, 7, n_out), np.float32)
    linear_forward(x, w, b, ref)
    close(out, ref)
    dy = f32(rng, 2, 7, n_out)
    dw0, db0 = f32(rng, n_out, n_in), f32(rng, n_out)
    dw, db = dev(dw0), dev(db0) if bias else None
    dx = cupy.empty((2, 7, n_in), cupy.float32)
    op.backward(gx, gw, dev(dy), dw, db, dx)
    dx_ref = np.empty((2, 7, n_in), np.float32)
    db_ref = db0.copy() if bias else None
    linear_backward(x, w, dy, dw0, db_ref, dx_ref)
    close(dw, dw0)
    close(dx, dx_ref)
    if bias:
        close(db, db_ref)


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out storage"])
@pytest.mark.parametrize("m", [1, 5, 300])
def test_linear_bind_forward_equals_the_forward(ctx, rng, m: int, transposed: bool) -> None:
    """The bound forward (a decode plan's product, run with the context active: ``linear.cu``'s
    ``linear_rows`` up to 16 rows over ``[out, in]`` rows, ``cupy.matmul`` past them or for the
    other layout) against the op's forward and the float64 product, with and without a bias
    (their summation orders differ: float32 roundings apart)."""
    n_in, n_out = 96, 40
    op = create_op("LinearOp", ctx, LinearConfig(n_in, n_out, bias=False), FP32)
    x = f32(rng, m, 1, n_in)
    w_in_out = f32(rng, n_in, n_out)
    w = w_in_out.T  # [out, in]
    gx, gw = dev(x), (dev(w_in_out).T if transposed else dev(np.ascontiguousarray(w)))
    want = cupy.empty((m, 1, n_out), cupy.float32)
    op.forward(gx, gw, None, want)
    close(want, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    for bias in (None, f32(rng, n_out)):
        out = cupy.full((m, 1, n_out), np.nan, cupy.float32)
        with ctx.activate():
            op.bind_forward(gx, gw, None if bias is None else dev(bias), out)()
        reference = x.astype(np.float64) @ w.T + (0 if bias is None else bias)
        close(out, reference, rtol=1e-5, atol=1e-5)
        close(out, host(want) + (0 if bias is None else bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n_rows", "dim"), [(1, 5), (37, 300), (300, 1000)])
def test_rms_norm_op(ctx, rng, n_rows: int, dim: int) -> None:
    op = create_op("RmsNormOp", ctx, RmsNormConfig(dim, 1e-5), FP32)
    x, w = f32(rng, n_rows, dim, scale=3.0), f32(rng, dim) + 1
    y, r = cupy.empty((n_rows, dim), cupy.float32), cupy.empty(n_rows, cupy.float32)
    op.forward(dev(x), dev(w), y, r)
    y_ref, r_ref = np.empty((n_rows, dim), np.float32), np.empty(n_rows, np.float32)
    rms_norm_forward(x, w, 1e-5, y_ref, r_ref)
    close(y, y_ref)
    close(r, r_ref)
    dy, dw0 = f32(rng, n_rows, dim), f32(rng, dim)
    dw, dx = dev(dw0), cupy.empty((n_rows, dim), cupy.float32)
    op.backward(dev(x), dev(w), r, dev(dy), dw, dx)
    dx_ref = np.empty_like(y_ref)
    rms_norm_backward(x, w, r_ref, dy, dw0, dx_ref)
    close(dx, dx_ref, atol=1e-5)
    assert rel_err(host(dw), dw0) < 1e-5


def test_swiglu_op_in_place(ctx, rng) -> None:
    op = create_op("SwiGLUOp", ctx, None, FP32)
    g, u, dh = f32(rng, 2, 7, 96, scale=4.0), f32(rng, 2, 7, 96), f32(rng, 2, 7, 96)
    g[0, 0, :2] = [-100.0, 100.0]
    h = cupy.empty(g.shape, cupy.float32)
    op.forward(dev(g), dev(u), h)
    h_ref = np.empty_like(g)
    swiglu_forward(g, u, h_ref)
    close(h, h_ref)
    dg_ref, du_ref = np.empty_like(g), np.empty_like(g)
    with np.errstate(over="ignore"):
        swiglu_backward(g, u, dh, dg_ref, du_ref)
    dgate, dup = dev(dh), cupy.empty(g.shape, cupy.float32)
    op.backward(dev(g), dev(u), dgate, dgate, dup)  # in place, as the component calls it
    close(dgate, dg_ref)
    close(dup, du_ref)


def test_token_embedding_op(ctx, rng) -> None:
    op = create_op("TokenEmbeddingOp", ctx, None, FP32)
    weight, tokens = f32(rng, 11, 64), np.array([[3, 3, 0, 10], [3, 7, 7, 0]])
    out = cupy.empty((2, 4, 64), cupy.float32)
    op.forward(dev(tokens), dev(weight), out)
    ref = np.empty((2, 4, 64), np.float32)
    token_embedding_forward(tokens, weight, ref)
    np.testing.assert_array_equal(host(out), ref)
    dy, dw0 = f32(rng, 2, 4, 64), f32(rng, 11, 64)
    dw = dev(dw0)
    op.backward(dev(tokens), dev(dy), dw)
    token_embedding_backward(tokens, dy, dw0)
    close(dw, dw0)


@pytest.mark.parametrize("vocab", [7, 1031, 32000])
def test_softmax_cross_entropy_op(ctx, rng, vocab: int) -> None:
    op = create_op("SoftmaxCrossEntropyOp", ctx, SoftmaxCrossEntropyConfig(vocab), FP32)
    logits = f32(rng, 2, 5, vocab, scale=5.0)
    targets = rng.integers(0, vocab, size=(2, 5))
    targets[0, 1] = -100
    lse = cupy.empty((2, 5), cupy.float32)
    loss, count = op.forward(dev(logits), dev(targets), lse)
    lse_ref = np.empty((2, 5), np.float32)
    loss_ref, count_ref = softmax_cross_entropy_forward(logits, targets, -100, lse_ref)
    assert count == count_ref == 9
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    close(lse, lse_ref)
    d = cupy.empty(logits.shape, cupy.float32)
    op.backward(dev(logits), dev(targets), lse, d, 1.0 / count)
    d_ref = np.empty_like(logits)
    softmax_cross_entropy_backward(logits, targets, -100, lse_ref, d_ref, 1.0 / count)
    close(d, d_ref, atol=1e-8)


@pytest.mark.parametrize(("hq", "hk", "d"), [(4, 2, 8), (6, 1, 16), (3, 3, 64)])
def test_attention_op_training(ctx, rng, hq: int, hk: int, d: int) -> None:
    op = create_op("AttentionOp", ctx, None, FP32)
    n_b, n_t, scale = 2, 33, 0.3
    qkv = f32(rng, n_b, n_t, (hq + 2 * hk) * d)
    q, k, v = qkv[..., : hq * d], qkv[..., hq * d : (hq + hk) * d], qkv[..., (hq + hk) * d :]
    g_qkv = dev(qkv)
    gq, gk, gv = (
        g_qkv[..., : hq * d],
        g_qkv[..., hq * d : (hq + hk) * d],
        g_qkv[..., (hq + hk) * d :],
    )
    probs = cupy.empty((n_b, hk, hq // hk, n_t, n_t), cupy.float32)
    out = cupy.empty((n_b, n_t, hq * d), cupy.float32)
    p = op.forward(gq, gk, gv, hq, hk, scale, out=out, probs=probs)
    out_ref = np.empty((n_b, n_t, hq * d), np.float32)
    p_ref = attention_forward(q, k, v, hq, hk, scale, out_ref)
    close(p, p_ref)
    close(out, out_ref)
    np.testing.assert_array_equal(host(g_qkv), qkv)  # Q, K, V untouched
    dout = f32(rng, n_b, n_t, hq * d)
    dqkv = cupy.zeros(qkv.shape, cupy.float32)
    dq, dk, dv = dqkv[..., : hq * d], dqkv[..., hq * d : (hq + hk) * d], dqkv[..., (hq + hk) * d :]
    op.backward(dev(dout), gq, gk, gv, p, hq, hk, scale, dq, dk, dv, out=out)
    dqkv_ref = np.zeros_like(qkv)
    rq, rk, rv = (
        dqkv_ref[..., : hq * d],
        dqkv_ref[..., hq * d : (hq + hk) * d],
        dqkv_ref[..., (hq + hk) * d :],
    )
    attention_backward(dout, q, k, v, p_ref, hq, hk, scale, rq, rk, rv, out=out_ref)
    close(dqkv, dqkv_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ragged", [False, True])
def test_attention_op_prefill_and_decode(ctx, rng, ragged: bool) -> None:
    op = create_op("AttentionOp", ctx, None, FP32)
    hq, hk, d, scale, n_b = 4, 2, 16, 0.25, 3
    cache = f32(rng, n_b, 40, 2 * hk * d)
    q = f32(rng, n_b, 5, hq * d)
    k, v = cache[:, :30, : hk * d], cache[:, :30, hk * d :]
    gk, gv = dev(cache)[:, :30, : hk * d], dev(cache)[:, :30, hk * d :]
    out = cupy.empty((n_b, 5, hq * d), cupy.float32)  # prefill of 5 queries at offset 25
    op.forward(dev(q), gk, gv, hq, hk, scale, out=out, q_offset=25)
    out_ref = np.empty((n_b, 5, hq * d), np.float32)
    attention_forward(q, k, v, hq, hk, scale, out_ref, q_offset=25)
    close(out, out_ref)
    pos = np.array([7, 29, 18]) if ragged else np.full(n_b, 29)
    kwargs_ref: dict[str, Any] = {"causal": False}
    kwargs: dict[str, Any] = {"causal": False}
    if ragged:
        visible = np.arange(30)[None, :] <= pos[:, None]
        bias = np.where(visible, 0.0, -np.inf).astype(np.float32)[:, None, None, None, :]
        kwargs_ref["bias"], kwargs["bias"] = bias, dev(bias)
    q1 = q[:, :1]
    out1 = cupy.empty((n_b, 1, hq * d), cupy.float32)
    op.forward(dev(np.ascontiguousarray(q1)), gk, gv, hq, hk, scale, out=out1, **kwargs)
    ref1 = np.empty((n_b, 1, hq * d), np.float32)
    attention_forward(q1, k, v, hq, hk, scale, ref1, **kwargs_ref)
    close(out1, ref1)


def test_adamw_op_against_the_array_code(ctx, rng) -> None:
    op = create_op("AdamWOp", ctx, None, FP32)
    p, g, m, v = (f32(rng, 33, 17) for _ in range(4))
    v = np.abs(v)
    gp, gg, gm, gv = dev(p), dev(g), dev(m), dev(v)
    lr, wd, b1, b2, eps, step = 1e-3, 0.1, 0.9, 0.95, 1e-8, 3
    c1, c2 = 1 - b1**step, 1 - b2**step
    op.step(gp, gg, gm, gv, decay=1 - lr * wd, betas=(b1, b2), correction2=c2, eps=eps,
            step_size=lr / c1)  # fmt: skip
    p *= 1.0 - lr * wd
    m *= b1
    m += (1.0 - b1) * g
    v *= b2
    v += (1.0 - b2) * (g * g)
    denom = np.sqrt(v / c2)
    denom += eps
    p -= lr / c1 * (m / denom)
    close(gm, m, rtol=1e-6, atol=0)
    close(gv, v, rtol=1e-6, atol=0)
    close(gp, p, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------- tiny Llama
def build_pair(
    cfg: LlamaConfig, shape: tuple[int, int], mode: RuntimeMode, prefill: int = 0
) -> tuple[Llama, Llama]:
    """A CPU and a CUDA Llama with the CPU model's (initialized) weights on both."""
    cpu = Llama("llama", cfg, device="CPU")
    cpu.build(BuildContext(shape, mode, initialize_parameters=True, prefill_size=prefill))
    gpu = Llama("llama", cfg, device=DEVICE)
    gpu.build(BuildContext(shape, mode, initialize_parameters=False, prefill_size=prefill))
    ctx = gpu.execution_context
    for (name, a), (name_b, b) in zip(cpu.named_parameters(), gpu.named_parameters(), strict=True):
        assert name == name_b and a.shape == b.shape
        b[...] = ctx.to_device(a)
    ctx.synchronize()
    return cpu, gpu


#: every optional part of the Llama config: attention and MLP biases, Q/K head norms (Qwen3)
EXTRAS: dict[str, Any] = {"qkv_bias": True, "out_bias": True, "mlp_bias": True, "qk_norm": True}


@pytest.mark.parametrize(("tie", "extras"), [(False, False), (True, False), (False, True)])
def test_training_steps_equal_cpu(rng, tie: bool, extras: bool) -> None:
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, **(EXTRAS if extras else {}))
    n_b, n_t = 2, 16
    cpu, gpu = build_pair(cfg, (n_b, n_t), TRAINING)
    tokens = rng.integers(0, cfg.vocab_size, size=(n_b, n_t))
    targets = rng.integers(0, cfg.vocab_size, size=(n_b, n_t))
    targets[0, :3] = -100
    runs = []
    for model in (cpu, gpu):
        device = str(model.device_id)
        loss_fn = SoftmaxCrossEntropy(
            "loss", SoftmaxCrossEntropyConfig(cfg.vocab_size), device=device
        )
        loss_fn.build(BuildContext((n_b, n_t, cfg.vocab_size), TRAINING))
        ctx = model.execution_context
        # eps 1e-4: AdamW's update g / (|g| + eps) would amplify fp32 noise in near-zero gradients
        opt = AdamW(model, lr=1e-3, eps=1e-4, weight_decay=0.1)
        tok, tgt = ctx.to_device(tokens), ctx.to_device(targets)
        record: dict[str, Any] = {"loss": []}
        for step in range(3):
            logits = model.forward(tok)
            if step == 0:
                record["logits"] = ctx.to_host(logits)
            record["loss"].append(loss_fn.forward(logits, tgt))
            model.backward(loss_fn.backward())
            if step == 0:
                record["grads"] = {n: ctx.to_host(g) for n, g in model.named_gradients()}
                record["norm"] = clip_grad_norm(model, 1e9)
            opt.step()
            model.zero_gradients()
        record["params"] = {n: ctx.to_host(p) for n, p in model.named_parameters()}
        runs.append(record)
    ref, got = runs
    assert rel_err(got["logits"], ref["logits"]) < 1e-5
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert rel_err(got["grads"][name], g) < 2e-5, name
    for name, p in ref["params"].items():
        np.testing.assert_allclose(got["params"][name], p, rtol=1e-5, atol=1e-6, err_msg=name)


def test_initialization_is_the_same_on_both_devices() -> None:
    cpu = Llama("llama", CFG, device="CPU")
    cpu.build(BuildContext((1, 8), TRAINING))
    gpu = Llama("llama", CFG, device=DEVICE)
    gpu.build(BuildContext((1, 8), TRAINING))
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters(), strict=True):
        np.testing.assert_array_equal(host(b), a, err_msg=name)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:  # type: ignore[no-untyped-def]
    model = Llama("llama", CFG, device="CPU")
    model.build(BuildContext((1, 8), TRAINING))
    path = tmp_path_factory.mktemp("w") / "llama.safetensors"
    model.save(path)
    return str(path)


def inference_pair(weights: str, shape: tuple[int, int], prefill: int) -> tuple[Llama, Llama]:
    models = []
    for device in ("CPU", DEVICE):
        model = Llama("llama", CFG, device=device)
        model.build(BuildContext(shape, INFERENCE, prefill_size=prefill))
        model.load(weights)
        models.append(model)
    return models[0], models[1]


def test_chunked_prefill_and_decode_equal_cpu(weights: str, rng) -> None:
    cpu, gpu = inference_pair(weights, (2, 48), prefill=5)
    x = rng.integers(0, CFG.vocab_size, size=(2, 13))
    close(gpu.prefill(x), cpu.prefill(x), rtol=1e-5, atol=1e-5)
    for position in range(13, 30):
        token = rng.integers(0, CFG.vocab_size, size=2)
        close(gpu.decode(token, position), cpu.decode(token, position), rtol=1e-5, atol=1e-5)
    # a continued conversation: a second prefill at an offset, then ragged decode
    more = rng.integers(0, CFG.vocab_size, size=(2, 4))
    close(gpu.prefill(more, 30), cpu.prefill(more, 30), rtol=1e-5, atol=1e-5)
    positions = np.array([34, 31])
    for _ in range(5):
        token = rng.integers(0, CFG.vocab_size, size=2)
        close(gpu.decode(token, positions), cpu.decode(token, positions), rtol=1e-5, atol=1e-5)
        positions = positions + 1


@pytest.mark.parametrize(("tie", "extras"), [(False, False), (True, False), (False, True)])
def test_decode_plan_equals_the_component_path(tmp_path, rng, tie: bool, extras: bool) -> None:
    """The GPU decode plan (bound products and launches, ``attention_decode``,
    ``kv_cache_write``, the step's positions read from its device buffer) against the
    components' own calls on the GPU: one position for all, ragged positions (also given as a
    CuPy array), B=1 in a B=2 build; logits and KV caches."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, **(EXTRAS if extras else {}))
    trained = Llama("llama", cfg, device="CPU")
    trained.build(BuildContext((1, 8), TRAINING))
    for name, p in trained.named_parameters():  # biases start at 0, norm weights at 1
        if name.endswith((".bias", "norm.weight")):
            p += 0.5 * rng.standard_normal(p.shape).astype(p.dtype)
    trained.save(tmp_path / "w.safetensors")
    planned, components = (Llama("llama", cfg, device=DEVICE) for _ in range(2))
    for model in (planned, components):
        model.build(BuildContext((2, 48), INFERENCE, prefill_size=6))
        model.load(tmp_path / "w.safetensors")
    x = rng.integers(0, cfg.vocab_size, size=(2, 36))
    for model in (planned, components):
        model.prefill(x[:, :7])
    for position in range(7, 36):
        # ragged from 15 (sequence 0 four behind); at 20 sequence 0 goes on alone (B=1) and
        # sequence 1 then continues a step behind
        n_b, where = 2, position
        if position == 20:
            n_b, where = 1, position - 4
        elif position > 14:
            where = np.array([position - 4, position - (position > 20)])
            if position % 2:
                where = dev(where)
        got = planned.decode(x[:n_b, position], where)
        want = components._decode_components(dev(x[:n_b, position, None]), where)
        close(got, host(want), rtol=1e-5, atol=1e-5)
    assert sorted(planned._plans) == [1, 2] and components._plans == {}
    # each batch size's step tried one capture; it replays a graph where every call can be
    # captured, and stays eager where a library refuses (CuPy 14's cuBLAS calls do)
    for plan in planned._plans.values():
        assert plan.step.captures == 1 and (plan.step.graph is None) == plan.step.eager
    last = planned._plans[2].positions.device  # the last step's positions, on the device
    assert isinstance(last, cupy.ndarray) and last.dtype == np.int32
    np.testing.assert_array_equal(host(last), [35 - 4, 35 - 1])
    for a, b in zip(planned.layers, components.layers, strict=True):
        for cache in ("k_cache", "v_cache"):
            close(a.self_attn._state[cache], host(b.self_attn._state[cache]), rtol=1e-5, atol=1e-5)


def test_a_captured_step_replays_on_new_inputs_and_refuses_allocations() -> None:
    """``mila_py.devices.graph.capture`` on the context's stream: the first call runs the
    calls and captures them, the later ones launch the graph, which reads its arrays' current
    values. A call that allocates while it is captured raises (CuPy's allocator refuses;
    the emulator too), and the stream is left able to capture again."""
    ctx = create_execution_context(DEVICE)
    with ctx.activate():
        a, c = cupy.ones(4, dtype=cupy.float32), cupy.zeros(4, dtype=cupy.float32)
        step = capture(ctx, [lambda: cupy.multiply(a, 2, out=c), lambda: cupy.add(c, a, out=c)])
        step()
        assert step.graph is not None and step.captures == 1
        np.testing.assert_array_equal(host(c), [3] * 4)
        cupy.copyto(a, cupy.full(4, 5, dtype=cupy.float32))
        step()
        np.testing.assert_array_equal(host(c), [15] * 4)
        failing = capture(ctx, [lambda: cupy.multiply(a, 2)])  # a new array for the result
        with pytest.raises(RuntimeError):
            failing()
        assert failing.graph is None and not ctx.stream.is_capturing()
        step()
        np.testing.assert_array_equal(host(c), [15] * 4)


def test_greedy_generate_equals_cpu(weights: str, rng) -> None:
    cpu, gpu = inference_pair(weights, (2, 40), prefill=4)
    prompt = rng.integers(0, CFG.vocab_size, size=(2, 7))
    out = gpu.generate(prompt, max_new_tokens=12)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, cpu.generate(prompt, max_new_tokens=12))
    np.testing.assert_array_equal(gpu.generate(dev(prompt[0]), 5), cpu.generate(prompt[0], 5))
    # a list of prompts of different lengths, one of them a CuPy array
    got = gpu.generate([dev(prompt[0]), prompt[1, :4]], 6)
    want = cpu.generate([prompt[0], prompt[1, :4]], 6)
    assert isinstance(got, list) and len(got) == 2
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.real_gpu("device memory statistics (the emulator keeps its arrays on the host)")
@pytest.mark.parametrize("build", MEMORY_BUILDS)
@pytest.mark.parametrize("tie", [False, True])
def test_memory_stats_equal_cpu(build: BuildContext, tie: bool) -> None:
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, **({} if tie else EXTRAS))
    stats = []
    for device in ("CPU", DEVICE):
        model = Llama("llama", cfg, device=device)
        predicted = model.required_memory(build)
        model.build(build)
        assert model.get_memory_stats() == predicted
        stats.append(predicted)
    assert stats[0] == cpu_stats_of_a_cuda_build(stats[1], model)
    assert stats[1].host_total_bytes == 0


@pytest.mark.real_gpu("streams")
def test_contexts_of_one_gpu_share_its_stream() -> None:
    """A model and a loss with contexts of their own run in call order (one stream)."""
    a, b = create_execution_context(DEVICE), create_execution_context(DEVICE)
    assert a.stream is b.stream
    assert a.stream is not cupy.cuda.Stream.null


# ------------------------------------------------------------------------- 16-bit storage
#: a 16-bit Llama on the GPU against the CPU one in the same precision: each side rounds its
#: float32 results once per store, in its own summation order
REDUCED_TOL = {Precision.BF16: 2e-2, Precision.FP16: 3e-3}


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16])
def test_a_16_bit_llama_equals_cpu(weights: str, rng, precision: Precision) -> None:
    """BF16/FP16 on the GPU (cuBLAS products with float32 accumulation, the kernels'
    16-bit instantiations) against the CPU in the same precision: training logits and float32
    gradients, chunked prefill, the decode plan over the 16-bit KV cache, greedy generation."""
    tol = REDUCED_TOL[precision]
    tokens = rng.integers(0, CFG.vocab_size, size=(2, 12))
    trained = []
    for device in ("CPU", DEVICE):
        model = Llama("llama", CFG, device=device, precision=precision)
        model.build(BuildContext((2, 12), TRAINING))
        model.load(weights)
        ctx = model.execution_context
        logits = model.forward(ctx.to_device(tokens))
        assert logits.dtype == precision.numpy_dtype
        model.backward(ctx.to_device(np.full(logits.shape, 0.1, np.float32)))
        grads = {n: ctx.to_host(g) for n, g in model.named_gradients()}
        assert all(g.dtype == np.float32 for g in grads.values())
        trained.append((ctx.to_host(logits), grads))
    (ref_logits, ref_grads), (logits, grads) = trained
    assert rel_err(logits, ref_logits) < tol
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < 2 * tol, name
    pair = []
    for device in ("CPU", DEVICE):
        model = Llama("llama", CFG, device=device, precision=precision)
        model.build(BuildContext((2, 40), INFERENCE, prefill_size=5))
        model.load(weights)
        pair.append(model)
    cpu, gpu = pair
    on_host = gpu.execution_context.to_host  # (bfloat16 comes back as ml_dtypes' bfloat16)
    x = rng.integers(0, CFG.vocab_size, size=(2, 13))
    assert rel_err(on_host(gpu.prefill(x)), cpu.prefill(x)) < tol
    for position in range(13, 20):
        token = rng.integers(0, CFG.vocab_size, size=2)
        assert rel_err(on_host(gpu.decode(token, position)), cpu.decode(token, position)) < tol
    assert gpu.generate(x[:, :5], max_new_tokens=4).shape == (2, 9)
