"""BF16 and FP16 beyond one op: 16-bit storage, float32 arithmetic, one rounding per store.

Every layer op is registered in every precision on both devices; a Llama trains and generates
in BF16 and FP16 against a float64 twin holding the same (16-bit) weights, within what 16-bit
storage of the activations costs; its memory is counted by dtype; ``from_pretrained`` loads a
checkpoint in its own precision with a bounded context; a CuPy without bfloat16 arrays is
refused BF16 ops. Each layer's own 16-bit checks (forward and backward against float64, on
every device) live in its test file (``test_component_in_16_bits_matches_its_float64_twin``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from layer_helpers import INFERENCE, TRAINING, rel_err

from mila_py import BuildContext, Precision
from mila_py.components import (
    RmsNormConfig,
)
from mila_py.devices import DeviceType
from mila_py.interop.hf import checkpoint_precision, hf_weight_files, save_hf_checkpoint
from mila_py.models import Llama, LlamaConfig
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


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(2024)


def as16(x: np.ndarray, precision: Precision) -> np.ndarray:
    return np.asarray(x).astype(precision.numpy_dtype)


# ----------------------------------------------------------------------------------- registry
@pytest.mark.parametrize("device", [DeviceType.CPU, DeviceType.CUDA])
@pytest.mark.parametrize("op", LAYER_OPS)
def test_every_layer_op_is_registered_in_fp32_bf16_and_fp16(op: str, device: DeviceType) -> None:
    for precision in (Precision.FP32, Precision.BF16, Precision.FP16):
        assert is_supported(op, device, precision), (op, device, precision)


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
