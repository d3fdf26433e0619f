"""Training-step throughput on a GPU: mila_py (CuPy) vs the same model in PyTorch eager, one run.

A step is forward + cross-entropy + backward + AdamW on one GPU, in ``--precision``:

- ``fp32`` (default): both sides in fp32, TF32 off on both, so both run fp32 GEMMs;
- ``bf16``: mila_py's model stored and run in BF16 (FP32 gradient buffers, the loss read from
  the BF16 logits in FP32, ``AdamW`` keeping FP32 master weights and moments); PyTorch's the
  same model with FP32 parameters, its forward under ``torch.autocast(dtype=torch.bfloat16)``
  and ``torch.optim.AdamW`` (torch's default implementation) on the FP32 parameters;
- ``fp16``: the same in FP16, with dynamic loss scaling on both sides (mila_py's
  ``GradScaler``, ``torch.amp.GradScaler``, both from a scale of 2**16).

Printed:

- ms/step and tokens/s of mila_py and of PyTorch eager (``F.scaled_dot_product_attention``),
  and PyTorch's step time over mila_py's (above 1: mila_py faster);
- both sides' losses at the first and the last step: both start from mila_py's initial
  weights (copied into the FP32 parameters of PyTorch's model) and train on one fixed random
  batch, so the first losses agree and both fall alike from ~ln(vocab);
- on a GPU, where mila_py's step time goes: CUDA events on the context's stream around every
  ``cupy.matmul`` / cuBLAS GEMM call (the fraction of the step spent in matrix products,
  including the copies CuPy makes to feed cuBLAS) and around every op call (inclusive GPU time
  per op and method), in a separate instrumented step.

Sizes: ``small`` is ``benchmarks/train_step.py``'s ~10M model (B=4, T=256: launch-bound on a
big GPU); ``medium`` (~120M, B=8, T=512) and ``large`` (~470M, B=4, T=1024) load it properly.
``--device CPU`` runs both sides on the CPU (NumPy + Numba; torch's CPU autocast), without the
profile: a smoke run of a small shape (``--size small --batch 1 --seq 32 --steps 2``).

Run: ``python benchmarks/train_step_cuda.py [--size medium] [--precision bf16] [--device CUDA:0]
[--steps 10]``.
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

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.devices import DeviceId, DeviceType
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW, GradScaler

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


def _time(
    step: Callable[[], float], sync: Callable[[], None], steps: int
) -> tuple[float, list[float]]:
    """(median seconds of ``step``, each ended by ``sync``, after two warm-up steps; the loss
    of every step, the warm-up ones first)."""
    losses = [step() for _ in range(2)]
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), losses


def mila_step(
    cfg: LlamaConfig,
    n_b: int,
    n_t: int,
    device: str,
    tokens: np.ndarray,
    targets: np.ndarray,
    precision: Precision = Precision.FP32,
) -> tuple[Callable[[], float], Llama, GradScaler | None]:
    """(one training step returning its loss, the model, the FP16 loss scaler or None)."""
    model = Llama("llama", cfg, device=device, precision=precision)
    model.build(BuildContext((n_b, n_t), RuntimeMode.TRAINING))
    # the loss shares the model's context (the same stream; contexts of one GPU share it
    # anyway) and its precision: it reads 16-bit logits as they are, in FP32
    loss_fn = SoftmaxCrossEntropy(
        "loss", SoftmaxCrossEntropyConfig(cfg.vocab_size), precision=precision
    )
    loss_fn.set_execution_context(model.execution_context)
    loss_fn.build(BuildContext((n_b, n_t, cfg.vocab_size), RuntimeMode.TRAINING))
    opt = AdamW(model, lr=1e-3, weight_decay=0.1)  # FP32 masters and moments for 16 bits
    scaler = GradScaler() if precision is Precision.FP16 else None
    ctx = model.execution_context
    tok, tgt = ctx.to_device(tokens), ctx.to_device(targets)

    def step() -> float:
        loss = loss_fn.forward(model.forward(tok), tgt)
        if scaler is None:
            model.backward(loss_fn.backward())
            opt.step()
        else:
            model.backward(loss_fn.backward(scaler.scale(1.0)))
            scaler.step(opt)  # skipped on inf/NaN gradients
            scaler.update()
        model.zero_gradients()
        return loss

    return step, model, scaler


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--device", default="CUDA:0", help="CUDA:N, or CPU for a smoke run")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="see above"
    )
    parser.add_argument("--batch", type=int, default=None, help="B (default: the size's)")
    parser.add_argument("--seq", type=int, default=None, help="T (default: the size's)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cfg, n_b, n_t = SIZES[args.size]
    n_b, n_t = args.batch or n_b, args.seq or n_t
    if n_t > cfg.max_seq_len or args.steps < 1:
        parser.error(f"--seq must be <= {cfg.max_seq_len} for {args.size}, --steps >= 1")
    device = DeviceId.parse(args.device)
    on_gpu = device.device_type is DeviceType.CUDA
    precision = Precision.parse(args.precision)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(n_b, n_t))
    targets = rng.integers(0, cfg.vocab_size, size=(n_b, n_t))
    n_tokens = n_b * n_t

    step, model, scaler = mila_step(cfg, n_b, n_t, str(device), tokens, targets, precision)
    ctx = model.execution_context
    # both libraries start from mila_py's initial weights (16-bit ones exactly, as FP32)
    weights = {name: ctx.to_host(p) for name, p in model.named_parameters()}
    mila_label = "mila_py (CuPy)" if on_gpu else "mila_py (NumPy + Numba)"
    # (label, median seconds, losses, what reads the loss scale: a GradScaler or the torch step)
    rows = [(mila_label, *_time(step, model.synchronize, args.steps), scaler)]
    if on_gpu:
        gpu_ms, by_label = profile_mila(step, model)
    try:
        import torch

        torch_device = f"cuda:{device.index}" if on_gpu else "cpu"
        torch_step = torch_train_step(
            cfg, tokens, targets, torch_device, args.precision, weights=weights
        )
        sync = torch.cuda.synchronize if on_gpu else (lambda: None)
        how = "eager" if precision is Precision.FP32 else f"eager, autocast {args.precision}"
        rows.append((f"PyTorch {torch.__version__} {how}", *_time(torch_step, sync, args.steps),
                     torch_step))  # fmt: skip
    except Exception as exc:  # not installed, or failing on this GPU: mila_py's rows still print
        print(f"(PyTorch skipped: {type(exc).__name__}: {exc})")

    if on_gpu:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(device.index)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        where = f"{device} ({name})"
    else:
        where = "CPU"
    masters = "" if precision is Precision.FP32 else ", FP32 master weights on both sides"
    print(
        f"\nLlama training step, {model.parameter_count() / 1e6:.1f}M parameters, "
        f"B={n_b} T={n_t}, {args.precision}{masters}, {where}; median of {args.steps} steps"
    )
    header = (
        f"{'what':<40} {'ms/step':>9} {'tokens/s':>10} {'x mila_py':>9} | "
        f"{'first loss':>10} {'last loss':>10}"
    )
    if precision is Precision.FP16:
        header += f" {'loss scale':>10}"
    print(header)
    base = rows[0][1]
    for label, seconds, losses, scaled in rows:
        line = (
            f"{label:<40} {seconds * 1e3:9.1f} {n_tokens / seconds:10,.0f} {base / seconds:9.2f} "
            f"| {losses[0]:10.4f} {losses[-1]:10.4f}"
        )
        if precision is Precision.FP16:
            scale = scaled.get_scale() if isinstance(scaled, GradScaler) else scaled.loss_scale()
            line += f" {scale:10g}"
        print(line)
    if len(rows) == 2:
        print(f"mila_py throughput / PyTorch's: {rows[1][1] / base:.2f}x")

    if on_gpu:
        print(f"\nmila_py: one instrumented step spans {gpu_ms:.1f} ms on the GPU stream")
        print(f"{'where (inclusive)':<40} {'ms':>8} {'share':>7}")
        for label, ms in sorted(by_label.items(), key=lambda kv: -kv[1]):
            print(f"{label:<40} {ms:8.2f} {ms / gpu_ms:7.1%}")
        matmul = by_label.get("matmul", 0.0)
        print(f"\nmatmuls (cuBLAS through CuPy): {matmul / gpu_ms:.1%} of the step's stream time")


if __name__ == "__main__":
    main()
