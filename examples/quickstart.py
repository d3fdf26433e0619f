"""mila_py quick start: RoPE through the whole component lifecycle, on the CPU or a GPU.

1. A TRAINING network of two Rope layers (one shared cos/sin table), rotating Q/K views of a fused
   QKV buffer; backward; EVAL mode; the memory table.
2. An INFERENCE Rope made from a Hugging Face Llama 3.1 config (llama3 scaling): chunked prefill
   gives exactly what one forward gives; then KV-cache style decode, timed.

Run: ``python examples/quickstart.py [--device CPU]``
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mila_py import BuildContext, Network, RuntimeMode, TrainingMode
from mila_py.components import Rope, RopeConfig
from mila_py.interop.hf_rope import rope_config_from_hf


def training_demo(device: str) -> None:
    n_b, n_t, hq, hk, d = 2, 64, 8, 2, 64
    cfg = RopeConfig(channels=hq * d, n_heads=hq, n_kv_heads=hk, max_seq_len=256)
    net = Network("toy", device=device)
    net.add_component(Rope("layer0_rope", cfg)).add_component(Rope("layer1_rope", cfg))
    net.build(BuildContext((n_b, n_t, hq * d), RuntimeMode.TRAINING))
    print(net)

    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((n_b, n_t, (hq + 2 * hk) * d), dtype=np.float32)  # fused projection
    q, k = qkv[..., : hq * d], qkv[..., hq * d : (hq + hk) * d]  # views: rotated in place
    q0, k0, v0 = q.copy(), k.copy(), qkv[..., (hq + hk) * d :].copy()
    rope = net.get_component("layer0_rope")
    rope.forward(q, k)
    assert np.array_equal(qkv[..., (hq + hk) * d :], v0), "V must be untouched"
    norms = np.linalg.norm(q.reshape(n_b, n_t, hq, d), axis=-1)
    print(
        f"\nforward: Q/K rotated through views of the QKV buffer; per-head norms kept to "
        f"{np.abs(norms - np.linalg.norm(q0.reshape(n_b, n_t, hq, d), axis=-1)).max():.1e}"
    )
    dq_in, dk_in = rope.backward(q, k)  # R^T R = I: the inverse rotation recovers the inputs
    print(
        f"backward(R q, R k) = (q, k) to {max(np.abs(dq_in - q0).max(), np.abs(dk_in - k0).max()):.1e}"
    )
    net.set_training_mode(TrainingMode.EVAL)
    print(f"training mode after eval(): {rope.training_mode.name}")
    print("\nmemory (the two layers share one table; gradients are Rope's dq_in/dk_in):")
    print(net.get_memory_stats())


def inference_demo(device: str) -> None:
    hf_config = {  # the RoPE-relevant part of a Llama 3.1 config.json, at toy width
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg = rope_config_from_hf(hf_config, max_seq_len=16384)
    rope = Rope("rope", cfg, device=device)
    prompt, chunk = 1000, 256
    rope.build(BuildContext((1, prompt, cfg.channels), RuntimeMode.INFERENCE, prefill_size=chunk))
    print(f"\n{rope}")

    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, prompt, cfg.channels), dtype=np.float32)
    k = rng.standard_normal((1, prompt, cfg.kv_channels), dtype=np.float32)
    q_full, k_full = q.copy(), k.copy()
    rope.forward(q_full, k_full)
    for start in range(0, prompt, chunk):  # chunked prefill continues positions across chunks
        stop = min(prompt, start + chunk)
        rope.prefill(q[:, start:stop], k[:, start:stop], position_offset=start)
    print(
        f"chunked prefill ({chunk}-token chunks) vs one forward: max |diff| = "
        f"{max(np.abs(q - q_full).max(), np.abs(k - k_full).max()):.1e}"
    )

    steps = 2000
    q1 = rng.standard_normal((1, 1, cfg.channels), dtype=np.float32)
    k1 = rng.standard_normal((1, 1, cfg.kv_channels), dtype=np.float32)
    rope.decode(q1, k1, prompt)
    start = time.perf_counter()
    for position in range(prompt, prompt + steps):
        rope.decode(q1, k1, position)
    rope.synchronize()
    per_call = (time.perf_counter() - start) / steps
    print(f"decode: {per_call * 1e6:.1f} us per call ({1 / per_call:,.0f} calls/s)")
    try:
        rope.decode(q1, k1, cfg.max_seq_len)
    except ValueError as exc:
        print(f"position past the table is refused, data untouched: {exc}")
    print(rope.get_memory_stats())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="CPU", help="CPU or CUDA:0")
    args = parser.parse_args()
    training_demo(args.device)
    inference_demo(args.device)


if __name__ == "__main__":
    main()
