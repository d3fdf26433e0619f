"""Decode with and without SwiGLU's packed gate/up projections, A/B in one process.

Two fp32 INFERENCE builds of one generation-benchmark size (``--size``, ~100M by default:
88.1M parameters), identical weights (the same initialization): one as the package builds it,
its SwiGLU blocks packing ``gate_proj`` and ``up_proj`` into one ``[2 hidden, dim]`` matrix
(one product for both), and one with the packing turned off for its build (two products). A
round prefills the same ``--prompt``-token prompt on each and times ``--new`` decode steps
right after it, one sequence, the build that goes first alternating between rounds; the
steps' logits are checked equal first. Prints the median ms per step of each and the median of
the per-round ratios (unpacked over packed: above 1, packing pays). The machine's background
load moves single rounds by 10-30%, so only the medians over many rounds mean much.

Run: ``python benchmarks/swiglu_packing.py [--size ~100M] [--prompt 256] [--new 64]
[--rounds 25]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
from generate import CPU_SIZES, SIZES  # the sibling script: the same models

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import SwiGLU
from mila_py.interop.hf import llama_config_from_hf
from mila_py.models import Llama


def build(cfg: Any, context: int, prompt: int, packs: bool) -> Llama:
    """An fp32 CPU INFERENCE build of ``cfg`` for one sequence; ``packs=False`` builds its
    SwiGLU blocks as a build with biases would, with separate gate and up matrices."""
    model = Llama("llama", cfg, device="CPU", precision=Precision.FP32)
    context_ = BuildContext((1, context), RuntimeMode.INFERENCE, prefill_size=prompt)
    original = SwiGLU._packs
    if not packs:
        SwiGLU._packs = lambda self, build_context: False  # type: ignore[method-assign]
    try:
        model.build(context_)
    finally:
        SwiGLU._packs = original  # type: ignore[method-assign]
    packed = [block.mlp._packed_weight() is not None for block in model.layers]
    if packed != [packs] * len(packed):
        raise SystemExit(f"swiglu_packing: asked for packs={packs}, the blocks pack {packed}")
    return model


def decode_seconds(model: Llama, prompt: np.ndarray, tokens: np.ndarray) -> float:
    """Seconds per decode step of ``tokens`` fed one by one right after a prefill of
    ``prompt [1, T]``."""
    model.prefill(prompt)
    start = time.perf_counter()
    for i, token in enumerate(tokens):
        model.decode([int(token)], prompt.shape[1] + i)
    return (time.perf_counter() - start) / len(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="~100M", choices=list(CPU_SIZES))
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    if args.prompt < 1 or args.new < 1 or args.rounds < 1:
        parser.error("--prompt, --new and --rounds must be >= 1")
    try:
        import transformers
    except ImportError as exc:  # the sizes are HF configs, as in generate.py
        raise SystemExit(f"this benchmark reads its sizes as HF Llama configs: {exc}") from None
    context = args.prompt + args.new
    hf_cfg = transformers.LlamaConfig(**SIZES[args.size], max_position_embeddings=context)
    cfg = llama_config_from_hf(hf_cfg.to_dict(), context=context)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, size=(1, args.prompt))
    tokens = rng.integers(0, cfg.vocab_size, size=args.new)
    packed = build(cfg, context, args.prompt, packs=True)
    unpacked = build(cfg, context, args.prompt, packs=False)
    for model in (packed, unpacked):
        model.prefill(prompt)
    first = [model.decode([int(tokens[0])], args.prompt) for model in (packed, unpacked)]
    np.testing.assert_allclose(first[0], first[1], rtol=1e-4, atol=1e-5)

    times: dict[str, list[float]] = {"packed": [], "unpacked": []}
    order = [("packed", packed), ("unpacked", unpacked)]
    for model in (packed, unpacked):  # warm-up: plans, caches
        decode_seconds(model, prompt, tokens)
    for r in range(args.rounds):
        for name, model in order if r % 2 == 0 else order[::-1]:
            times[name].append(decode_seconds(model, prompt, tokens))
    ratios = [u / p for p, u in zip(times["packed"], times["unpacked"], strict=True)]
    params = packed.parameter_count()
    ratio = statistics.median(ratios)
    print(
        f"{args.size} ({params / 1e6:.1f}M parameters), fp32, B=1, {args.rounds} rounds of "
        f"{args.new} decode steps after a {args.prompt}-token prompt"
    )
    for name, values in times.items():
        print(f"  {name:<8} median {statistics.median(values) * 1e3:.3f} ms per step")
    print(
        f"  unpacked / packed: median of rounds {ratio:.3f} (range {min(ratios):.3f}-"
        f"{max(ratios):.3f}); packing saves {(1 - 1 / ratio) * 100:.1f}% of the unpacked step"
    )


if __name__ == "__main__":
    main()
