"""TRAINING builds with ``recompute``: each block's input kept per layer, one workspace for the
blocks' internals, each block's forward run again right before its backward."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.models import Llama, LlamaConfig

CFG = LlamaConfig(
    vocab_size=40,
    dim=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=48,
    max_seq_len=64,
)


def built(tie: bool, recompute: bool, shape: tuple[int, int], precision: Precision) -> Llama:
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    model = Llama("llama", cfg, device="CPU", precision=precision)
    model.build(BuildContext(shape, RuntimeMode.TRAINING, recompute=recompute))
    return model


def test_recompute_is_a_bool_for_training_builds() -> None:
    with pytest.raises(TypeError, match="recompute must be True or False"):
        BuildContext((2, 8), RuntimeMode.TRAINING, recompute=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="recompute is for TRAINING builds"):
        BuildContext((2, 8), RuntimeMode.INFERENCE, recompute=True)
    ctx = BuildContext((2, 8), RuntimeMode.TRAINING, recompute=np.bool_(True))  # type: ignore[arg-type]
    assert ctx.recompute is True
    assert ctx.with_shape((1, 8)).recompute is True
    assert BuildContext((2, 8), RuntimeMode.TRAINING).recompute is False


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_gradients_equal_the_plain_builds_bit_for_bit(tie: bool, precision: Precision) -> None:
    """Same kernels on the same inputs in the same order: equal, not close. Also for a call
    smaller than the build, and a second backward of the same forward (the workspace then
    holds the first block's activations, not the last's)."""
    plain = built(tie, False, (3, 12), precision)
    again = built(tie, True, (3, 12), precision)
    for p, q in zip(plain.get_parameters(), again.get_parameters(), strict=True):
        np.testing.assert_array_equal(p, q)  # one initialization
    rng = np.random.default_rng(7)
    for shape in ((3, 12), (2, 9)):
        ids = rng.integers(0, CFG.vocab_size, size=shape)
        dlogits = rng.standard_normal((*shape, CFG.vocab_size)).astype(np.float32)
        for model in (plain, again):
            model.zero_gradients()
            logits = model.forward(ids)
            model.backward(dlogits)
            model.backward(dlogits)
        np.testing.assert_array_equal(plain.forward(ids), again.forward(ids))
        del logits
        for (name, g), (_, h) in zip(plain.named_gradients(), again.named_gradients(), strict=True):
            np.testing.assert_array_equal(g, h, err_msg=name)
            assert np.any(g != 0), name


def test_block_hooks_run_after_each_recomputed_block() -> None:
    model = built(False, True, (2, 8), Precision.FP32)
    seen: list[str] = []
    model.block_backward_hooks.append(lambda block: seen.append(block.name))
    ids = np.arange(16).reshape(2, 8) % CFG.vocab_size
    model.forward(ids)
    model.backward(np.ones((2, 8, CFG.vocab_size), np.float32))
    assert seen == [f"layer{i}" for i in reversed(range(CFG.n_layers))]


def workspace_bytes(n_b: int, n_t: int, bytes_per: int = 4) -> int:
    """Bytes of one block's TRAINING activations and scratch, written out from the parts'
    shapes, less its output (``mlp_residual``'s, which a recomputing build keeps per layer)."""
    d, h = CFG.dim, CFG.hidden_dim
    hd = d // CFG.n_heads
    q, kv = CFG.n_heads * hd, CFG.n_kv_heads * hd
    rows = n_b * n_t
    norms = 2 * (2 * rows * d * bytes_per + rows * 4)  # output, dinput; rstd float32
    attention = rows * (q + 2 * kv) * 2 + rows * d  # qkv output, its dinput, dqkv
    attention += rows * q * 2 + rows * d  # attn_out, o_proj's dinput, its output
    attention += rows * (q + kv)  # RoPE's dq_in, dk_in
    probs = n_b * CFG.n_heads * n_t * n_t * 4  # float32
    mlp = rows * h * 4 + rows * d * 3 + rows * d  # gate, up, hidden, dup; three dx; dinput
    mlp += rows * h  # down_proj's dinput
    residual = rows * d  # attn_residual's output
    block = 2 * rows * d  # dhidden, dinput
    return (attention + mlp + residual + block) * bytes_per + norms + probs


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_recompute_saves_every_block_but_ones_workspace(tie: bool) -> None:
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    plain_ctx = BuildContext((3, 16), RuntimeMode.TRAINING)
    recompute_ctx = dataclasses.replace(plain_ctx, recompute=True)
    plain = Llama("llama", cfg, device="CPU").required_memory(plain_ctx)
    again = Llama("llama", cfg, device="CPU").required_memory(recompute_ctx)
    saved = (CFG.n_layers - 1) * workspace_bytes(3, 16)
    assert plain.total_bytes - again.total_bytes == saved > 0
    assert plain.parameter_bytes == again.parameter_bytes
    model = Llama("llama", cfg, device="CPU")
    model.build(recompute_ctx)
    assert model.get_memory_stats() == again
    for block in model.layers[1:]:  # the inputs of the next blocks stay per layer
        assert (
            block.mlp_residual._state["output"] is not model.layers[0].mlp_residual._state["output"]
        )
        assert block.mlp._state["hidden"] is model.layers[0].mlp._state["hidden"]
