"""Training-step throughput on a GPU: mila_py (CuPy) vs the same model in PyTorch eager, one run.

A step is forward + cross-entropy + backward + AdamW, fp32, on one GPU. Printed:

- tokens/s and ms/step of mila_py and of PyTorch eager (``F.scaled_dot_product_attention``,
  TF32 off on both sides, so both run fp32 GEMMs);
- where mila_py's step time goes on the GPU: CUDA events on the context's stream around every
  ``cupy.matmul`` / cuBLAS GEMM call (the fraction of the step spent in matrix products,
  including the copies CuPy makes to feed cuBLAS) and around every op call (inclusive GPU time
  per op and method), in a separate instrumented step.

Sizes: ``small`` is ``benchmarks/train_step.py``'s ~10M model (B=4, T=256: launch-bound on a
big GPU); ``medium`` (~120M, B=8, T=512) and ``large`` (~470M, B=4, T=1024) load it properly.

Run: ``python benchmarks/train_step_cuda.py [--size medium] [--device CUDA:0] [--steps 10]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from _torch_llama import torch_train_step

from mila_py import BuildContext, RuntimeMode
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.devices import DeviceId
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW

SIZES: dict[str, tuple[LlamaConfig, int, int]] = {
    "small": (
        LlamaConfig(
            vocab_size=256, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024,
            max_seq_len=256,
        ),
        4, 256,
    ),
    "medium": (
        LlamaConfig(
            vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, hidden_dim=2048,
            max_seq_len=512,
        ),
        8, 512,
    ),
    "large": (
        LlamaConfig(
            vocab_size=32000, dim=1536, n_layers=16, n_heads=16, n_kv_heads=4, hidden_dim=4096,
            max_seq_len=1024,
        ),
        4, 1024,
    ),
}  # fmt: skip


def _time(step: Callable[[], object], sync: Callable[[], None], steps: int) -> float:
    """Median seconds of ``step`` (each ended by ``sync``), after two warm-up steps."""
    for _ in range(2):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mila_step(
    cfg: LlamaConfig, n_b: int, n_t: int, device: str, tokens: np.ndarray, targets: np.ndarray
) -> tuple[Callable[[], float], Llama]:
    model = Llama("llama", cfg, device=device)
    model.build(BuildContext((n_b, n_t), RuntimeMode.TRAINING))
    # the loss shares the model's context (the same stream; contexts of one GPU share it anyway)
    loss_fn = SoftmaxCrossEntropy("loss", SoftmaxCrossEntropyConfig(cfg.vocab_size))
    loss_fn.set_execution_context(model.execution_context)
    loss_fn.build(BuildContext((n_b, n_t, cfg.vocab_size), RuntimeMode.TRAINING))
    opt = AdamW(model, lr=1e-3, weight_decay=0.1)
    ctx = model.execution_context
    tok, tgt = ctx.to_device(tokens), ctx.to_device(targets)

    def step() -> float:
        loss = loss_fn.forward(model.forward(tok), tgt)
        model.backward(loss_fn.backward())
        opt.step()
        model.zero_gradients()
        return loss

    return step, model


@contextmanager
def gpu_time_by_call() -> Iterator[dict[str, list[Any]]]:
    """Record CUDA events around every matmul and every CUDA op method while active.

    Yields ``{label: [(start event, end event), ...]}``; read it after a synchronize.
    """
    import cupy
    import cupy.cublas

    from mila_py.devices import DeviceType
    from mila_py.ops import registry

    events: dict[str, list[Any]] = defaultdict(list)
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        if getattr(original, "timed", False):  # inherited from a class wrapped already
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            current = cupy.cuda.get_current_stream()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(current)
            try:
                return original(*args, **kwargs)
            finally:
                end.record(current)
                events[label].append((start, end))

        timed.timed = True  # type: ignore[attr-defined]
        patched.append((owner, attr, original))
        setattr(owner, attr, timed)

    wrap(cupy, "matmul", "matmul")
    wrap(cupy.cublas, "gemm", "matmul")
    for entry in registry.registered_ops():
        if entry.device_type is DeviceType.CUDA:
            for method in ("forward", "backward", "step", "apply"):
                if callable(getattr(entry.cls, method, None)):  # inherited ones too
                    wrap(entry.cls, method, f"{entry.cls.__name__}.{method}")
    try:
        yield events
    finally:
        for owner, attr, original in reversed(patched):
            setattr(owner, attr, original)


def profile_mila(step: Callable[[], float], model: Llama) -> tuple[float, dict[str, float]]:
    """(ms of one step on the model's stream, {label: ms}) from one instrumented step.

    The step's span on the stream includes the gaps where the GPU waits for the host to launch.
    """
    import cupy

    ctx = model.execution_context
    stream = ctx.stream  # type: ignore[attr-defined]
    ctx.synchronize()
    with gpu_time_by_call() as events:
        first, last = cupy.cuda.Event(), cupy.cuda.Event()
        first.record(stream)
        step()
        last.record(stream)
        cupy.cuda.runtime.deviceSynchronize()
    total = cupy.cuda.get_elapsed_time(first, last)
    per_label = {
        label: sum(cupy.cuda.get_elapsed_time(a, b) for a, b in pairs)
        for label, pairs in events.items()
    }
    return total, per_label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--device", default="CUDA:0")
    parser.add_argument("--batch", type=int, default=None, help="B (default: the size's)")
    parser.add_argument("--seq", type=int, default=None, help="T (default: the size's)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cfg, n_b, n_t = SIZES[args.size]
    n_b, n_t = args.batch or n_b, args.seq or n_t
    device = DeviceId.parse(args.device)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(n_b, n_t))
    targets = rng.integers(0, cfg.vocab_size, size=(n_b, n_t))
    n_tokens = n_b * n_t

    import cupy

    step, model = mila_step(cfg, n_b, n_t, str(device), tokens, targets)
    sync = cupy.cuda.runtime.deviceSynchronize
    rows = [("mila_py (CuPy)", _time(step, sync, args.steps))]
    gpu_ms, by_label = profile_mila(step, model)
    try:
        import torch

        torch_device = f"cuda:{device.index}"
        rows.append(
            (
                f"PyTorch {torch.__version__} eager",
                _time(
                    torch_train_step(cfg, tokens, targets, torch_device),
                    torch.cuda.synchronize,
                    args.steps,
                ),
            )
        )
    except Exception as exc:  # not installed, or failing on this GPU: mila_py's rows still print
        print(f"(PyTorch skipped: {type(exc).__name__}: {exc})")

    name = cupy.cuda.runtime.getDeviceProperties(device.index)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(
        f"\nLlama training step, {model.parameter_count() / 1e6:.1f}M parameters, "
        f"B={n_b} T={n_t}, fp32, {device} ({name})"
    )
    print(f"{'what':<28} {'ms/step':>9} {'tokens/s':>10} {'vs first':>9}")
    base = rows[0][1]
    for label, seconds in rows:
        print(f"{label:<28} {seconds * 1e3:9.1f} {n_tokens / seconds:10,.0f} {base / seconds:9.2f}")

    print(f"\nmila_py: one instrumented step spans {gpu_ms:.1f} ms on the GPU stream")
    print(f"{'where (inclusive)':<40} {'ms':>8} {'share':>7}")
    for label, ms in sorted(by_label.items(), key=lambda kv: -kv[1]):
        print(f"{label:<40} {ms:8.2f} {ms / gpu_ms:7.1%}")
    matmul = by_label.get("matmul", 0.0)
    print(f"\nmatmuls (cuBLAS through CuPy): {matmul / gpu_ms:.1%} of the step's stream time")


if __name__ == "__main__":
    main()
