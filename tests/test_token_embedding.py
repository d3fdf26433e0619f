"""TokenEmbedding: lookup against indexing and torch, scatter-add gradient, validation, memory,
on every device (``device``: CPU, CUDA:0, emulated CUDA:0); ``test_cuda_op_*`` check the CUDA op
against the CPU op."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_arrays import (
    PRECISIONS_16,
    REDUCED_PARAMS,
    close,
    cupy,
    dev,
    host,
    on,
    skip_bf16_without_arrays,
)
from layer_helpers import (
    INFERENCE,
    TRAINING,
    assert_gradients,
    assert_unchanged,
    built,
    check_16_bit_twin,
    distinct_nbytes,
    f32,
    owned_arrays,
    snapshot,
)

from mila_py import BuildContext, Precision, TrainingMode
from mila_py.components import TokenEmbedding, TokenEmbeddingConfig
from mila_py.devices import create_execution_context
from mila_py.ops.cpu.token_embedding import token_embedding_backward, token_embedding_forward
from mila_py.ops.registry import create_op

B, T, V, D = 3, 5, 11, 6
#: the CPU ops a CUDA op is checked against
CPU = create_execution_context("CPU")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(99)


def make(
    mode=TRAINING, shape=(B, T), name: str = "embed", device: str = "CPU", **kw
) -> TokenEmbedding:
    return built(TokenEmbedding(name, TokenEmbeddingConfig(V, D), device=device), shape, mode, **kw)


def random_tokens(rng: np.random.Generator, shape=(B, T), dtype=np.int64) -> np.ndarray:
    return rng.integers(0, V, shape).astype(dtype)


# ------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"vocab_size": 0, "dim": 4}, ValueError),
        ({"vocab_size": 4, "dim": -2}, ValueError),
        ({"vocab_size": 4.5, "dim": 4}, TypeError),
        ({"vocab_size": 4, "dim": None}, TypeError),
    ],
)
def test_config_rejects_bad_values(kwargs, error) -> None:
    with pytest.raises(error, match="TokenEmbeddingConfig"):
        TokenEmbeddingConfig(**kwargs)


def test_construction_allocates_nothing_in_every_cpu_precision() -> None:
    emb = TokenEmbedding("embed", TokenEmbeddingConfig(V, D), device="CPU")
    assert not emb.is_built and emb.get_memory_stats().total_bytes == 0
    for precision in Precision:  # every one the CPU stores, 16-bit storage included
        emb = TokenEmbedding("embed", TokenEmbeddingConfig(V, D), device="CPU", precision=precision)
        assert emb.precision is precision and emb.get_memory_stats().total_bytes == 0


# ------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
@pytest.mark.parametrize("lead", [(B, T), (1, 1), (2, 4)])
def test_forward_is_a_table_lookup(device, lead, dtype, rng) -> None:
    emb = make(device=device)
    tokens = random_tokens(rng, lead, dtype)
    y = emb.forward(on(device, tokens))
    assert y.shape == (*lead, D) and y.dtype == np.float32
    if device == "CPU":  # NumPy can tell; a CuPy array's memory is not NumPy's
        assert np.shares_memory(y, owned_arrays(emb)["s:embed.output"])
    weight = host(emb.weight)
    expected = np.stack([[weight[int(t)] for t in row] for row in tokens])
    np.testing.assert_array_equal(host(y), expected)


def test_forward_matches_torch(device, rng) -> None:
    torch = pytest.importorskip("torch")
    emb = make(device=device)
    tokens = random_tokens(rng)
    weight = torch.from_numpy(host(emb.weight))
    expected = torch.nn.functional.embedding(torch.from_numpy(tokens), weight)
    np.testing.assert_array_equal(host(emb.forward(on(device, tokens))), expected.numpy())


def test_initialization_is_seeded_normal(device) -> None:
    """The same draws on every device: a CUDA build's table is the CPU build's."""
    big = built(TokenEmbedding("big", TokenEmbeddingConfig(512, 64), device=device), (1, 1))
    assert abs(host(big.weight).std() - 0.02) < 0.001
    np.testing.assert_array_equal(host(make(device=device).weight), host(make().weight))
    assert not np.array_equal(host(make(name="other", device=device).weight), host(make().weight))
    assert not host(make(mode=INFERENCE, device=device).weight).any()


# ------------------------------------------------------------------------------- backward
def test_backward_float64_matches_finite_differences(rng) -> None:
    tokens = np.array([[1, 4, 1], [0, 4, 4]])  # repeated ids must add up
    w = rng.standard_normal((5, 3))
    r = rng.standard_normal((2, 3, 3))

    def objective() -> float:
        y = np.empty((2, 3, 3))
        token_embedding_forward(tokens, w, y)
        return float(np.sum(y * r))

    dw = np.zeros_like(w)
    token_embedding_backward(tokens, r, dw)
    assert not dw[[2, 3]].any()  # unused ids get no gradient
    assert_gradients(objective, {"weight": (w, dw)})


def test_component_backward_scatters_and_accumulates(device, rng) -> None:
    emb = make(device=device)
    tokens = on(device, np.array([[3, 3, 7], [0, 3, 10]]))
    dy_host = rng.standard_normal((2, 3, D)).astype(np.float32)
    dy = on(device, dy_host)
    emb.forward(tokens)
    tokens[...] = 99  # the caller may reuse its array: the component kept a copy
    emb.backward(dy)  # returns None: token ids have no gradient
    expected = np.zeros((V, D))
    for (b, t), tok in np.ndenumerate(np.array([[3, 3, 7], [0, 3, 10]])):
        expected[tok] += dy_host[b, t]
    (grad,) = emb.get_gradients()
    np.testing.assert_allclose(host(grad), expected, rtol=1e-6, atol=1e-7)
    emb.backward(dy)
    np.testing.assert_allclose(host(grad), 2 * expected, rtol=1e-6, atol=1e-7)
    emb.zero_gradients()
    assert not host(grad).any()


def test_eval_mode_runs_as_normal_mode(device, rng) -> None:
    """EVAL changes nothing a token embedding computes: the same output and gradient as a
    NORMAL twin with the same weight."""
    emb, twin = make(device=device), make(device=device)
    twin.weight[...] = emb.weight
    emb.set_training_mode(TrainingMode.EVAL)
    assert emb.training_mode is TrainingMode.EVAL
    tokens = on(device, random_tokens(rng, (1, 2)))
    np.testing.assert_array_equal(host(emb.forward(tokens)), host(twin.forward(tokens)))
    dy = on(device, rng.standard_normal((1, 2, D)).astype(np.float32))
    emb.backward(dy)
    twin.backward(dy)
    np.testing.assert_array_equal(host(emb.get_gradients()[0]), host(twin.get_gradients()[0]))


# ------------------------------------------------------------------------------- lifecycle
def test_inference_build_has_no_gradients_and_backward_raises(device, rng) -> None:
    emb = make(mode=INFERENCE, device=device)
    assert emb.get_gradients() == []
    emb.forward(on(device, random_tokens(rng)))
    with pytest.raises(RuntimeError, match="INFERENCE"):
        emb.backward(on(device, np.zeros((B, T, D), np.float32)))


def test_backward_before_forward_raises(device) -> None:
    with pytest.raises(RuntimeError, match="forward"):
        make(device=device).backward(on(device, np.zeros((B, T, D), np.float32)))


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        (np.array([[0, V]]), ValueError, f"token id {V} is out of range"),
        (np.array([[-1, 0]]), ValueError, "token id -1 is out of range"),
        (np.zeros((1, 2), np.float32), TypeError, "integers"),
        (np.zeros((1, 2), np.bool_), TypeError, "integers"),
        (np.zeros((2,), np.int64), ValueError, "must be"),
        (np.zeros((B, T + 1), np.int64), ValueError, "exceeds the build shape"),
        ([[0, 1]], TypeError, "array"),
    ],
    ids=["too-big", "negative", "float", "bool", "rank", "too-long", "list"],
)
def test_bad_tokens_leave_everything_unchanged(device, tokens, error, match, rng) -> None:
    emb = make(device=device)
    emb.forward(on(device, random_tokens(rng)))
    emb.backward(on(device, np.ones((B, T, D), np.float32)))
    tokens = tokens if isinstance(tokens, list) else on(device, tokens)
    saved = snapshot(emb, tokens)
    with pytest.raises(error, match=match):
        emb.forward(tokens)
    assert_unchanged(emb, saved, tokens)


def test_bad_backward_leaves_everything_unchanged(device, rng) -> None:
    emb = make(device=device)
    emb.forward(on(device, random_tokens(rng, (2, 2))))
    for dy_host in (np.ones((2, 3, D), np.float32), np.ones((2, 2, D), np.float64)):
        dy = on(device, dy_host)
        saved = snapshot(emb, dy)
        error, message = (TypeError, "dtype") if dy.dtype == np.float64 else (ValueError, "shape")
        with pytest.raises(error, match=message):
            emb.backward(dy)
        assert_unchanged(emb, saved, dy)


def test_bad_build_shape_rolls_back(device) -> None:
    emb = TokenEmbedding("embed", TokenEmbeddingConfig(V, D), device=device)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        emb.build(BuildContext((B, T, D), TRAINING))
    assert not emb.is_built and emb.get_memory_stats().total_bytes == 0
    built(emb, (B, T))


@pytest.mark.parametrize("mode", [TRAINING, INFERENCE])
def test_memory_stats_count_every_owned_array_once(device, mode) -> None:
    emb = make(mode, device=device)
    stats = emb.get_memory_stats()
    training = mode is TRAINING
    assert stats.parameter_bytes == V * D * 4
    assert stats.gradient_bytes == (V * D * 4 if training else 0)
    # output [B, T, D] float32 (+ kept token ids [B, T] int64)
    assert stats.state_bytes == B * T * D * 4 + (B * T * 8 if training else 0)
    assert stats.total_bytes == distinct_nbytes(list(owned_arrays(emb).values()))


@pytest.mark.parametrize("precision", PRECISIONS_16)
def test_component_in_16_bits_matches_its_float64_twin(device, precision: Precision, rng) -> None:
    """A 16-bit TokenEmbedding against the float64 CPU layer of the same table, forward and
    the table's float32 gradient (see :func:`check_16_bit_twin`)."""
    skip_bf16_without_arrays(device, precision)
    check_16_bit_twin(
        lambda p, d: TokenEmbedding("emb", TokenEmbeddingConfig(30, 24), device=d, precision=p),
        (2, 3),
        lambda rng, dtype: (rng.integers(0, 30, (2, 3)),),
        device,
        precision,
        rng,
    )


# ------------------------------------------------------------------ CUDA op against the CPU op


@pytest.mark.parametrize("dim", [64, 300])
@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
def test_cuda_op_with_repeated_ids_matches_the_cpu_op(cuda_ctx, rng, dim: int, id_dtype) -> None:
    op = create_op("TokenEmbeddingOp", cuda_ctx, None, Precision.FP32)
    weight = f32(rng, 11, dim)
    tokens = np.array([[3, 3, 0, 10], [3, 7, 7, 0]], dtype=id_dtype)
    out = cupy.empty((2, 4, dim), cupy.float32)
    op.forward(dev(tokens), dev(weight), out)
    ref = np.empty((2, 4, dim), np.float32)
    token_embedding_forward(tokens, weight, ref)
    np.testing.assert_array_equal(host(out), ref)
    dy, dw0 = f32(rng, 2, 4, dim), f32(rng, 11, dim)  # the gradient accumulates
    dw = dev(dw0)
    op.backward(dev(tokens), dev(dy), dw)
    token_embedding_backward(tokens, dy, dw0)
    close(dw, dw0)


@pytest.mark.parametrize("precision", REDUCED_PARAMS)
def test_cuda_op_in_16_bits_matches_the_cpu_op(cuda_ctx, rng, precision: Precision) -> None:
    """The lookup copies the 16-bit rows (bit for bit); the gradient sums them into float32."""
    p, dtype = precision, precision.numpy_dtype
    gpu = create_op("TokenEmbeddingOp", cuda_ctx, None, p)
    cpu = create_op("TokenEmbeddingOp", CPU, None, p)
    weight = f32(rng, 11, 64).astype(dtype)
    tokens = np.array([[3, 3, 0, 10], [3, 7, 7, 0]])
    out, ref = cupy.empty((2, 4, 64), dtype), np.empty((2, 4, 64), dtype)
    gpu.forward(dev(tokens), dev(weight), out)
    cpu.forward(tokens, weight, ref)
    np.testing.assert_array_equal(host(out), ref)
    dy = f32(rng, 2, 4, 64).astype(dtype)
    dw, dw_ref = cupy.zeros((11, 64), cupy.float32), np.zeros((11, 64), np.float32)
    gpu.backward(dev(tokens), dev(dy), dw)
    cpu.backward(tokens, dy, dw_ref)
    close(dw, dw_ref, rtol=1e-6, atol=1e-6)
