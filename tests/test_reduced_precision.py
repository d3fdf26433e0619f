"""BF16 and FP16 networks on the CPU: 16-bit storage, float32 arithmetic, one rounding per store.

Each layer and the Llama run in BF16 and FP16 against a float64 twin holding the same (16-bit)
weights and inputs; the errors stay within what 16-bit storage of the activations costs
(tolerances keyed by precision). Also: the ops are registered in every precision on both
devices, a decode step's products read the 16-bit weights without a widened copy, gradients of
16-bit parameters are float32, memory is counted by dtype, and ``from_pretrained`` loads a
checkpoint in its own precision with a bounded context.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from layer_helpers import INFERENCE, TRAINING, built, rel_err

from mila_py import BuildContext, Precision
from mila_py.components import (
    AttentionConfig,
    GroupedQueryAttention,
    Linear,
    LinearConfig,
    Residual,
    ResidualConfig,
    RmsNorm,
    RmsNormConfig,
    SoftmaxCrossEntropy,
    SoftmaxCrossEntropyConfig,
    SwiGLU,
    SwiGLUConfig,
    TokenEmbedding,
    TokenEmbeddingConfig,
)
from mila_py.devices import DeviceType
from mila_py.interop.hf import checkpoint_precision, hf_weight_files, save_hf_checkpoint
from mila_py.models import Llama, LlamaConfig
from mila_py.ops.cpu import _fused_linear
from mila_py.ops.cpu._fused_math import AVAILABLE as HAS_NUMBA
from mila_py.ops.registry import OpNotFoundError, create_op, is_supported

REDUCED = [Precision.BF16, Precision.FP16]
#: relative error (2-norm) of a layer against its float64 twin on the same 16-bit values: the
#: output's own rounding (2^-9 for BF16, 2^-12 for FP16) and the 16-bit intermediates
TOL = {Precision.BF16: 1e-2, Precision.FP16: 1e-3}
#: the same for a whole Llama (every layer's activations stored in 16 bits)
MODEL_TOL = {Precision.BF16: 1.5e-2, Precision.FP16: 2e-3}

LAYER_OPS = (
    "TokenEmbeddingOp",
    "LinearOp",
    "RmsNormOp",
    "AttentionOp",
    "SwiGLUOp",
    "ResidualOp",
    "RopeOp",
    "SoftmaxCrossEntropyOp",
)

CFG = LlamaConfig(
    vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)

needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="needs Numba (the jit extra)")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(2024)


def as16(x: np.ndarray, precision: Precision) -> np.ndarray:
    return np.asarray(x).astype(precision.numpy_dtype)


def twin(component: Any, reference: Any) -> None:
    """Give ``reference`` (float64) the values of ``component``'s parameters (16-bit)."""
    for p, q in zip(component.get_parameters(), reference.get_parameters(), strict=True):
        q[...] = np.asarray(p, np.float64)


def grads(component: Any) -> dict[str, np.ndarray]:
    return {name: np.asarray(g, np.float64) for name, _, g in component.named_parameter_gradients()}


# ----------------------------------------------------------------------------------- registry
@pytest.mark.parametrize("device", [DeviceType.CPU, DeviceType.CUDA])
@pytest.mark.parametrize("op", LAYER_OPS)
def test_every_layer_op_is_registered_in_fp32_bf16_and_fp16(op: str, device: DeviceType) -> None:
    for precision in (Precision.FP32, Precision.BF16, Precision.FP16):
        assert is_supported(op, device, precision), (op, device, precision)


# ------------------------------------------------------------------------------------- layers
def _layers() -> dict[str, tuple[Any, tuple[int, ...], Any]]:
    """``name: (factory(precision), build shape, call(component, rng, precision) -> output)``"""

    def floats(rng: Any, shape: tuple[int, ...], p: Precision, scale: float = 1.0) -> Any:
        return as16(scale * rng.standard_normal(shape), p)

    return {
        "linear": (
            lambda p: Linear("lin", LinearConfig(24, 40, bias=True), device="CPU", precision=p),
            (2, 3, 24),
            lambda c, rng, p: c.forward(floats(rng, (2, 3, 24), p)),
        ),
        "rms_norm": (
            lambda p: RmsNorm("norm", RmsNormConfig(24), device="CPU", precision=p),
            (2, 3, 24),
            lambda c, rng, p: c.forward(floats(rng, (2, 3, 24), p, 3.0)),
        ),
        "swiglu": (
            lambda p: SwiGLU("mlp", SwiGLUConfig(24, 40), device="CPU", precision=p),
            (2, 3, 24),
            lambda c, rng, p: c.forward(floats(rng, (2, 3, 24), p)),
        ),
        "residual": (
            lambda p: Residual("res", ResidualConfig(24, scale=0.3), device="CPU", precision=p),
            (2, 3, 24),
            lambda c, rng, p: c.forward(floats(rng, (2, 3, 24), p), floats(rng, (2, 3, 24), p)),
        ),
        "attention": (
            lambda p: GroupedQueryAttention(
                "attn", AttentionConfig(32, 4, 2, max_seq_len=16), device="CPU", precision=p
            ),
            (2, 5, 32),
            lambda c, rng, p: c.forward(floats(rng, (2, 5, 32), p)),
        ),
        "embedding": (
            lambda p: TokenEmbedding(
                "emb", TokenEmbeddingConfig(30, 24), device="CPU", precision=p
            ),
            (2, 3),
            lambda c, rng, p: c.forward(rng.integers(0, 30, (2, 3))),
        ),
    }


@pytest.mark.parametrize("precision", REDUCED)
@pytest.mark.parametrize("name", list(_layers()))
def test_a_layer_in_16_bits_matches_its_float64_twin(name: str, precision: Precision, rng) -> None:
    """Forward and backward of a 16-bit layer against the float64 layer holding the same
    values: the output and ``dx`` in the 16-bit dtype, the parameter gradients float32, all
    within the precision's tolerance; a float32 ``dy`` is taken as well as a 16-bit one."""
    factory, shape, call = _layers()[name]
    layer = built(factory(precision), shape, TRAINING)
    reference = built(factory(Precision.FP64), shape, TRAINING)
    for p in layer.get_parameters():  # away from the initial zeros and ones
        p[...] = as16(np.asarray(p, np.float32) + 0.3 * rng.standard_normal(p.shape), precision)
    twin(layer, reference)
    seed = int(rng.integers(1 << 30))
    y = call(layer, np.random.default_rng(seed), precision)
    x_ref = call(reference, np.random.default_rng(seed), Precision.FP64)
    assert y.dtype == precision.numpy_dtype
    assert rel_err(y, x_ref) < TOL[precision]
    dy = rng.standard_normal(y.shape)
    for given in (as16(dy, precision), dy.astype(np.float32)):
        layer.zero_gradients()
        reference.zero_gradients()
        dx = layer.backward(given)
        dx_ref = reference.backward(np.asarray(given, np.float64))
        for g in layer.get_gradients():
            assert g.dtype == np.float32
        if dx is not None and not isinstance(dx, tuple):
            assert dx.dtype in (precision.numpy_dtype, np.float32)
            assert rel_err(dx, dx_ref) < TOL[precision]
        ours, theirs = grads(layer), grads(reference)
        for key in ours:
            assert rel_err(ours[key], theirs[key]) < TOL[precision], key


@pytest.mark.parametrize("precision", REDUCED)
def test_the_loss_of_16_bit_logits_is_computed_in_float32(precision: Precision, rng) -> None:
    """Softmax cross-entropy of 16-bit logits equals the float64 loss of the same values to
    float32 accuracy (nothing is rounded to 16 bits before the loss); ``dlogits`` is 16-bit,
    rounded once from the exact gradient."""
    shape = (2, 3, 50)
    loss = built(
        SoftmaxCrossEntropy("ce", SoftmaxCrossEntropyConfig(50), device="CPU", precision=precision),
        shape,
    )
    ref = built(
        SoftmaxCrossEntropy(
            "ce", SoftmaxCrossEntropyConfig(50), device="CPU", precision=Precision.FP64
        ),
        shape,
    )
    logits = as16(4 * rng.standard_normal(shape), precision)
    targets = rng.integers(0, 50, shape[:2])
    targets[0, 1] = -100
    value = loss.forward(logits, targets)
    expected = ref.forward(logits.astype(np.float64), targets)
    assert value == pytest.approx(expected, rel=1e-6)
    d = loss.backward()
    d_ref = ref.backward()
    assert d.dtype == precision.numpy_dtype
    np.testing.assert_array_equal(d, d_ref.astype(np.float32).astype(precision.numpy_dtype))


@pytest.mark.parametrize("precision", REDUCED)
def test_a_16_bit_product_is_the_float32_product_rounded_once(precision: Precision, rng) -> None:
    """The prefill path: float32 products of the 16-bit values, rounded once on store (not a
    16-bit accumulation, nor a second rounding for the bias)."""
    lin = built(
        Linear("lin", LinearConfig(64, 48, bias=True), device="CPU", precision=precision),
        (4, 64),
        INFERENCE,
        initialize=True,
    )
    lin.bias[...] = as16(rng.standard_normal(48), precision)
    x = as16(rng.standard_normal((4, 64)), precision)
    wide = x.astype(np.float32) @ lin.weight.astype(np.float32).T + lin.bias.astype(np.float32)
    np.testing.assert_array_equal(lin.forward(x), wide.astype(precision.numpy_dtype))


def test_16_bit_cpu_inference_weights_are_stored_as_rows() -> None:
    """16-bit CPU INFERENCE builds keep every weight ``[out, in]`` (the decode kernel streams
    rows), a packed SwiGLU's gate and up too; FP32 builds store widening layers transposed."""
    for precision, rows in ((Precision.FP32, False), (Precision.BF16, True)):
        lin = built(
            Linear("lin", LinearConfig(16, 48), device="CPU", precision=precision),
            (1, 16),
            INFERENCE,
        )
        assert lin.weight.flags.c_contiguous is rows
        mlp = built(
            SwiGLU("mlp", SwiGLUConfig(16, 24), device="CPU", precision=precision),
            (1, 16),
            INFERENCE,
        )
        packed = mlp._packed_weight()
        assert packed is not None and packed.flags.c_contiguous is rows


@needs_numba
@pytest.mark.parametrize("precision", REDUCED)
def test_a_decode_product_reads_the_16_bit_weight_without_a_copy(precision: Precision, rng) -> None:
    """A decode plan's product of a few rows runs the Numba kernel on the 16-bit weight: its
    result is the float32 product rounded (to within one rounding of the summation order), and
    the call allocates far less than the weight (no widened copy). A weight of another layout
    takes the general path, to the same values."""
    n_in, n_out = 384, 512
    weight = as16(rng.standard_normal((n_out, n_in)), precision)
    bias = as16(rng.standard_normal(n_out), precision)
    x = as16(rng.standard_normal((2, n_in)), precision)
    out = np.zeros((2, n_out), precision.numpy_dtype)
    lin = Linear("lin", LinearConfig(n_in, n_out, bias=True), device="CPU", precision=precision)
    assert _fused_linear.applies(x, weight, bias, out)
    step = lin.op.bind_forward(x, weight, bias, out)
    step()  # compiled before the measurement
    tracemalloc.start()
    step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < weight.nbytes // 10
    exact = x.astype(np.float64) @ weight.astype(np.float64).T + bias.astype(np.float64)
    ulp = 2.0**-8 if precision is Precision.BF16 else 2.0**-11
    np.testing.assert_allclose(out.astype(np.float64), exact, rtol=1.01 * ulp, atol=1e-3)
    transposed = np.ascontiguousarray(weight.T).T  # [out, in] in Fortran order
    assert not _fused_linear.applies(x, transposed, bias, out)
    general = np.zeros_like(out)
    lin.op.bind_forward(x, transposed, bias, general)()
    np.testing.assert_allclose(general.astype(np.float64), exact, rtol=1.01 * ulp, atol=1e-3)


# -------------------------------------------------------------------------------------- Llama
def _weights(precision: Precision) -> Llama:
    """A TRAINING build of :data:`CFG` in ``precision`` with the same (BF16-representable)
    weights for every precision: norm weights moved off 1."""
    model = Llama("llama", CFG, precision=Precision.FP32)
    model.build(BuildContext((2, 16), TRAINING))
    rng = np.random.default_rng(7)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p += 0.3 * rng.standard_normal(p.shape).astype(np.float32)
        p[...] = p.astype(ml_dtypes.bfloat16)  # exact in every precision
    return model


def _copy(source: Llama, target: Llama) -> None:
    for p, q in zip(source.get_parameters(), target.get_parameters(), strict=True):
        q[...] = np.asarray(p).astype(q.dtype)


@pytest.mark.parametrize("precision", REDUCED)
def test_a_llama_trains_in_16_bits(precision: Precision, rng) -> None:
    """A TRAINING build in BF16/FP16: 16-bit logits within tolerance of the float64 model of
    the same weights, float32 gradients within tolerance too, for dlogits in either dtype."""
    source = _weights(precision)
    model = Llama("llama", CFG, precision=precision)
    model.build(BuildContext((2, 16), TRAINING))
    reference = Llama("llama", CFG, precision=Precision.FP64)
    reference.build(BuildContext((2, 16), TRAINING))
    _copy(source, model)
    _copy(source, reference)
    assert model.precision is precision
    tokens = rng.integers(0, CFG.vocab_size, (2, 16))
    logits = model.forward(tokens)
    expected = reference.forward(tokens)
    assert logits.dtype == precision.numpy_dtype
    assert rel_err(logits, expected) < MODEL_TOL[precision]
    dlogits = 0.1 * rng.standard_normal(logits.shape)  # gradients far from FP16 underflow
    reference.backward(dlogits)
    for given in (dlogits.astype(np.float32), as16(dlogits, precision)):
        model.zero_gradients()
        model.backward(given)
        for (name, g), (_, g_ref) in zip(
            model.named_gradients(), reference.named_gradients(), strict=True
        ):
            assert g.dtype == np.float32, name
            assert rel_err(g, g_ref) < 2 * MODEL_TOL[precision], name


@pytest.mark.parametrize("precision", REDUCED)
def test_a_llama_generates_in_16_bits(precision: Precision, rng) -> None:
    """An INFERENCE build in BF16/FP16: 16-bit KV caches and logits; prefill and the decode plan
    within tolerance of the float64 model, the plan equal to the components' own calls, and
    generate runs."""
    source = _weights(precision)
    models = {}
    for p in (precision, Precision.FP64):
        models[p] = Llama("llama", CFG, precision=p)
        models[p].build(BuildContext((2, 32), INFERENCE, prefill_size=8))
        _copy(source, models[p])
    model, reference = models[precision], models[Precision.FP64]
    for block in model.layers:
        assert block.self_attn._state["k_cache"].dtype == precision.numpy_dtype
    prompt = rng.integers(0, CFG.vocab_size, (2, 11))
    first = model.prefill(prompt)
    assert first.dtype == precision.numpy_dtype
    assert rel_err(first, reference.prefill(prompt)) < MODEL_TOL[precision]
    token = first.argmax(axis=-1)
    for step in range(4):
        position = 11 + step
        planned = model.decode(token, position)
        assert rel_err(planned, reference.decode(token, position)) < MODEL_TOL[precision]
        token = planned.argmax(axis=-1)
    twin_model = Llama("llama", CFG, precision=precision)
    twin_model.build(BuildContext((2, 32), INFERENCE, prefill_size=8))
    _copy(source, twin_model)
    twin_model.prefill(prompt)
    model.prefill(prompt)
    for step in range(3):  # the plan against the components' calls, on the same 16-bit model
        planned = model.decode(token, 11 + step)
        by_components = twin_model._decode_components(
            twin_model.execution_context.to_device(token.reshape(-1, 1)), 11 + step
        )
        assert rel_err(planned, by_components) < TOL[precision]
        token = planned.argmax(axis=-1)
    out = model.generate(prompt, max_new_tokens=5)
    assert out.shape == (2, 16)


@pytest.mark.parametrize("precision", REDUCED)
def test_memory_of_a_16_bit_llama_is_counted_by_dtype(precision: Precision) -> None:
    """Half the parameter and cache bytes of FP32, float32 gradients, and ``required_memory``
    predicts the build exactly, dtype by dtype."""
    stats = {}
    for p in (Precision.FP32, precision):
        model = Llama("llama", CFG, precision=p)
        ctx = BuildContext((2, 16), TRAINING)
        predicted = model.required_memory(ctx)
        model.build(ctx)
        stats[p] = model.get_memory_stats()
        assert predicted == stats[p]
        assert predicted.by_dtype == stats[p].by_dtype
    wide, narrow = stats[Precision.FP32], stats[precision]
    assert narrow.parameter_bytes * 2 == wide.parameter_bytes
    assert narrow.by_dtype[str(precision)] >= narrow.parameter_bytes
    assert narrow.by_dtype["FP32"] >= wide.parameter_bytes  # the gradients, float32
    assert f"{precision} " in str(narrow) and "by dtype" in str(narrow)


# -------------------------------------------------------------------------- from_pretrained
def _checkpoint(tmp_path: Path, precision: Precision, **changes: Any) -> tuple[Path, Llama]:
    cfg = LlamaConfig(**{**CFG.__dict__, **changes})
    model = Llama("llama", cfg, precision=precision)
    model.build(BuildContext((1, 8), TRAINING))
    path = tmp_path / f"ckpt-{precision}"
    save_hf_checkpoint(model, path)
    return path, model


@pytest.mark.parametrize("precision", [*REDUCED, Precision.FP32])
def test_from_pretrained_loads_a_checkpoint_in_its_own_precision(
    tmp_path: Path, precision: Precision
) -> None:
    """A 16-bit model is saved in its dtype, and loads back in it by default, bit for bit (no
    widening); another precision is taken on request."""
    path, saved = _checkpoint(tmp_path, precision)
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"]
    model = Llama.from_pretrained(path, batch_size=1, seq_len=8)
    assert model.precision is precision
    for (name, p), (_, q) in zip(model.named_parameters(), saved.named_parameters(), strict=True):
        assert p.dtype == precision.numpy_dtype
        same = np.ascontiguousarray(p).view(np.uint8), np.ascontiguousarray(q).view(np.uint8)
        np.testing.assert_array_equal(*same, err_msg=name)
    other = Precision.FP32 if precision.is_reduced else Precision.BF16
    assert Llama.from_pretrained(path, batch_size=1, seq_len=8, precision=other).precision is other


def test_checkpoint_precision_reads_the_config_then_the_tensors(tmp_path: Path) -> None:
    """``dtype`` / ``torch_dtype`` of config.json first (with or without "torch."), the first
    float tensor's dtype when the config names none."""
    path, _ = _checkpoint(tmp_path, Precision.FP16)
    files = hf_weight_files(path)
    config = json.loads((path / "config.json").read_text())
    assert checkpoint_precision(config, files) is Precision.FP16
    for key in ("dtype", "torch_dtype"):
        config.pop(key)
    assert checkpoint_precision(config, files) is Precision.FP16  # the tensors'
    assert (
        checkpoint_precision({**config, "torch_dtype": "torch.bfloat16"}, files) is Precision.BF16
    )
    assert checkpoint_precision({**config, "dtype": "auto"}, files) is Precision.FP16
    assert checkpoint_precision({**config, "dtype": "float32"}, files) is Precision.FP32
    (path / "config.json").write_text(json.dumps(config))
    assert Llama.from_pretrained(path, batch_size=1, seq_len=8).precision is Precision.FP16


def test_from_pretrained_bounds_its_default_context(tmp_path: Path) -> None:
    """Without ``seq_len`` the context is ``min(max_position_embeddings, 4096)``; a longer one
    up to ``max_position_embeddings`` is taken when asked for."""
    long_path, _ = _checkpoint(tmp_path / "long", Precision.BF16, max_seq_len=8192)
    short_path, _ = _checkpoint(tmp_path / "short", Precision.BF16, max_seq_len=40)
    assert Llama.from_pretrained(long_path).context_length == 4096
    assert Llama.from_pretrained(short_path).context_length == 40
    assert Llama.from_pretrained(long_path, seq_len=5000).context_length == 5000


def test_bf16_cuda_ops_need_cupy_bfloat16_arrays(cuda_ctx: Any) -> None:
    """A CuPy that carries bfloat16 as uint16 bits (before CuPy 14; the context's
    ``bfloat16_native`` set False plays one) cannot run the layers' products and sums in BF16:
    the op is refused when made, naming the precisions that work; FP16 needs no bfloat16."""
    cuda_ctx.bfloat16_native = False
    for op in ("LinearOp", "RmsNormOp", "AttentionOp"):
        with pytest.raises(OpNotFoundError, match="CuPy >= 14") as info:
            create_op(op, cuda_ctx, None, Precision.BF16)
        assert info.value.other_precisions == {Precision.FP32, Precision.FP16}
    create_op("RmsNormOp", cuda_ctx, RmsNormConfig(4), Precision.FP16)
