"""Llama network: gradients, modes, memory accounting, save/load, AdamW and a short training run.

The bodies that take ``device`` run on the CPU and on ``CUDA:0`` (a GPU, or the kernel
emulator's): training steps against the float64 model of the same weights, initialization,
the ops each layer picks, memory predictions (a CUDA build against the CPU one), 16-bit
storage against float64. Finite differences in float64 and NumPy's buffer identities are the
CPU's alone.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from cuda_arrays import CUPY_BF16, EMULATED, NO_BF16_REASON, cupy
from layer_helpers import (
    MEMORY_BUILDS,
    assert_same_optimizer_state,
    cpu_stats_of_a_cuda_build,
    move_optional_parameters,
    rel_err,
)

from mila_py import BuildContext, Precision, RuntimeMode, TrainingMode
from mila_py.component import Component
from mila_py.components import (
    Linear,
    LinearConfig,
    SoftmaxCrossEntropy,
    SoftmaxCrossEntropyConfig,
)
from mila_py.devices import create_execution_context
from mila_py.models import Llama, LlamaConfig
from mila_py.ops.cuda.adamw import CudaAdamWOp
from mila_py.ops.operation import Operation
from mila_py.optim import AdamW, clip_grad_norm

PRECISION = {np.float32: Precision.FP32, np.float64: Precision.FP64}

B, T = 2, 5


def tiny(tie: bool = False, **overrides: object) -> LlamaConfig:
    fields = dict(
        vocab_size=32,
        dim=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=24,
        max_seq_len=16,
        tie_embeddings=tie,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)  # type: ignore[arg-type]


def built(
    mode: RuntimeMode = RuntimeMode.TRAINING, tie: bool = False, device: str = "CPU", **kw: object
) -> Llama:
    model = Llama("llama", tiny(tie, **kw), device=device)
    model.build(BuildContext((B, T), mode, initialize_parameters=True))
    return model


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32, size=(B, T))


def test_forward_shapes_and_names() -> None:
    model = built()
    logits = model.forward(tokens())
    assert logits.shape == (B, T, 32)
    assert np.isfinite(logits).all()
    names = [name for name, _ in model.named_parameters()]
    assert names[0] == "embed_tokens.weight"
    assert "layer1.self_attn.qkv_proj.weight" in names
    assert "layer0.mlp.gate_proj.weight" in names
    assert names[-1] == "lm_head.weight"
    assert len(model.get_gradients()) == len(model.get_parameters())
    for p, g in zip(model.get_parameters(), model.get_gradients(), strict=True):
        assert p.shape == g.shape


@pytest.mark.parametrize(
    ("tie", "biases", "qk_norm"),
    [(False, False, False), (True, False, False), (False, True, False), (True, True, True)],
)
def test_backward_matches_finite_differences_in_float64(
    tie: bool, biases: bool, qk_norm: bool
) -> None:
    cfg = tiny(tie, qkv_bias=biases, out_bias=biases, mlp_bias=biases, qk_norm=qk_norm)
    model = Llama("llama", cfg, device="CPU", precision=Precision.FP64)
    model.build(BuildContext((B, T), RuntimeMode.TRAINING))
    rng = np.random.default_rng(1)
    names = [name for name, _ in model.named_parameters()]
    assert ("layer0.self_attn.qkv_proj.bias" in names) is biases
    assert ("layer0.self_attn.o_proj.bias" in names) is biases
    assert ("layer1.mlp.down_proj.bias" in names) is biases
    assert ("layer1.self_attn.k_norm.weight" in names) is qk_norm
    move_optional_parameters(model, rng, bias=0.3, norm=0.3)
    x = tokens(2)
    weight = rng.standard_normal((B, T, 32))  # loss = sum(weight * logits): asymmetric

    def loss() -> float:
        return float((weight * model.forward(x)).sum())

    model.forward(x)
    model.backward(weight)
    grads = {name: g.copy() for name, g in model.named_gradients()}
    assert set(grads) == {name for name, _ in model.named_parameters()}
    eps = 1e-6
    for name, p in model.named_parameters():
        for _ in range(2):  # two random directions per tensor
            direction = rng.standard_normal(p.shape)
            analytic = float((grads[name] * direction).sum())
            saved = p.copy()
            p += eps * direction
            up = loss()
            p[...] = saved - eps * direction
            down = loss()
            p[...] = saved
            numeric = (up - down) / (2 * eps)
            assert abs(analytic - numeric) <= 1e-6 * max(1.0, abs(numeric)), (
                name,
                analytic,
                numeric,
            )
        for index in [tuple(rng.integers(0, n) for n in p.shape) for _ in range(3)]:  # elements
            saved = p[index]
            p[index] = saved + eps
            up = loss()
            p[index] = saved - eps
            down = loss()
            p[index] = saved
            numeric = (up - down) / (2 * eps)
            assert abs(grads[name][index] - numeric) <= 1e-6 * max(1.0, abs(numeric)), name


@pytest.mark.parametrize("field", ["qkv_bias", "out_bias", "qk_norm", "mlp_bias", "tie_embeddings"])
def test_config_flags_must_be_bools(field: str) -> None:
    with pytest.raises(TypeError, match=field):
        tiny(**{field: 1})
    assert getattr(tiny(**{field: np.True_}), field)  # NumPy's bool is one


def test_blocks_start_from_different_weights_the_same_on_every_device(device: str) -> None:
    """Each block draws its own weights, and the draws depend on the base seed alone: a
    build on any device holds the CPU build's weights."""
    model = built(device=device)
    on_host = model.execution_context.to_host
    a = on_host(model.find_component("layer0.mlp.gate_proj").weight)
    b = on_host(model.find_component("layer1.mlp.gate_proj").weight)
    assert a.std() > 0 and not np.array_equal(a, b)
    cpu = built()
    for (name, p), (_, q) in zip(model.named_parameters(), cpu.named_parameters(), strict=True):
        np.testing.assert_array_equal(on_host(p), q, err_msg=name)


def test_gradients_accumulate_and_zero() -> None:
    model = built()
    x = tokens()
    dlogits = np.ones((B, T, 32), dtype=np.float32)
    model.forward(x)
    model.backward(dlogits)
    first = [g.copy() for g in model.get_gradients()]
    model.forward(x)
    model.backward(dlogits)
    for a, b in zip(first, model.get_gradients(), strict=True):
        np.testing.assert_allclose(b, 2 * a, rtol=1e-5, atol=1e-6)
    model.zero_gradients()
    assert all(not g.any() for g in model.get_gradients())


def test_eval_mode_forward_leaves_gradients_alone() -> None:
    model = built()
    model.set_training_mode(TrainingMode.EVAL)
    assert model.get_component("layer0").training_mode is TrainingMode.EVAL
    model.forward(tokens())
    assert all(not g.any() for g in model.get_gradients())
    # a backward differentiates the last forward, whichever mode ran it (docs/llama.md)
    dlogits = np.random.default_rng(5).standard_normal((B, T, 32)).astype(np.float32)
    model.backward(dlogits)
    reference = built()
    reference.forward(tokens())
    reference.backward(dlogits)
    for got, want in zip(model.get_gradients(), reference.get_gradients(), strict=True):
        np.testing.assert_array_equal(got, want)


def _owned_arrays(root: Component) -> list[np.ndarray]:
    """Every distinct base array reachable from the tree's objects (independent of MemoryStats)."""
    seen: dict[int, np.ndarray] = {}

    def visit(value: object) -> None:
        if isinstance(value, np.ndarray):
            base = value
            while base.base is not None and isinstance(base.base, np.ndarray):
                base = base.base
            seen[id(base)] = base
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, list | tuple):
            for v in value:
                visit(v)
        elif isinstance(value, Operation):
            for v in vars(value).values():
                visit(v)
            for a in value.state_arrays():
                visit(a)

    for component in root._walk():
        for key, value in vars(component).items():
            if key.startswith("_saved") or key in ("_hidden",):
                continue  # references to inputs of the last call, not owned memory
            visit(value)
    return list(seen.values())


@pytest.mark.parametrize("n_b", [1, B])
@pytest.mark.parametrize("tie", [False, True])
def test_a_smaller_training_call_keeps_nothing_outside_the_build_buffers(
    n_b: int, tie: bool
) -> None:
    """A forward with fewer tokens (and sequences) than the build keeps its attention
    probabilities for backward in the build's buffer (a leading view), not in a new array the
    memory stats would miss; its gradients equal those of a model built for that shape (the
    tied head's too, whose input gradient is a leading view of its buffer)."""
    model = built(tie=tie)
    small = Llama("llama", model.config, device="CPU")
    small.build(BuildContext((n_b, T - 3), RuntimeMode.TRAINING, initialize_parameters=False))
    for (_, p), (_, q) in zip(model.named_parameters(), small.named_parameters(), strict=True):
        q[...] = p
    x = tokens()[:n_b, : T - 3]
    dlogits = np.random.default_rng(3).standard_normal((n_b, T - 3, 32)).astype(np.float32)
    for m in (model, small):
        m.forward(x)
        m.backward(dlogits)
    for block in model.layers:
        attn = block.self_attn
        assert np.shares_memory(attn._saved[3], attn._state["probs"])
    for (name, g), (_, h) in zip(model.named_gradients(), small.named_gradients(), strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("mode", [RuntimeMode.TRAINING, RuntimeMode.INFERENCE])
@pytest.mark.parametrize("tie", [False, True])
def test_memory_stats_equal_the_arrays_the_network_owns(mode: RuntimeMode, tie: bool) -> None:
    # the untied case also has every optional part: attention biases and Q/K head norms
    extras = {} if tie else {"qkv_bias": True, "out_bias": True, "qk_norm": True, "mlp_bias": True}
    model = built(mode, tie=tie, **extras)
    model.forward(tokens())
    stats = model.get_memory_stats()
    owned = _owned_arrays(model)
    assert stats.device_total_bytes == sum(a.nbytes for a in owned)
    if mode is RuntimeMode.INFERENCE:
        assert stats.device_gradient_bytes == 0
        assert model.get_gradients() == []


@pytest.mark.parametrize("build", MEMORY_BUILDS)
@pytest.mark.parametrize("tie", [False, True])
def test_required_memory_equals_the_build_and_cuda_holds_what_the_cpu_holds(
    device: str, build: BuildContext, tie: bool
) -> None:
    """Each device's prediction equals its build; a CUDA build holds what the CPU build
    holds, but for the CPU decode kernel's scratch (:func:`cpu_stats_of_a_cuda_build`). The
    untied case has every optional part."""
    cfg = tiny(tie, vocab_size=50, dim=32, hidden_dim=48, max_seq_len=64, **({} if tie else EXTRAS))
    stats = []
    for where in dict.fromkeys(("CPU", device)):
        model = Llama("llama", cfg, device=where)
        predicted = model.required_memory(build)
        model.build(build)
        assert model.get_memory_stats() == predicted
        stats.append(predicted)
    if device == "CPU":
        assert stats[0].host_total_bytes == 0
        return
    cpu, cuda = stats
    if EMULATED:  # the emulated GPU's memory is NumPy arrays, which count as host memory
        assert cuda.host_state_bytes > 0
        device_state = cuda.total_bytes - cuda.device_parameter_bytes - cuda.device_gradient_bytes
        cuda = dataclasses.replace(cuda, device_state_bytes=device_state, host_state_bytes=0)
    assert cpu == cpu_stats_of_a_cuda_build(cuda, model)
    assert cuda.host_total_bytes == 0
    if build.is_inference:
        assert cpu != cuda


def test_every_layer_runs_its_devices_ops(device: str) -> None:
    """Every layer picked its device's op from the registry, RoPE's fused Q/K kernel on the
    views of the QKV projection included (launched, where the emulator records launches)."""
    model = Llama("llama", tiny(), device=device)
    model.build(BuildContext((B, 16), RuntimeMode.INFERENCE, prefill_size=4))
    model.prefill(tokens())
    ops = {type(c.op).__name__ for c in model._walk() if hasattr(c, "op")}
    kind = "Cpu" if device == "CPU" else "Cuda"
    for layer in ("Linear", "RmsNorm", "TokenEmbedding", "SwiGLU", "Rope"):
        assert f"{kind}{layer}Op" in ops, (layer, ops)
    assert type(model.layers[0].self_attn._op).__name__ == f"{kind}AttentionOp"
    if device != "CPU" and EMULATED:
        launches = model.execution_context.launches
        assert any(name.startswith("rope_qk<float, ") for name in launches)


def test_rope_table_is_shared_by_every_layer() -> None:
    model = built()
    tables = {id(block.self_attn.rope.table) for block in model.layers}
    assert len(tables) == 1


def test_inference_build_is_smaller_and_cannot_backward() -> None:
    train, infer = built(RuntimeMode.TRAINING), built(RuntimeMode.INFERENCE)
    assert infer.get_memory_stats().total_bytes < train.get_memory_stats().total_bytes
    with pytest.raises(RuntimeError, match="TRAINING"):
        infer.backward(np.zeros((B, T, 32), dtype=np.float32))
    with pytest.raises(RuntimeError, match="TRAINING"):  # a block of it, too
        infer.layers[0].backward(np.zeros((B, T, 16), dtype=np.float32))
    with pytest.raises(RuntimeError, match="TRAINING"):  # and one that is not built
        Llama("unbuilt", tiny(), device="CPU").layers[0].backward(None)


def test_save_load_round_trip_and_mismatch_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = built()
    path = tmp_path / "w.safetensors"
    a.save(path)
    b = Llama("llama", tiny(), device="CPU")
    b.build(BuildContext((B, T), RuntimeMode.INFERENCE))
    b.load(path)
    x = tokens(5)
    np.testing.assert_array_equal(a.forward(x), b.forward(x))

    other = Llama("llama", tiny(n_layers=3, hidden_dim=20), device="CPU")
    other.build(BuildContext((B, T), RuntimeMode.INFERENCE))
    before = [p.copy() for p in other.get_parameters()]
    with pytest.raises(ValueError) as info:
        other.load(path)
    message = str(info.value)
    assert "missing: layer2." in message
    assert "shape of layer0.mlp.gate_proj.weight" in message
    assert "nothing was loaded" in message
    for p, q in zip(before, other.get_parameters(), strict=True):
        np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_hf_checkpoint_round_trip_keeps_the_scaling(tmp_path, key: str) -> None:  # type: ignore[no-untyped-def]
    """save_hf_checkpoint writes the legacy ``type`` key as transformers 5's ``rope_type``, so
    from_pretrained reads back the same scaling and the same logits."""
    from mila_py.interop.hf import save_hf_checkpoint

    model = built(rope_scaling={key: "linear", "factor": 3.0})
    save_hf_checkpoint(model, tmp_path / "ckpt")
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == "linear"
    assert "type" not in written["rope_parameters"]
    loaded = Llama.from_pretrained(
        tmp_path / "ckpt", runtime_mode=RuntimeMode.TRAINING, batch_size=B, seq_len=T
    )
    assert loaded.config.rope_scaling["factor"] == 3.0
    np.testing.assert_allclose(loaded.forward(tokens()), model.forward(tokens()), atol=1e-6)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "ntk_alpha", "alpha": 100.0}, "not one transformers reads"),
        ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8},
         "scales it from max_position_embeddings"),
    ],
)  # fmt: skip
def test_hf_checkpoint_refuses_a_scaling_transformers_reads_otherwise(
    tmp_path, scaling: dict, message: str
) -> None:  # type: ignore[no-untyped-def]
    from mila_py.interop.hf import save_hf_checkpoint

    model = built(rope_scaling=scaling)
    with pytest.raises(ValueError, match=message):
        save_hf_checkpoint(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    same = {**scaling, "original_max_position_embeddings": model.config.max_seq_len}
    if scaling["rope_type"] == "dynamic":  # from max_seq_len, as transformers reads it
        save_hf_checkpoint(built(rope_scaling=same), tmp_path / "ok")
        assert (tmp_path / "ok" / "config.json").exists()


def test_tied_checkpoint_storing_only_lm_head_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A tied checkpoint whose shared matrix is stored as ``lm_head.weight`` alone loads as
    transformers loads it (the embedding is that matrix); one storing two different matrices
    is still refused."""
    from safetensors.numpy import load_file, save_file

    from mila_py.interop.hf import save_hf_checkpoint

    model = built(tie=True)
    folder = tmp_path / "ckpt"
    save_hf_checkpoint(model, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = Llama.from_pretrained(
        folder, runtime_mode=RuntimeMode.TRAINING, batch_size=B, seq_len=T
    )
    np.testing.assert_array_equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    np.testing.assert_allclose(loaded.forward(tokens()), model.forward(tokens()), atol=1e-6)
    tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lm_head\.weight differs"):
        Llama.from_pretrained(folder)


def test_adamw_step_matches_the_formula() -> None:
    model = built()
    model.forward(tokens())
    model.backward(np.random.default_rng(3).standard_normal((B, T, 32)).astype(np.float32))
    params = [p.copy().astype(np.float64) for p in model.get_parameters()]
    grads = [g.copy().astype(np.float64) for g in model.get_gradients()]
    opt = AdamW(model, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    opt.step()
    for name_p, p0, g in zip(model.named_parameters(), params, grads, strict=True):
        name, p = name_p
        decay = 0.1 if p.ndim >= 2 else 0.0
        m_hat = (0.1 * g) / 0.1
        v_hat = (0.01 * g * g) / 0.01
        expected = p0 * (1 - 0.01 * decay) - 0.01 * m_hat / (np.sqrt(v_hat) + 1e-8)
        np.testing.assert_allclose(p, expected, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("fused", [False, True], ids=["array-code", "fused"])
def test_adamw_scales_before_squaring_so_huge_gradients_still_step(fused: bool) -> None:
    """(1 - beta2) * g * g left to right, as torch: g = 1e20 squares to inf in float32, but
    0.001 * g * g does not; the first step then moves every weight by lr (m_hat / sqrt(v_hat)
    = sign(g)), where an infinite v froze the weights for good."""
    lin = Linear("lin", LinearConfig(3, 2), device="CPU")
    lin.build(BuildContext((1, 3), RuntimeMode.TRAINING))
    lin.weight[...] = 1.0
    opt = AdamW(lin, lr=0.1, weight_decay=0.0)
    if not fused:
        opt._fused = None
    elif opt._fused is None:
        pytest.skip("Numba is not installed or MILA_PY_CPU_BACKEND=numpy")
    lin.get_gradients()[0][...] = np.float32(1e20)
    opt.step()
    np.testing.assert_allclose(lin.weight, 0.9, rtol=1e-6)
    assert np.isfinite(opt._v[0]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_fused_adamw_equals_the_array_code_bit_for_bit(dtype) -> None:  # type: ignore[no-untyped-def]
    from mila_py.ops.cpu import _fused_layers
    from mila_py.ops.cpu.adamw import CpuAdamWOp

    if not _fused_layers.enabled(dtype):
        pytest.skip("Numba is not installed or MILA_PY_CPU_BACKEND=numpy")
    models = []
    for _ in range(2):
        lin = Linear("lin", LinearConfig(9, 5, bias=True), device="CPU", precision=PRECISION[dtype])
        lin.build(BuildContext((2, 9), RuntimeMode.TRAINING))
        models.append(lin)
    plain = AdamW(models[0], lr=3e-3, weight_decay=0.1)
    fused = AdamW(models[1], lr=3e-3, weight_decay=0.1)
    assert isinstance(fused._fused, CpuAdamWOp)
    plain._fused = None  # the array code, the reference
    rng = np.random.default_rng(7)
    for step in range(3):
        if step == 2:  # a schedule computed with NumPy hands over np.float64 values
            plain.lr = fused.lr = np.float64(3e-3) * (1 + np.cos(np.pi * 0.3)) / 2
        for g0, g1 in zip(models[0].get_gradients(), models[1].get_gradients(), strict=True):
            g0[...] = g1[...] = (rng.standard_normal(g0.shape) * 1e-2).astype(dtype)
        g0.flat[0] = g1.flat[0] = 0.0  # v = 0 on the first step: the eps guard
        plain.step()
        fused.step()
    assert_same_optimizer_state(models, plain, fused)


def test_cpu_fused_adamw_takes_fortran_order_and_refuses_mixed_layouts() -> None:
    from mila_py.ops.cpu import _fused_layers
    from mila_py.ops.cpu.adamw import CpuAdamWOp

    if not _fused_layers.enabled(np.float32):
        pytest.skip("Numba is not installed or MILA_PY_CPU_BACKEND=numpy")
    op = CpuAdamWOp(create_execution_context("CPU"), None, Precision.FP32)
    rng = np.random.default_rng(8)
    p, g = (np.asfortranarray(rng.standard_normal((4, 6)).astype(np.float32)) for _ in range(2))
    m, v = np.zeros_like(p), np.zeros_like(p)
    kw = {"decay": 0.99, "betas": (0.9, 0.999), "correction2": 0.001, "eps": 1e-8}
    v1 = np.float32(0.001) * g * g
    expected = p * np.float32(0.99) - np.float32(0.1) * (
        (np.float32(0.1) * g) / (np.sqrt(v1) / np.float32(np.sqrt(0.001)) + 1e-8)
    )
    op.step(p, g, m, v, step_size=0.1, **kw)
    np.testing.assert_allclose(p, expected, rtol=1e-6)
    before = p.copy()
    with pytest.raises(ValueError, match="one layout"):
        op.step(p, np.ascontiguousarray(g), m, v, step_size=0.1, **kw)
    np.testing.assert_array_equal(p, before)  # nothing was updated


def test_cpu_adamw_op_settles_the_backend_when_created(monkeypatch: pytest.MonkeyPatch) -> None:
    from mila_py.ops.cpu import _fused_layers
    from mila_py.ops.cpu.adamw import CpuAdamWOp

    def op() -> CpuAdamWOp:
        return CpuAdamWOp(create_execution_context("CPU"), None, Precision.FP32)

    p = np.zeros(8, np.float32)
    fused = op()
    assert fused.accepts(p, p, p, p) is _fused_layers.AVAILABLE
    monkeypatch.setenv("MILA_PY_CPU_BACKEND", "numpy")
    assert fused.accepts(p, p, p, p) is _fused_layers.AVAILABLE  # read at creation, not per call
    assert not op().accepts(p, p, p, p)  # an op created now takes the array code


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_bad_calls_leave_every_gradient_and_activation_alone(tie: bool) -> None:
    """A forward at a position a TRAINING build cannot take, and dlogits of the wrong dtype
    or shape, raise before anything is written: the next backward gives the gradients of the
    last good forward, tied head included."""
    ids = tokens(1)
    dlogits = np.random.default_rng(2).standard_normal((B, T, 32)).astype(np.float32)
    reference = built(tie=tie)
    reference.forward(ids)
    reference.backward(dlogits)
    want = [g.copy() for g in reference.get_gradients()]

    model = built(tie=tie)
    model.forward(ids)
    with pytest.raises(ValueError, match="position 0"):
        model.forward(tokens(3), position_offset=1)
    with pytest.raises(ValueError, match="position_offset"):
        model.forward(tokens(3), position_offset=-1)
    for bad, error in ((dlogits.astype(np.float64), TypeError), (dlogits[:1], ValueError)):
        with pytest.raises(error, match=r"dlogits|dy"):
            model.backward(bad)
        assert all(not g.any() for g in model.get_gradients())
    model.backward(dlogits)
    for got, expected in zip(model.get_gradients(), want, strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"weight_decay": float("nan")},
        {"weight_decay": -0.1},
        {"weight_decay": float("inf")},
        {"lr": float("nan")},
        {"lr": float("inf")},
        {"lr": 0.0},
        {"eps": float("nan")},
        {"eps": 0.0},
        {"betas": (1.0, 0.999)},
        {"betas": (0.9, float("nan"))},
        {"betas": (0.9,)},
        {"betas": (0.9, 0.99, 0.5)},
        {"betas": 0.9},
        {"lr": "0.1"},
        {"lr": None},
        {"eps": True},
    ],
    ids=str,
)
def test_adamw_refuses_hyper_parameters_that_are_not_finite(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="AdamW"):
        AdamW(built(), **kwargs)


@pytest.mark.parametrize(
    ("name", "value"), [("lr", None), ("lr", -1.0), ("betas", (0.9,)), ("eps", "x")]
)
def test_a_refused_adamw_step_changes_nothing_and_the_next_step_is_the_first(
    name: str, value: object
) -> None:
    """A hyper-parameter set to a bad value between steps is refused before the step counts:
    once fixed, the next step has the bias correction of step 1."""
    model = built()
    model.forward(tokens())
    model.backward(np.random.default_rng(3).standard_normal((B, T, 32)).astype(np.float32))
    twin = built()
    for a, b in zip(twin.get_parameters(), model.get_parameters(), strict=True):
        a[...] = b
    for a, b in zip(twin.get_gradients(), model.get_gradients(), strict=True):
        a[...] = b
    opt, reference = AdamW(model, lr=0.01), AdamW(twin, lr=0.01)
    before = [p.copy() for p in model.get_parameters()]
    good = getattr(opt, name)
    setattr(opt, name, value)
    with pytest.raises(ValueError, match=name.rstrip("s")):
        opt.step()
    assert opt.step_count == 0
    for p, p0 in zip(model.get_parameters(), before, strict=True):
        np.testing.assert_array_equal(p, p0)
    setattr(opt, name, good)
    opt.step()
    reference.step()
    for p, q in zip(model.get_parameters(), twin.get_parameters(), strict=True):
        np.testing.assert_array_equal(p, q)


def test_clip_grad_norm() -> None:
    model = built()
    for g in model.get_gradients():
        g[...] = 1.0
    count = sum(g.size for g in model.get_gradients())
    norm = clip_grad_norm(model, 1.0)
    assert norm == pytest.approx(np.sqrt(count))
    after = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in model.get_gradients()))
    assert after == pytest.approx(1.0, rel=1e-4)


def test_clip_grad_norm_refuses_a_bad_max_norm_and_touches_nothing() -> None:
    model = built()
    for g in model.get_gradients():
        g[...] = 1.0
    for bad in (0, 0.0, -1.0, float("nan"), True, "1", None, np.array([1.0, 2.0])):
        with pytest.raises(ValueError, match="max_norm"):
            clip_grad_norm(model, bad)  # type: ignore[arg-type]
    assert all((g == 1.0).all() for g in model.get_gradients())
    assert clip_grad_norm(model, np.float32(1e9)) > 0  # NumPy numbers are numbers
    assert clip_grad_norm(model, np.array(1e9)) > 0
    assert clip_grad_norm(model, float("inf")) > 0  # measures without clipping
    assert all((g == 1.0).all() for g in model.get_gradients())


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_clip_grad_norm_of_non_finite_gradients_touches_nothing(bad: float) -> None:
    """The norm is returned as it is and no gradient is scaled (the caller skips the step);
    with error_if_nonfinite it raises, as torch's clip_grad_norm_ does."""
    model = built()
    for g in model.get_gradients():
        g[...] = 1.0
    model.get_gradients()[0].flat[0] = bad
    before = [g.copy() for g in model.get_gradients()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy warning either
        norm = clip_grad_norm(model, 1.0)
    assert not np.isfinite(norm) and (np.isnan(norm) == np.isnan(bad))
    for g, was in zip(model.get_gradients(), before, strict=True):
        np.testing.assert_array_equal(g, was)
    with pytest.raises(ValueError, match="nothing was clipped"):
        clip_grad_norm(model, 1.0, error_if_nonfinite=True)


def test_training_brings_the_loss_down() -> None:
    from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig

    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 40, dtype=np.uint8)
    data = (text % 32).astype(np.int64)
    model = Llama("llama", tiny(max_seq_len=32), device="CPU")
    n_b, n_t = 4, 16
    model.build(BuildContext((n_b, n_t), RuntimeMode.TRAINING))
    loss_fn = SoftmaxCrossEntropy("loss", SoftmaxCrossEntropyConfig(32), device="CPU")
    loss_fn.build(BuildContext((n_b, n_t, 32), RuntimeMode.TRAINING))
    opt = AdamW(model, lr=1e-2, weight_decay=0.0)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(40):
        starts = rng.integers(0, data.size - n_t - 1, size=n_b)
        window = np.stack([data[s : s + n_t + 1] for s in starts])
        losses.append(loss_fn.forward(model.forward(window[:, :-1]), window[:, 1:]))
        model.backward(loss_fn.backward())
        opt.step()
        model.zero_gradients()
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


#: every optional part of the Llama config: attention and MLP biases, Q/K head norms (Qwen3)
EXTRAS: dict[str, Any] = {"qkv_bias": True, "out_bias": True, "mlp_bias": True, "qk_norm": True}


@pytest.mark.parametrize(("tie", "extras"), [(False, False), (True, False), (False, True)])
def test_training_steps_match_float64(device: str, tie: bool, extras: bool) -> None:
    """Three steps of forward, loss (a standalone component with a context of its own),
    backward, clip_grad_norm and AdamW (the device's fused kernel) of the float32 model on
    ``device`` against the same steps of the float64 CPU model from the same weights: logits,
    losses, the gradient norm, every gradient and every parameter after the steps (tied and
    untied embeddings, every optional part)."""
    cfg = tiny(tie, max_seq_len=32, **(EXTRAS if extras else {}))
    n_b, n_t = 2, 16
    model = Llama("llama", cfg, device=device)
    model.build(BuildContext((n_b, n_t), RuntimeMode.TRAINING))
    move_optional_parameters(model, np.random.default_rng(4), bias=0.3, norm=0.3)
    reference = Llama("llama", cfg, device="CPU", precision=Precision.FP64)
    reference.build(BuildContext((n_b, n_t), RuntimeMode.TRAINING, initialize_parameters=False))
    for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        q[...] = model.execution_context.to_host(p)
    rng = np.random.default_rng(20260601)
    tokens = rng.integers(0, cfg.vocab_size, size=(n_b, n_t))
    targets = rng.integers(0, cfg.vocab_size, size=(n_b, n_t))
    targets[0, :3] = -100
    runs = []
    for m in (reference, model):
        ctx = m.execution_context
        loss_fn = SoftmaxCrossEntropy(
            "loss", SoftmaxCrossEntropyConfig(cfg.vocab_size), device=str(m.device_id),
            precision=m.precision,
        )  # fmt: skip
        loss_fn.build(BuildContext((n_b, n_t, cfg.vocab_size), RuntimeMode.TRAINING))
        # eps 1e-4: AdamW's update g / (|g| + eps) would amplify float32 noise in near-zero
        # gradients
        opt = AdamW(m, lr=1e-3, eps=1e-4, weight_decay=0.1)
        on_cuda = m.device_id.device_type.name == "CUDA"
        assert isinstance(opt._fused, CudaAdamWOp) == on_cuda
        assert type(m.layers[0].self_attn.rope.op).__name__ == (
            "CudaRopeOp" if on_cuda else "CpuRopeOp"
        )
        tok, tgt = ctx.to_device(tokens), ctx.to_device(targets)
        record: dict[str, Any] = {"loss": []}
        for step in range(3):
            logits = m.forward(tok)
            if step == 0:
                record["logits"] = ctx.to_host(logits)
            record["loss"].append(loss_fn.forward(logits, tgt))
            m.backward(loss_fn.backward())
            if step == 0:
                record["grads"] = {n: ctx.to_host(g) for n, g in m.named_gradients()}
                record["norm"] = clip_grad_norm(m, 1e9)
            opt.step()
            m.zero_gradients()
        record["params"] = {n: ctx.to_host(p) for n, p in m.named_parameters()}
        runs.append(record)
    ref, got = runs
    assert rel_err(got["logits"], ref["logits"]) < 1e-5
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        # relative to the gradient, or to a thousandth of the whole model's where it nearly
        # cancels (Q/K head norms: ~1e-7 of it)
        scale = max(float(np.linalg.norm(g)), 1e-3 * ref["norm"])
        assert np.linalg.norm(got["grads"][name] - g) < 2e-5 * scale, name
    for name, p in ref["params"].items():
        np.testing.assert_allclose(got["params"][name], p, rtol=1e-5, atol=1e-6, err_msg=name)


#: a 16-bit Llama against the float64 one of the same weights: each layer rounds its float32
#: results once per store
REDUCED_TOL = {Precision.BF16: 2e-2, Precision.FP16: 3e-3}


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16], ids=str)
def test_a_16_bit_llama_matches_float64(device: str, precision: Precision) -> None:
    """BF16/FP16 storage on ``device`` (on a GPU: cuBLAS products with float32 accumulation,
    the kernels' 16-bit instantiations) against the float64 CPU model of the same weights
    (exact in both 16-bit types): training logits and float32 gradients, chunked prefill,
    uniform and ragged decode over the 16-bit KV cache, greedy generation."""
    if device != "CPU" and precision is Precision.BF16 and not CUPY_BF16:
        pytest.skip(NO_BF16_REASON)
    cfg = tiny(vocab_size=50, dim=32, hidden_dim=48, max_seq_len=64)
    source = Llama("llama", cfg, device="CPU")
    source.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    for p in source.get_parameters():
        p[...] = p.astype(ml_dtypes.bfloat16)

    def pair(shape: tuple[int, int], mode: RuntimeMode, prefill: int = 0) -> list[Llama]:
        models = []
        for where, p in ((device, precision), ("CPU", Precision.FP64)):
            model = Llama("llama", cfg, device=where, precision=p)
            model.build(
                BuildContext(shape, mode, initialize_parameters=False, prefill_size=prefill)
            )
            ctx = model.execution_context
            for q, w in zip(model.get_parameters(), source.get_parameters(), strict=True):
                q[...] = ctx.to_device(w.astype(q.dtype))
            models.append(model)
        return models

    tol = REDUCED_TOL[precision]
    rng = np.random.default_rng(20260601)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 12))
    model, reference = pair((2, 12), RuntimeMode.TRAINING)
    ctx = model.execution_context
    logits = model.forward(ctx.to_device(tokens))
    assert logits.dtype == precision.numpy_dtype
    assert rel_err(ctx.to_host(logits), reference.forward(tokens)) < tol
    dlogits = np.full(logits.shape, 0.1, np.float32)
    model.backward(ctx.to_device(dlogits))
    reference.backward(dlogits.astype(np.float64))
    for (name, g), (_, want) in zip(
        model.named_gradients(), reference.named_gradients(), strict=True
    ):
        assert g.dtype == np.float32, name
        assert rel_err(ctx.to_host(g), want) < 2 * tol, name
    model, reference = pair((2, 40), RuntimeMode.INFERENCE, prefill=5)
    on_host = model.execution_context.to_host  # (bfloat16 comes back as ml_dtypes' bfloat16)
    x = rng.integers(0, cfg.vocab_size, size=(2, 13))
    assert rel_err(on_host(model.prefill(x)), reference.prefill(x)) < tol
    for position in range(13, 20):
        token = rng.integers(0, cfg.vocab_size, size=2)
        got = on_host(model.decode(token, position))
        assert rel_err(got, reference.decode(token, position)) < tol
    token, ragged = rng.integers(0, cfg.vocab_size, size=2), np.array([20, 17])
    assert rel_err(on_host(model.decode(token, ragged)), reference.decode(token, ragged)) < tol
    assert model.generate(x[:, :5], max_new_tokens=4).shape == (2, 9)


@pytest.mark.real_gpu("streams")
def test_cuda_contexts_of_one_gpu_share_its_stream(cuda_device: str) -> None:
    """A model and a loss with contexts of their own run in call order (one stream)."""
    a, b = create_execution_context(cuda_device), create_execution_context(cuda_device)
    assert a.stream is b.stream
    assert a.stream is not cupy.cuda.Stream.null


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda: tiny(dim=16.0), TypeError, "dim must be an int"),
        (lambda: tiny(n_layers="2"), TypeError, "n_layers must be an int"),
        (lambda: tiny(dim=0), ValueError, "dim must be > 0"),
        (lambda: tiny(norm_eps="x"), TypeError, "norm_eps must be a number"),
        (lambda: tiny(norm_eps=float("nan")), ValueError, "norm_eps must be finite"),
        (lambda: tiny(head_dim="4"), TypeError, "head_dim must be an int"),
        (lambda: tiny(head_dim=0), ValueError, "head_dim must be > 0"),
    ],
    ids=[
        "float-dim",
        "str-layers",
        "zero-dim",
        "str-eps",
        "nan-eps",
        "str-head-dim",
        "zero-head-dim",
    ],
)
def test_config_fields_of_the_wrong_type_or_value(make: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        make()


def test_wrong_types_raise_type_error_and_leave_the_state_alone() -> None:
    from mila_py.components import AttentionConfig, GroupedQueryAttention

    assert tiny(dim=np.int64(16)).dim == 16  # NumPy ints are ints
    model = built(RuntimeMode.INFERENCE)
    with pytest.raises(TypeError, match="BuildContext"):
        model.required_memory((B, T))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="str path"):
        model.find_component(None)  # type: ignore[arg-type]
    attn = GroupedQueryAttention("attn", AttentionConfig(16, 4, 2, max_seq_len=16), device="CPU")
    attn.build(BuildContext((1, 8, 16), RuntimeMode.INFERENCE, initialize_parameters=True))
    x = np.ones((1, 2, 16), np.float32)
    attn.forward(x, 0)
    state = {name: a.copy() for name, a in attn.qkv_proj._state.items()}
    with pytest.raises(TypeError, match="position_offset must be an int"):
        attn.forward(x, 1.5)
    with pytest.raises(ValueError, match=r"decode takes x \[B, 1, dim\]"):
        attn.decode(x, 3)
    with pytest.raises(ValueError, match=r"decode takes x \[B, 1, dim\]"):
        attn.decode(None, 3)
    for name, saved in state.items():  # nothing written by the failed calls
        np.testing.assert_array_equal(attn.qkv_proj._state[name], saved)


def _trained_parts() -> dict[str, Any]:
    """A Llama, its first block and a standalone attention, each after one TRAINING forward,
    with the input and upstream gradient that forward's backward takes."""
    from mila_py.components import AttentionConfig, GroupedQueryAttention

    rng = np.random.default_rng(5)
    model = built()
    attn = GroupedQueryAttention("attn", AttentionConfig(16, 4, 2, max_seq_len=16), device="CPU")
    attn.build(BuildContext((B, T, 16), RuntimeMode.TRAINING, initialize_parameters=True))
    x = rng.standard_normal((B, T, 16)).astype(np.float32)
    parts: dict[str, Any] = {
        "llama": (model, tokens(), (B, T, 32)),
        "block": (built().layers[0], x, (B, T, 16)),
        "attention": (attn, x, (B, T, 16)),
    }
    return {
        name: (component, data, rng.standard_normal(shape).astype(np.float32))
        for name, (component, data, shape) in parts.items()
    }


@pytest.mark.parametrize("part", ["llama", "block", "attention"])
def test_a_forward_of_no_tokens_is_refused_before_it_writes(part: str) -> None:
    """T = 0 raised a NumPy reshape error from the attention after the embedding and the first
    layers had overwritten what the last forward's backward reads."""
    component, data, dy = _trained_parts()[part]
    component.forward(data)
    expected = _gradients_after(component, dy)
    component.zero_gradients()
    component.forward(data)
    with pytest.raises(ValueError, match="T >= 1"):
        component.forward(data[:, :0])
    np.testing.assert_array_equal(_gradients_after(component, dy), expected)


@pytest.mark.parametrize("part", ["block", "attention"])
def test_a_block_given_its_own_output_back_is_refused(part: str) -> None:
    """The block keeps its input for backward and its last child overwrites its output buffer:
    fed its own output it computed wrong gradients (the attention's qkv_proj gradient, the
    block's input gradient). It is refused, nothing written; a copy runs."""
    component, x, dy = _trained_parts()[part]
    y = component.forward(x)
    expected = _gradients_after(component, dy)
    component.zero_gradients()
    y = component.forward(x)
    with pytest.raises(ValueError, match=r"x overlaps .*pass a copy"):
        component.forward(y)
    np.testing.assert_array_equal(_gradients_after(component, dy), expected)
    assert component.forward(y.copy()).shape == y.shape


def _gradients_after(component: Component, dy: np.ndarray) -> np.ndarray:
    """Every parameter gradient after ``backward(dy)``, and the input gradient, concatenated."""
    dx = component.backward(dy)
    parts = [g.ravel() for g in component.get_gradients()]
    if dx is not None:
        parts.append(np.asarray(dx).ravel())
    return np.concatenate(parts)
