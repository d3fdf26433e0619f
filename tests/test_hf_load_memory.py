"""Loading a Hugging Face checkpoint holds about one tensor beyond the model's parameters:
tensors are checked from the files' headers, then read one at a time, each copied into its
parameter (Q, K and V into their rows of the fused QKV parameter, never concatenated)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mila_py import BuildContext, RuntimeMode
from mila_py.interop import hf as hf_module
from mila_py.interop.hf import hf_weight_files, load_hf_files, save_hf_checkpoint
from mila_py.models import Llama, LlamaConfig

# attention-heavy (Q, K and V are 3/5 of the parameters): a load that concatenates them, or
# that holds every tensor before copying, shows well above the bound
CFG = LlamaConfig(
    vocab_size=64, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, hidden_dim=64, max_seq_len=16
)
INFER = BuildContext((1, 8), RuntimeMode.INFERENCE)


def trained(seed: int = 0) -> Llama:
    """A model with random weights, every one distinct from a fresh model's."""
    model = Llama("llama", CFG, device="CPU")
    model.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        p[...] = rng.standard_normal(p.shape).astype(p.dtype)
    return model


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Llama, Path]:
    model = trained()
    save_hf_checkpoint(model, tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def to_bf16(path: Path) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, file)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-file", "bf16-file"])
def test_from_pretrained_loads_within_a_tensor_of_the_parameters(
    checkpoint: tuple[Llama, Path], bf16: bool
) -> None:
    """Traced peak of from_pretrained less what the built model holds (allocated by its build,
    alive at the end) stays within 1.25 x the parameter bytes plus the largest tensor; reading
    every tensor before copying, and concatenating Q, K and V, costs about 1.6 x."""
    source, path = checkpoint
    if bf16:
        to_bf16(path)
    largest = max(int(p.nbytes) for p in source.get_parameters())
    tracemalloc.start()
    try:
        model = Llama.from_pretrained(path, batch_size=1, seq_len=8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    params = model.get_memory_stats().parameter_bytes
    held = model.get_memory_stats().total_bytes
    assert peak - held <= 1.25 * params + largest, (peak - held) / params
    for (name, p), q in zip(model.named_parameters(), source.get_parameters(), strict=True):
        expected = q.astype(ml_dtypes.bfloat16).astype(np.float32) if bf16 else q
        np.testing.assert_array_equal(p, expected, err_msg=name)


def test_load_hf_files_holds_about_one_tensor(checkpoint: tuple[Llama, Path]) -> None:
    """The load alone, after the build: its traced peak is a small part of the parameters."""
    source, path = checkpoint
    model = Llama("llama", CFG, device="CPU")
    model.build(INFER)
    files = hf_weight_files(path)
    params = model.get_memory_stats().parameter_bytes
    largest = max(int(p.nbytes) for p in source.get_parameters())
    tracemalloc.start()
    try:
        load_hf_files(model, files)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 0.25 * params + largest, peak / params
    for (name, p), q in zip(model.named_parameters(), source.get_parameters(), strict=True):
        np.testing.assert_array_equal(p, q, err_msg=name)


def test_every_header_problem_is_reported_before_anything_is_read(
    checkpoint: tuple[Llama, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, path = checkpoint
    file = path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 256), np.float32)
    tensors["model.layers.2.input_layernorm.weight"] = np.zeros(256, np.int32)
    tensors["model.layers.0.self_attn.bogus.weight"] = np.zeros(3, np.float32)
    save_file(tensors, file)
    model = Llama("llama", CFG, device="CPU")
    model.build(INFER)
    before = [p.copy() for p in model.get_parameters()]
    read: list[str] = []
    real = hf_module._file_entry

    def spying(f: object, name: str) -> object:
        entry = real(f, name)
        return type(entry)(
            entry.shape,
            entry.dtype,
            entry.floating,
            lambda: read.append(name) or entry.read(),
            entry.rows,
        )

    monkeypatch.setattr(hf_module, "_file_entry", spying)
    with pytest.raises(ValueError, match="nothing was loaded") as info:
        load_hf_files(model, hf_weight_files(path))
    message = str(info.value)
    assert "Llama 'llama'" in message
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected: model.layers.0.self_attn.bogus.weight" in message
    assert "shape of model.layers.0.self_attn.k_proj.weight: got (8, 256)" in message
    assert "dtype of model.layers.2.input_layernorm.weight: I32 is not a float type" in message
    assert read == []
    for a, p in zip(before, model.get_parameters(), strict=True):
        np.testing.assert_array_equal(a, p)


def test_a_tied_head_stored_beside_its_embedding_is_compared_by_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataclasses import replace

    tied = replace(CFG, tie_embeddings=True)
    source = Llama("llama", tied, device="CPU")
    source.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    save_hf_checkpoint(source, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, file)
    # blocks of 3 rows of the 64: the last one shorter
    monkeypatch.setattr(hf_module, "_COMPARE_BYTES", 3 * CFG.dim * 8)
    model = Llama("llama", tied, device="CPU")
    model.build(INFER)
    load_hf_files(model, hf_weight_files(tmp_path / "ckpt"))
    np.testing.assert_array_equal(model.embed_tokens.weight, source.embed_tokens.weight)
    tensors["lm_head.weight"][-1, -1] += 1  # in the last block only
    save_file(tensors, file)
    again = Llama("llama", tied, device="CPU")
    again.build(INFER)
    with pytest.raises(ValueError, match=r"lm_head\.weight differs"):
        load_hf_files(again, hf_weight_files(tmp_path / "ckpt"))
    assert not again.embed_tokens.weight.any()  # nothing was loaded
