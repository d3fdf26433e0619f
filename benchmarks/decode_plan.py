"""Decode plan vs the components' own calls: the host work of one decode step, in one run.

``Llama.decode`` runs a *decode plan* (every layer's ops bound once to the build's buffers); the
baseline is ``Llama._decode_components``, the same step through the components' checked calls.
Both run on the same model, interleaved, one token per call at a fixed position, and the table
gives µs per token and per layer and the speedup of the plan.

A small model (dim 64, 4 layers) keeps the arithmetic negligible, so what is measured is the
host work per step, which bounds decode latency on a GPU (every op is a kernel launch of a few
microseconds there) and matters for small models on the CPU:

- ``--device CPU``: the CPU ops (BLAS, the fused kernels of the ``jit`` extra).
- ``--device CUDA:0``: a GPU, with a stream synchronization after each step.
- ``--stub-cuda``: the CUDA ops' host side on a machine without a GPU: a ``CUDA:0`` whose
  arrays are NumPy arrays and whose kernel launches do nothing (the test suite's kernel
  emulator, ``tests/kernel_emulator.py``, with its launches stubbed). Bound ``sgemm`` calls do
  nothing either; ``cupy.matmul`` products still run (in NumPy, at dim 64), so this overstates
  the host work of the component path. RoPE decode steps launch by CuPy's path there
  (``PACKED_DECODE`` off): the emulator's packed launch re-reads every argument at each call,
  which a GPU's ``cuLaunchKernel`` does not, so its host time means nothing there.

On CUDA a third row times the plan with the other matrix-product call than the default
(``DIRECT_GEMM`` in ``mila_py/ops/cuda/linear.py``: cuBLAS ``sgemm`` bound once, or
``cupy.matmul`` per call), a second model whose plan is made with the flag flipped: the A/B that
decides the default. With ``--stub-cuda`` the bound ``sgemm`` does nothing and ``cupy.matmul``
multiplies in NumPy: that row's gap is not the GPU's. With ``--ragged`` a fourth row times a plan
whose ragged steps upload their positions (``POSITION_CAPACITIES`` empty during each step), as
before they went in the launches' parameters.

Run: ``python benchmarks/decode_plan.py [--device CPU | --device CUDA:0 | --stub-cuda]
[--batch B [--ragged]]`` (``--ragged``: every sequence at its own position).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mila_py import BuildContext, RuntimeMode
from mila_py.components import Llama, LlamaConfig
from mila_py.ops.cuda import _kernels
from mila_py.ops.cuda import linear as cuda_linear
from mila_py.ops.cuda import rope as cuda_rope

CFG = LlamaConfig(
    vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=192, max_seq_len=512
)


@contextlib.contextmanager
def stubbed_cuda() -> Iterator[None]:
    """``CUDA:0`` as the kernel emulator's NumPy context, every kernel launch and bound
    ``sgemm`` a no-op, RoPE decode steps launched by CuPy's path (the emulator's packed launch
    re-reads its arguments at each call, which costs what a GPU's does not)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from kernel_emulator import emulated_cuda_devices

    class NoLaunches:
        def launch(self, *args: Any, **kwargs: Any) -> None:
            pass

    packed = cuda_rope.PACKED_DECODE
    # no kernel runs, so the arrays hold garbage (NaN from unnormalized -inf scores): no warnings
    with emulated_cuda_devices(NoLaunches()), np.errstate(all="ignore"):  # type: ignore[arg-type]
        sgemm = _kernels.sgemm
        _kernels.sgemm = lambda *args, **kwargs: None  # type: ignore[assignment]
        cuda_rope.PACKED_DECODE = False
        try:
            yield
        finally:
            _kernels.sgemm, cuda_rope.PACKED_DECODE = sgemm, packed  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--stub-cuda", action="store_true", help="CUDA ops, launches stubbed")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--ragged", action="store_true", help="one position per sequence (needs --batch >= 2)"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = "CUDA:0" if args.stub_cuda else args.device
    with stubbed_cuda() if args.stub_cuda else contextlib.nullcontext():
        prompt = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(args.batch, 33))
        model = prefilled_model(device, prompt[:, :32])
        ctx = model.execution_context
        token = prompt[:, 32]
        column = ctx.to_device(token.reshape(-1, 1))  # the components take device arrays
        at: Any = np.arange(32 - args.batch + 1, 33) if args.ragged else 32
        cases: dict[str, Callable[[], object]] = {
            "components (checked calls)": lambda: model._decode_components(column, at),
            "decode plan": lambda: model.decode(token, at),
        }
        if device.upper().startswith("CUDA"):  # the plan with the other product call
            direct = not cuda_linear.DIRECT_GEMM
            other = prefilled_model(device, prompt[:, :32])
            previous, cuda_linear.DIRECT_GEMM = cuda_linear.DIRECT_GEMM, direct
            try:
                other.decode(token, at)  # its plan is made now, with the flag flipped
            finally:
                cuda_linear.DIRECT_GEMM = previous
            steps = [s for _, plan, _ in (other._plans or {}).values() for s in plan]
            bound = sum(hasattr(step, "gemm_arguments") for step in steps)
            if bool(bound) != direct:  # the label must say what the row times
                raise SystemExit(f"decode_plan: the other plan has {bound} bound sgemm calls")
            name = f"plan, {f'{bound} direct sgemm' if direct else 'cupy.matmul'}"
            cases[name] = lambda: other.decode(token, at)
            if args.ragged:  # the plan as before positions went by value: uploaded per step
                uploading = prefilled_model(device, prompt[:, :32])

                def uploaded() -> None:  # its plan is made, and runs, inside
                    with _kernels.positions_uploaded():
                        uploading.decode(token, at)

                cases["plan, positions uploaded"] = uploaded
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        for fn in cases.values():  # warm: plans, compiled kernels, caches
            fn()
        ctx.synchronize()
        for _ in range(args.rounds):  # interleaved rounds: both see the same background load
            for name, fn in cases.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                ctx.synchronize()
                seconds[name].append((time.perf_counter() - start) / args.steps)
    where = "CUDA:0 with launches stubbed (host work only)" if args.stub_cuda else device
    print(
        f"\ndecode step, B={args.batch}{' (ragged)' if args.ragged else ''}, "
        f"{model.parameter_count() / 1e6:.2f}M params, "
        f"{CFG.n_layers} layers, fp32, {where}; best of {args.rounds} rounds of {args.steps}"
    )
    print(f"{'path':<28} {'us/token':>9} {'us/layer':>9} {'x components':>13}")
    base = min(seconds["components (checked calls)"])
    for name, times in seconds.items():
        best = min(times)
        print(f"{name:<28} {best * 1e6:9.1f} {best * 1e6 / CFG.n_layers:9.1f} {base / best:13.2f}")
    pairs = zip(seconds["components (checked calls)"], seconds["decode plan"], strict=True)
    ratios = [b / p for b, p in pairs]
    print(f"plan speedup per round: median {statistics.median(ratios):.2f}x")
    for name in list(seconds)[2:]:  # the plan with the other product call, against the plan
        pairs = zip(seconds["decode plan"], seconds[name], strict=True)
        ratios = [p / o for p, o in pairs]
        print(f"{name} over the decode plan (DIRECT_GEMM={cuda_linear.DIRECT_GEMM}, positions "
              f"by value) per round: median {statistics.median(ratios):.2f}x (above 1: faster)")  # fmt: skip
    if args.stub_cuda and len(seconds) > 2:
        print("(stubbed: a bound sgemm does nothing and cupy.matmul multiplies in NumPy, so the "
              "cupy.matmul row's gap to the plan is not a GPU's)")  # fmt: skip


def prefilled_model(device: str, prompt: np.ndarray) -> Llama:
    """The benchmark's model on ``device``, built for ``prompt``'s batch, ``prompt`` prefilled."""
    model = Llama("llama", CFG, device=device)
    model.build(
        BuildContext(
            (prompt.shape[0], CFG.max_seq_len),
            RuntimeMode.INFERENCE,
            initialize_parameters=True,
            prefill_size=32,
        )
    )
    model.prefill(prompt)
    return model


if __name__ == "__main__":
    main()
