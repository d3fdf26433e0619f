"""BF16 and FP16 Llamas against Hugging Face's own 16-bit path, on the same weights.

A float32 checkpoint is loaded by transformers in float32 (the reference), by transformers in
BF16 / FP16 (``from_pretrained(dtype=...)``, its own 16-bit path), and by
``Llama.from_pretrained(precision=...)``. Teacher-forced logits (one forward over a prompt, and
the same prompt decoded token by token through the KV cache) are compared with the reference:
mila_py's relative error may be at most twice HF's, and its top-1 agreement with the reference
at most a few points below HF's. The numbers measured are printed (``pytest -s``) and given in
the assertion messages. Greedy generation in FP32 stays token-equal to transformers.

Needs torch and transformers (CPU; the ``hf`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mila_py import Precision, RuntimeMode  # noqa: E402
from mila_py.models import Llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

VOCAB, B, T = 512, 2, 96
#: top-1 agreement with the float32 reference may trail HF's 16-bit path by this much
TOP1_SLACK = 0.03
TORCH_DTYPES = {Precision.BF16: "bfloat16", Precision.FP16: "float16"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A random float32 Llama (logits spread wide enough that the top-1 choice is mostly
    clear), saved as a checkpoint folder."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.06, rms_norm_eps=1e-5, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(4)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("llama-fp32")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def hf_logits(model: Any, toks: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(toks)).logits.float().numpy()


def measure(logits: Any, reference: np.ndarray) -> tuple[float, float]:
    """``(relative error in the 2-norm, top-1 agreement)`` of ``logits`` with ``reference``."""
    got = np.asarray(logits, np.float64)
    err = float(np.linalg.norm(got - reference) / np.linalg.norm(reference))
    top1 = float(np.mean(got.argmax(axis=-1) == reference.argmax(axis=-1)))
    return err, top1


def decoded_logits(model: Llama, toks: np.ndarray) -> np.ndarray:
    """Teacher-forced logits through the KV cache: the first token prefilled, every later one
    decoded (the decode plan, its matrix products on the model's own weights)."""
    rows = [np.asarray(model.prefill(toks[:, :1]), np.float32)]
    for t in range(1, toks.shape[1]):
        rows.append(np.asarray(model.decode(toks[:, t], t), np.float32))
    return np.stack(rows, axis=1)


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16])
def test_16_bit_logits_are_as_good_as_hf_16_bit(
    checkpoint: tuple[Any, Path], precision: Precision
) -> None:
    reference_model, path = checkpoint
    toks = np.random.default_rng(5).integers(0, VOCAB, size=(B, T))
    reference = hf_logits(reference_model, toks).astype(np.float64)
    hf16 = transformers.LlamaForCausalLM.from_pretrained(
        path, dtype=getattr(torch, TORCH_DTYPES[precision]), attn_implementation="eager"
    ).eval()
    hf_err, hf_top1 = measure(hf_logits(hf16, toks), reference)
    forward = Llama.from_pretrained(
        path, runtime_mode=RuntimeMode.TRAINING, batch_size=B, seq_len=T, precision=precision
    )
    assert forward.precision is precision
    serving = Llama.from_pretrained(path, batch_size=B, seq_len=T, precision=precision)
    rows = {
        "forward": measure(forward.forward(toks), reference),
        "decode": measure(decoded_logits(serving, toks), reference),
    }
    report = f"{precision}: HF error {hf_err:.2e} top-1 {hf_top1:.3f}; " + "; ".join(
        f"mila {name} error {err:.2e} top-1 {top1:.3f}" for name, (err, top1) in rows.items()
    )
    print(report)
    for err, top1 in rows.values():
        assert err <= 2 * hf_err, report
        assert top1 >= hf_top1 - TOP1_SLACK, report


def test_fp32_greedy_generation_equals_transformers(checkpoint: tuple[Any, Path]) -> None:
    """The default (the checkpoint's FP32) picks transformers' greedy tokens."""
    reference_model, path = checkpoint
    prompt = np.random.default_rng(6).integers(0, VOCAB, size=(1, 12))
    model = Llama.from_pretrained(path, batch_size=1, seq_len=64)
    assert model.precision is Precision.FP32
    with torch.no_grad():
        want = reference_model.generate(
            torch.from_numpy(prompt), max_new_tokens=16, do_sample=False, pad_token_id=0
        )
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=16), want.numpy())
