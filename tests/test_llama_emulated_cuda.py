"""A whole Llama on an emulated ``CUDA:0``: the registry's CUDA ops, their kernels run on the CPU.

The components pick their ops by device type, so a Llama built for ``"CUDA:0"`` under
:func:`kernel_emulator.emulated_cuda_devices` runs every CUDA op of the Llama (NumPy arrays,
kernels compiled as C++) through the unchanged components, RoPE's fused Q/K kernel on the views
of the QKV projection included: training steps with AdamW's fused kernel, chunked prefill,
uniform and ragged decode, greedy generation. Each is compared with the same model on the CPU.
What it does not cover (CuPy itself, NVRTC, streams) is checked on a GPU by ``tests/cuda/``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from kernel_emulator import COMPILER, EmulatedContext
from layer_helpers import MEMORY_BUILDS, cpu_stats_of_a_cuda_build, move_optional_parameters

from mila_py import BuildContext, RuntimeMode
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.models import Llama, LlamaConfig
from mila_py.ops.cuda.adamw import CudaAdamWOp
from mila_py.optim import AdamW, clip_grad_norm

pytestmark = pytest.mark.skipif(COMPILER is None, reason="the kernel emulator needs g++")

TRAINING, INFERENCE = RuntimeMode.TRAINING, RuntimeMode.INFERENCE
CFG = LlamaConfig(
    vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)


def rel_err(actual: Any, expected: Any) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.linalg.norm(a), np.linalg.norm(e))
    return 0.0 if scale == 0 else float(np.linalg.norm(a - e) / scale)


@pytest.mark.parametrize(("tie", "biases"), [(False, False), (True, False), (False, True)])
def test_training_steps_equal_cpu(cuda: None, tie: bool, biases: bool) -> None:
    cfg = dataclasses.replace(
        CFG, tie_embeddings=tie, qkv_bias=biases, out_bias=biases, qk_norm=biases, mlp_bias=biases
    )
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, 12))
    targets = rng.integers(0, cfg.vocab_size, size=(2, 12))
    targets[1, :4] = -100
    runs = []
    for device in ("CPU", "CUDA:0"):
        model = Llama("llama", cfg, device=device)
        model.build(BuildContext((2, 12), TRAINING))  # the same seeded weights on both
        assert isinstance(model.execution_context, EmulatedContext) == (device != "CPU")
        loss_fn = SoftmaxCrossEntropy(
            "loss", SoftmaxCrossEntropyConfig(cfg.vocab_size), device=device
        )
        loss_fn.build(BuildContext((2, 12, cfg.vocab_size), TRAINING))
        opt = AdamW(model, lr=1e-3, eps=1e-4, weight_decay=0.1)
        assert isinstance(opt._fused, CudaAdamWOp) == (device != "CPU")
        if device != "CPU":
            assert type(model.layers[0].self_attn.rope.op).__name__ == "CudaRopeOp"
        record: dict[str, Any] = {"loss": []}
        for step in range(3):
            logits = model.forward(tokens)
            if step == 0:
                record["logits"] = logits.copy()
            record["loss"].append(loss_fn.forward(logits, targets))
            model.backward(loss_fn.backward())
            if step == 0:
                record["grads"] = {n: g.copy() for n, g in model.named_gradients()}
                record["norm"] = clip_grad_norm(model, 1e9)
            opt.step()
            model.zero_gradients()
        record["params"] = {n: p.copy() for n, p in model.named_parameters()}
        record["stats"] = model.get_memory_stats()
        runs.append(record)
    ref, got = runs
    assert rel_err(got["logits"], ref["logits"]) < 1e-5
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    for name, g in ref["grads"].items():
        assert rel_err(got["grads"][name], g) < 1e-5, name
    for name, p in ref["params"].items():
        np.testing.assert_allclose(got["params"][name], p, rtol=1e-5, atol=1e-6, err_msg=name)
    # the same arrays (NumPy ones here, so counted as the emulated GPU's host memory)
    assert got["stats"].total_bytes == ref["stats"].total_bytes


def test_inference_equals_cpu(cuda: None, tmp_path) -> None:
    rng = np.random.default_rng(6)
    trained = Llama("llama", CFG, device="CPU")
    trained.build(BuildContext((1, 8), TRAINING))
    trained.save(tmp_path / "w.safetensors")
    cpu, gpu = (Llama("llama", CFG, device=d) for d in ("CPU", "CUDA:0"))
    for model in (cpu, gpu):
        model.build(BuildContext((2, 48), INFERENCE, prefill_size=5))
        model.load(tmp_path / "w.safetensors")
    x = rng.integers(0, CFG.vocab_size, size=(2, 13))
    np.testing.assert_allclose(gpu.prefill(x), cpu.prefill(x), rtol=1e-5, atol=1e-5)
    for position in range(13, 20):
        token = rng.integers(0, CFG.vocab_size, size=2)
        np.testing.assert_allclose(
            gpu.decode(token, position), cpu.decode(token, position), rtol=1e-5, atol=1e-5
        )
    more = rng.integers(0, CFG.vocab_size, size=(2, 4))
    np.testing.assert_allclose(gpu.prefill(more, 20), cpu.prefill(more, 20), rtol=1e-5, atol=1e-5)
    positions = np.array([24, 21])  # ragged: a -inf bias per sequence
    for _ in range(4):
        token = rng.integers(0, CFG.vocab_size, size=2)
        np.testing.assert_allclose(
            gpu.decode(token, positions), cpu.decode(token, positions), rtol=1e-5, atol=1e-5
        )
        positions = positions + 1
    prompt = rng.integers(0, CFG.vocab_size, size=(2, 6))
    np.testing.assert_array_equal(gpu.generate(prompt, 10), cpu.generate(prompt, 10))
    ragged = [prompt[0], prompt[1, :3]]  # right-padded prefill, then one ragged decode
    for a, b in zip(gpu.generate(ragged, 6), cpu.generate(ragged, 6), strict=True):
        np.testing.assert_array_equal(a, b)
    ops = {type(c.op).__name__ for c in gpu._walk() if hasattr(c, "op")}
    assert {"CudaLinearOp", "CudaRmsNormOp", "CudaTokenEmbeddingOp", "CudaSwiGLUOp"} <= ops
    assert "CudaRopeOp" in ops
    assert type(gpu.layers[0].self_attn._op).__name__ == "CudaAttentionOp"
    launches = gpu.execution_context.launches
    assert any(name.startswith("rope_qk<float, ") for name in launches)


@pytest.mark.parametrize("device", ["CPU", "CUDA:0"])
def test_an_empty_batch_decodes_nothing(cuda: None, device: str) -> None:
    """decode of B == 0 sequences, at an int or per-sequence positions: no rows, and no launch
    of an empty grid (a CUDA launch error), through the model's plan and the attention."""
    model = Llama("llama", CFG, device=device)
    model.build(BuildContext((2, 16), INFERENCE))
    none = np.zeros(0, np.int64)
    for position in (0, none):
        assert model.decode(none, position).shape == (0, CFG.vocab_size)
    x = np.zeros((0, 1, CFG.dim), np.float32)
    attention = model.layers[0].self_attn
    assert attention.decode(attention.execution_context.to_device(x), none).shape[0] == 0
    assert model.cached_lengths == (0, 0)


@pytest.mark.parametrize(("tie", "biases"), [(False, False), (True, False), (False, True)])
def test_decode_plan_equals_the_component_path(
    cuda: None, tie: bool, biases: bool, tmp_path
) -> None:
    """CUDA decode runs a plan (the ops bound once to the build's buffers, as on the CPU): its
    logits and caches equal those of the components' own calls, for one position for all, for
    ragged positions and for B=1 in a B=2 build; its kernels read the step's positions from
    the plan's device buffer (int32 ``[B]``), which holds the last step's positions."""
    cfg = dataclasses.replace(
        CFG, tie_embeddings=tie, qkv_bias=biases, out_bias=biases, qk_norm=biases, mlp_bias=biases
    )
    rng = np.random.default_rng(9)
    trained = Llama("llama", cfg, device="CPU")
    trained.build(BuildContext((1, 8), TRAINING))
    move_optional_parameters(trained, rng)
    trained.save(tmp_path / "w.safetensors")
    models = []
    for _ in range(2):
        model = Llama("llama", cfg, device="CUDA:0")
        model.build(BuildContext((2, 40), INFERENCE, prefill_size=6))
        model.load(tmp_path / "w.safetensors")
        models.append(model)
    planned, components = models
    x = rng.integers(0, cfg.vocab_size, size=(2, 30))
    for model in models:
        model.prefill(x[:, :7])
    for position in range(7, 30):
        # one position for all until 15, then sequence 0 falls back by 4 (ragged); at 20 it
        # goes on alone (B=1), and sequence 1 then continues a step behind
        if position < 15:
            n_b, where = 2, position
        elif position < 20:
            n_b, where = 2, np.array([position - 4, position])
        elif position == 20:
            n_b, where = 1, position - 4
        else:
            n_b, where = 2, np.array([position - 4, position - 1])
        got = planned.decode(x[:n_b, position], where)
        want = components._decode_components(x[:n_b, position, None], where)
        assert np.abs(want).max() > 0.1  # real logits, not those of zero weights
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert planned._plans is not None and sorted(planned._plans) == [1, 2]
    assert components._plans == {}  # the reference never made one
    for n_b, plan in planned._plans.items():
        cell = plan.positions
        assert cell.device.dtype == np.int32 and cell.device.shape == (n_b,)
        assert plan.step.graph is not None  # each batch size's step replays its own graph
    last = planned._plans[2].positions
    np.testing.assert_array_equal(last.device, [29 - 4, 29 - 1])
    for a, b in zip(planned.layers, components.layers, strict=True):
        for cache in ("k_cache", "v_cache"):
            np.testing.assert_allclose(
                a.self_attn._state[cache], b.self_attn._state[cache], rtol=1e-6, atol=1e-6
            )
    assert "decode_scores" not in planned._state  # the CPU attention kernel's scratch only
    launched = set(planned.execution_context.launches)
    decode_kernels = {"attention_decode<float>", "kv_cache_write<float>"}
    assert decode_kernels <= launched
    assert not decode_kernels & set(components.execution_context.launches)


@pytest.mark.parametrize("build", MEMORY_BUILDS)
@pytest.mark.parametrize("tie", [False, True])
def test_memory_stats_equal_cpu(cuda: None, build: BuildContext, tie: bool) -> None:
    """A CUDA build holds what the CPU build holds, but for the CPU decode kernel's scores;
    each device's prediction equals its build (the GPU twin in tests/cuda also counts CuPy)."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, qkv_bias=not tie, mlp_bias=not tie)
    stats = []
    for device in ("CPU", "CUDA:0"):
        model = Llama("llama", cfg, device=device)
        predicted = model.required_memory(build)
        model.build(build)
        assert model.get_memory_stats() == predicted
        stats.append(predicted)
    # the emulated GPU's memory is NumPy arrays, which the stats count as host memory
    cuda = stats[1]
    assert cuda.host_state_bytes > 0
    on_gpu = dataclasses.replace(
        cuda, device_state_bytes=cuda.total_bytes - cuda.device_parameter_bytes
        - cuda.device_gradient_bytes, host_state_bytes=0
    )  # fmt: skip
    assert stats[0] == cpu_stats_of_a_cuda_build(on_gpu, model)
    if build.is_inference:
        assert stats[0] != on_gpu
