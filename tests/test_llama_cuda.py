"""The whole Llama on ``CUDA:0`` against the same model on the CPU, on a GPU and on the kernel
emulator (``cuda_device``: the registry's CUDA ops, their kernels compiled with g++ there).

- TRAINING: logits, loss, every gradient and every parameter after AdamW steps (its fused
  kernel) equal to the CPU model's with the same weights (tied and untied embeddings, every
  optional part); the loss a standalone component with a context of its own;
- INFERENCE: chunked prefill, uniform and ragged decode logits (the decode plan, its steps
  replayed from their CUDA graphs), greedy ``generate`` tokens; a captured step on new inputs,
  and a capture that allocates refused; an empty batch;
- ``get_memory_stats()`` (and ``required_memory``) against the CPU build's;
- BF16 and FP16 storage against the CPU in the same precision.

"Equal" is fp32 parity: cuBLAS and the GPU's reductions sum in other orders than NumPy, so
results agree to ~1e-6 relative, checked at 1e-5.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from cuda_arrays import EMULATED, cupy
from layer_helpers import MEMORY_BUILDS, cpu_stats_of_a_cuda_build

from mila_py import BuildContext, Precision, RuntimeMode, devices
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.devices.graph import capture
from mila_py.models import Llama, LlamaConfig
from mila_py.ops.cuda.adamw import CudaAdamWOp
from mila_py.optim import AdamW, clip_grad_norm

DEVICE = "CUDA:0"
TRAINING, INFERENCE = RuntimeMode.TRAINING, RuntimeMode.INFERENCE
CFG = LlamaConfig(
    vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)
#: every test runs on the CUDA:0 under test (the emulated one where no GPU is present)
pytestmark = pytest.mark.usefixtures("cuda_device")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20260601)


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
        on_cuda = model is gpu  # the CUDA model runs the CUDA ops, fused AdamW included
        assert isinstance(opt._fused, CudaAdamWOp) == on_cuda
        assert (type(model.layers[0].self_attn.rope.op).__name__ == "CudaRopeOp") == on_cuda
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
    for n_b, plan in planned._plans.items():
        assert plan.positions.device.shape == (n_b,)
    last = planned._plans[2].positions.device  # the last step's positions, on the device
    assert isinstance(last, cupy.ndarray) and last.dtype == np.int32
    np.testing.assert_array_equal(host(last), [35 - 4, 35 - 1])
    for a, b in zip(planned.layers, components.layers, strict=True):
        for cache in ("k_cache", "v_cache"):
            close(a.self_attn._state[cache], host(b.self_attn._state[cache]), rtol=1e-5, atol=1e-5)
    assert "decode_scores" not in planned._state  # the CPU attention kernel's scratch only
    if EMULATED:  # the emulated contexts record their launches
        launched = set(planned.execution_context.launches)
        decode_kernels = {"attention_decode<float>", "kv_cache_write<float>"}
        assert decode_kernels <= launched
        assert not decode_kernels & set(components.execution_context.launches)


def test_a_captured_step_replays_on_new_inputs_and_refuses_allocations() -> None:
    """``mila_py.devices.graph.capture`` on the context's stream: the first call runs the
    calls and captures them, the later ones launch the graph, which reads its arrays' current
    values. A call that allocates while it is captured raises (CuPy's allocator refuses;
    the emulator too), and the stream is left able to capture again."""
    ctx = devices.create_execution_context(DEVICE)
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


@pytest.mark.parametrize("build", MEMORY_BUILDS)
@pytest.mark.parametrize("tie", [False, True])
def test_memory_stats_equal_cpu(build: BuildContext, tie: bool) -> None:
    """A CUDA build holds what the CPU build holds, but for the CPU decode kernel's scratch
    (:func:`cpu_stats_of_a_cuda_build`); each device's prediction equals its build."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, **({} if tie else EXTRAS))
    stats = []
    for device in ("CPU", DEVICE):
        model = Llama("llama", cfg, device=device)
        predicted = model.required_memory(build)
        model.build(build)
        assert model.get_memory_stats() == predicted
        stats.append(predicted)
    cuda = stats[1]
    if EMULATED:  # the emulated GPU's memory is NumPy arrays, which count as host memory
        assert cuda.host_state_bytes > 0
        device_state = cuda.total_bytes - cuda.device_parameter_bytes - cuda.device_gradient_bytes
        cuda = dataclasses.replace(cuda, device_state_bytes=device_state, host_state_bytes=0)
    assert stats[0] == cpu_stats_of_a_cuda_build(cuda, model)
    assert cuda.host_total_bytes == 0
    if build.is_inference:
        assert stats[0] != cuda


def test_the_cuda_llama_runs_the_cuda_ops(weights: str, rng) -> None:
    """Every layer of a CUDA Llama picked its CUDA op from the registry, RoPE's fused Q/K
    kernel on the views of the QKV projection included."""
    gpu = Llama("llama", CFG, device=DEVICE)
    gpu.build(BuildContext((2, 16), INFERENCE, prefill_size=4))
    gpu.load(weights)
    gpu.prefill(rng.integers(0, CFG.vocab_size, size=(2, 6)))
    ops = {type(c.op).__name__ for c in gpu._walk() if hasattr(c, "op")}
    assert {"CudaLinearOp", "CudaRmsNormOp", "CudaTokenEmbeddingOp", "CudaSwiGLUOp"} <= ops
    assert "CudaRopeOp" in ops
    assert type(gpu.layers[0].self_attn._op).__name__ == "CudaAttentionOp"
    if EMULATED:
        launches = gpu.execution_context.launches
        assert any(name.startswith("rope_qk<float, ") for name in launches)


@pytest.mark.parametrize("device", ["CPU", DEVICE])
def test_an_empty_batch_decodes_nothing(device: str) -> None:
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


@pytest.mark.real_gpu("streams")
def test_contexts_of_one_gpu_share_its_stream() -> None:
    """A model and a loss with contexts of their own run in call order (one stream)."""
    a, b = devices.create_execution_context(DEVICE), devices.create_execution_context(DEVICE)
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
    token, ragged = rng.integers(0, CFG.vocab_size, size=2), np.array([20, 17])
    assert rel_err(on_host(gpu.decode(token, ragged)), cpu.decode(token, ragged)) < tol
    assert gpu.generate(x[:, :5], max_new_tokens=4).shape == (2, 9)
