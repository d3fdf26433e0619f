"""INFERENCE builds at real sizes: logits for one position, one activation workspace shared by
every block (only parameters and the KV cache per layer), and a prediction that stays exact."""

from __future__ import annotations

import dataclasses
import tracemalloc
from typing import Any

import numpy as np
import pytest
from cuda_arrays import skip_bf16_without_arrays

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.component import Component, share_workspace
from mila_py.models import Llama, LlamaConfig

CFG = LlamaConfig(
    vocab_size=40,
    dim=32,
    n_layers=6,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=48,
    max_seq_len=64,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)

#: Llama-3.2-1B's shape (tied embeddings, its RoPE) at a 576-token context
ONE_B = LlamaConfig(
    vocab_size=128256,
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    hidden_dim=8192,
    max_seq_len=576,
    rope_base=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_embeddings=True,
)


def config(tie: bool, n_layers: int = CFG.n_layers) -> LlamaConfig:
    return dataclasses.replace(CFG, tie_embeddings=tie, n_layers=n_layers)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def weights(request: Any, tmp_path_factory: Any) -> tuple[LlamaConfig, str]:
    cfg = config(request.param)
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    path = tmp_path_factory.mktemp("w") / "llama.safetensors"
    model.save(path)
    return cfg, str(path)


def make(
    weights: tuple[LlamaConfig, str], mode: RuntimeMode, shape: Any, prefill: int = 0
) -> Llama:
    cfg, path = weights
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext(shape, mode, prefill_size=prefill))
    model.load(path)
    return model


def reference_logits(weights: tuple[LlamaConfig, str], ids: np.ndarray) -> np.ndarray:
    """All-position logits of a TRAINING build: every block with buffers of its own."""
    return make(weights, RuntimeMode.TRAINING, ids.shape).forward(ids).copy()


def tokens(b: int, t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(b, t))


# ---------------------------------------------------------------------- results
@pytest.mark.parametrize("chunk", [0, 3])
def test_forward_prefill_and_decode_on_the_shared_workspace_match_the_training_build(
    weights: tuple[LlamaConfig, str], chunk: int
) -> None:
    ids = tokens(2, 12, seed=1)
    want = reference_logits(weights, ids)
    model = make(weights, RuntimeMode.INFERENCE, (2, 16), prefill=chunk)
    step = chunk or ids.shape[1]
    got = np.concatenate(
        [model.forward(ids[:, s : s + step], s, seq_len=12) for s in range(0, 12, step)], axis=1
    )
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(model.prefill(ids[:, :7]), want[:, 6], atol=1e-5)
    for p in range(7, 12):  # the decode plan: every layer's step on the shared buffers in turn
        np.testing.assert_allclose(model.decode(ids[:, p], p), want[:, p], atol=1e-5)
    model.prefill(ids[:, :7])
    for p in range(7, 12):  # the components' own decode calls, on the same buffers
        got_p = model._decode_components(model.execution_context.to_device(ids[:, p : p + 1]), p)
        np.testing.assert_allclose(got_p, want[:, p], atol=1e-5)


def test_greedy_generation_is_the_argmax_of_the_training_build(
    weights: tuple[LlamaConfig, str],
) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (2, 24), prefill=4)
    prompt = tokens(2, 6, seed=2)
    out = model.generate(prompt, max_new_tokens=5, temperature=0.0)
    for i in range(6, 11):
        want = reference_logits(weights, out[:, :i])[:, -1].argmax(-1)
        np.testing.assert_array_equal(out[:, i], want)


def test_inference_forward_returns_an_array_the_caller_owns(
    weights: tuple[LlamaConfig, str],
) -> None:
    """The chunk's logits are written into an array made for the call: the next call leaves
    it alone, and it is none of the model's buffers."""
    model = make(weights, RuntimeMode.INFERENCE, (2, 16), prefill=8)
    ids = tokens(2, 8, seed=3)
    first = model.forward(ids)
    kept = first.copy()
    second = model.forward(tokens(2, 8, seed=4))
    np.testing.assert_array_equal(first, kept)
    assert not np.shares_memory(first, second)
    for where, buffer in model._named_state():
        assert not np.shares_memory(first, buffer), where
    for name, parameter in model.named_parameters():
        assert not np.shares_memory(first, parameter), name


# ---------------------------------------------------------------------- what is shared
def test_every_block_runs_on_the_first_blocks_activation_buffers(
    weights: tuple[LlamaConfig, str],
) -> None:
    model = make(weights, RuntimeMode.INFERENCE, (2, 16), prefill=8)
    first = dict(model.layers[0]._named_state())
    caches = {"self_attn.k_cache", "self_attn.v_cache"}
    for block in model.layers[1:]:
        state = dict(block._named_state())
        assert state.keys() == first.keys()
        for name, buffer in state.items():
            if name in caches:  # per layer
                assert not np.shares_memory(buffer, first[name]), (block.name, name)
            elif name != "self_attn.rope":  # an activation: the first block's buffer itself
                assert buffer is first[name], (block.name, name)
        for (name, p), (_, q) in zip(
            block.named_parameters(), model.layers[0].named_parameters(), strict=True
        ):
            assert not np.shares_memory(p, q), name


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_activations_do_not_grow_with_the_number_of_layers(tie: bool) -> None:
    """A 2-layer and an 8-layer INFERENCE build differ by six blocks' parameters and KV
    caches, nothing else."""
    ctx = BuildContext((3, 32), RuntimeMode.INFERENCE, prefill_size=16)
    small = Llama("llama", config(tie, 2), device="CPU").required_memory(ctx)
    large = Llama("llama", config(tie, 8), device="CPU").required_memory(ctx)
    d, hd = CFG.dim, CFG.dim // CFG.n_heads
    block_parameters = (
        (d * (CFG.n_heads + 2 * CFG.n_kv_heads) * hd + CFG.n_heads * hd * d)
        + 3 * d * CFG.hidden_dim
        + 2 * d
    )
    kv_cache = 2 * 3 * 32 * CFG.n_kv_heads * hd  # K and V, [B, T, Hk * d]
    assert large.parameter_bytes - small.parameter_bytes == 6 * block_parameters * 4
    assert large.state_bytes - small.state_bytes == 6 * kv_cache * 4
    assert large.gradient_bytes == small.gradient_bytes == 0


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_inference_logits_are_kept_for_one_position_per_sequence(tie: bool) -> None:
    model = Llama("llama", config(tie, 2), device="CPU")
    model.build(BuildContext((3, 32), RuntimeMode.INFERENCE, prefill_size=16))
    if tie:
        assert model._state["logits"].shape == (3, 1, CFG.vocab_size)
    else:
        assert model.lm_head is not None
        assert model.lm_head._state["output"].shape == (3, 1, CFG.vocab_size)
    training = Llama("llama", config(tie, 2), device="CPU")
    training.build(BuildContext((3, 32), RuntimeMode.TRAINING))
    head = training._state["logits"] if tie else training.lm_head._state["output"]  # type: ignore[union-attr]
    assert head.shape == (3, 32, CFG.vocab_size)  # TRAINING builds: every position


# ---------------------------------------------------------------------- exact accounting
@pytest.mark.parametrize(
    ("tie", "precision", "mode", "shape", "prefill"),
    [
        (False, Precision.FP32, RuntimeMode.INFERENCE, (2, 24), 8),
        (True, Precision.FP32, RuntimeMode.INFERENCE, (3, 24), 0),
        (True, Precision.BF16, RuntimeMode.INFERENCE, (2, 24), 5),
        (False, Precision.FP16, RuntimeMode.INFERENCE, (1, 24), 8),
        (False, Precision.FP32, RuntimeMode.TRAINING, (2, 12), 0),
        (True, Precision.BF16, RuntimeMode.TRAINING, (2, 12), 0),
    ],
)
def test_required_memory_equals_the_memory_of_the_build(
    tie: bool, precision: Precision, mode: RuntimeMode, shape: tuple[int, int], prefill: int
) -> None:
    cfg = config(tie, 3)
    ctx = BuildContext(shape, mode, prefill_size=prefill)
    predicted = Llama("llama", cfg, device="CPU", precision=precision).required_memory(ctx)
    model = Llama("llama", cfg, device="CPU", precision=precision)
    model.build(ctx)
    stats = model.get_memory_stats()
    assert predicted == stats
    assert predicted.by_dtype == stats.by_dtype
    distinct = {id(a): a for a in _arrays(model)}
    assert stats.total_bytes == sum(int(a.nbytes) for a in distinct.values())


def _arrays(root: Component) -> list[Any]:
    found = []
    for component in root._walk():
        found += [*component._parameters.values(), *component._gradients.values()]
        found += [*component._input_gradients.values(), *component._state.values()]
        for value in vars(component).values():
            if hasattr(value, "state_arrays"):
                found += list(value.state_arrays())
    return found


def test_the_1b_shape_is_predicted_below_the_peak_of_hugging_face_eager() -> None:
    """Llama-3.2-1B's shape at B=8, prompt 512, context 576 (the setting of
    ``benchmarks/memory.py``), predicted without allocating it: at most the peak that
    transformers' eager ``generate`` reaches there on a GPU (7.4 GB fp32, 3.7 GB bf16)."""
    ctx = BuildContext((8, 576), RuntimeMode.INFERENCE, prefill_size=512)
    tracemalloc.start()
    try:
        fp32 = Llama("llama", ONE_B, device="CPU").required_memory(ctx)
        bf16 = Llama("llama", ONE_B, device="CPU", precision=Precision.BF16).required_memory(ctx)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fp32.total_bytes <= 7.4e9
    assert bf16.total_bytes <= 3.7e9
    assert peak < 64 * 2**20  # the RoPE table and small things: nothing of the build
    # the parameters: the tied embedding and 16 blocks, as the architecture counts them
    d, hd = ONE_B.dim, ONE_B.dim // ONE_B.n_heads
    block = d * (ONE_B.n_heads + 2 * ONE_B.n_kv_heads) * hd + ONE_B.n_heads * hd * d
    block += 3 * d * ONE_B.hidden_dim + 2 * d
    n_parameters = ONE_B.vocab_size * d + ONE_B.n_layers * block + d
    assert fp32.parameter_bytes == 4 * n_parameters
    assert bf16.parameter_bytes == 2 * n_parameters


# ---------------------------------------------------------------------- share_workspace
def test_lending_needs_a_built_donor_and_one_structure() -> None:
    model = Llama("llama", config(True, 2), device="CPU")
    a, b = model.layers
    with pytest.raises(RuntimeError, match="not built"), share_workspace(a, b):
        pass
    model.build(BuildContext((1, 8), RuntimeMode.INFERENCE))
    other = Llama("other", config(True, 1), device="CPU")
    receiver = other.layers[0]
    unknown = ("no_such_part",)
    with (
        pytest.raises(ValueError, match="keep names no"),
        share_workspace(a, receiver, keep=unknown),
    ):
        pass
    with pytest.raises(ValueError, match="one structure"), share_workspace(a.mlp, receiver):
        pass
    assert all(c._workspace_donor is None for c in receiver._walk())


def test_a_build_that_cannot_take_the_lent_buffers_is_rolled_back() -> None:
    """A receiver built for another shape than its donor refuses the shared buffers by name,
    shape and dtype; it is left unbuilt, holding nothing, and no longer borrowing."""
    from mila_py.models.llama.block import LlamaBlock

    donor = LlamaBlock("block", CFG, device="CPU")
    donor.build(BuildContext((1, 8, CFG.dim), RuntimeMode.INFERENCE))
    block = LlamaBlock("block", CFG, device="CPU")
    wrong = BuildContext((2, 8, CFG.dim), RuntimeMode.INFERENCE)  # B = 2
    with pytest.raises(ValueError, match="has no buffer 'output'"), share_workspace(donor, block):
        block.build(wrong)
    assert not block.is_built
    assert all(c._workspace_donor is None for c in block._walk())
    assert all(not c._state and not c._parameters for c in block._walk())
    with share_workspace(donor, block):  # the shape the donor has: it takes the buffers
        block.build(BuildContext((1, 8, CFG.dim), RuntimeMode.INFERENCE))
    assert block.mlp._state["hidden"] is donor.mlp._state["hidden"]
    assert block.self_attn._state["k_cache"] is not donor.self_attn._state["k_cache"]


@pytest.mark.real_gpu("CuPy's memory pool")
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16], ids=lambda p: p.name)
def test_the_memory_pool_holds_what_the_stats_count(cuda_device: str, precision: Precision) -> None:
    """A CUDA INFERENCE build of a ~100M-parameter shape holds, in CuPy's memory pool, what its
    memory statistics count, within 1% (the pool rounds each allocation up to 512 bytes, and the
    shared RoPE table is made once per device)."""
    import cupy

    skip_bf16_without_arrays(cuda_device, precision)
    cfg = LlamaConfig(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, hidden_dim=2048,
        max_seq_len=1024, tie_embeddings=True,
    )  # fmt: skip
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device(0).synchronize()
    before = pool.used_bytes()
    model = Llama("llama", cfg, device=cuda_device, precision=precision)
    model.build(BuildContext((4, 1024), RuntimeMode.INFERENCE, prefill_size=256))
    held = pool.used_bytes() - before
    counted = model.get_memory_stats().device_total_bytes
    assert counted > 0 and abs(held - counted) <= 0.01 * counted, (held, counted)
