"""Accuracy of RoPE tables against position: float32 angle formation vs mila_py's float64.

Hugging Face (and most libraries) form ``inv_freq`` and ``position * inv_freq`` in float32; the
angle's rounding error grows with the position. mila_py forms angles in float64 and rounds cos
and sin once. This prints the worst absolute error of cos/sin over all frequencies, for both,
against a float64 truth, at growing positions (head_dim 128, base 500000, as Llama 3).

Run: ``python benchmarks/rope_angle_error.py``
"""

from __future__ import annotations

import numpy as np

from mila_py.components import RopeConfig, get_rope


def main() -> None:
    head_dim, base = 128, 500000.0
    positions = np.array([0, 1_000, 8_000, 32_000, 128_000, 500_000, 1_000_000], dtype=np.int64)
    cfg = RopeConfig(
        channels=head_dim, n_heads=1, n_kv_heads=1, max_seq_len=int(positions.max()) + 1, base=base
    )
    table = get_rope(cfg, "CPU")
    exponent = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv64 = 1.0 / base**exponent
    inv32 = (1.0 / (np.float32(base) ** exponent.astype(np.float32))).astype(np.float32)
    print(f"{'position':>10} {'fp32 angles (HF-style)':>24} {'mila_py (fp64 angles)':>24}")
    for p in positions:
        truth_c, truth_s = np.cos(p * inv64), np.sin(p * inv64)
        ang32 = np.float32(p) * inv32  # float32 product, as torch does
        err32 = max(
            np.abs(np.cos(ang32.astype(np.float64)) - truth_c).max(),
            np.abs(np.sin(ang32.astype(np.float64)) - truth_s).max(),
        )
        err_mila = max(
            np.abs(table.cos[p].astype(np.float64) - truth_c).max(),
            np.abs(table.sin[p].astype(np.float64) - truth_s).max(),
        )
        print(f"{p:>10,} {err32:>24.2e} {err_mila:>24.2e}")


if __name__ == "__main__":
    main()
