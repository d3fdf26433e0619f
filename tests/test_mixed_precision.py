"""Mixed-precision training: FP32 master weights and moments in AdamW for 16-bit models,
dynamic loss scaling (GradScaler, checked against torch's), 16-bit or FP32 ``dlogits`` in
backward, saving in another precision, and BF16/FP16 runs that learn as FP32 does."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from cuda_arrays import EMULATED, dev, host, skip_bf16_without_arrays

from mila_py import BuildContext, RuntimeMode
from mila_py.components import Linear, LinearConfig
from mila_py.data import TokenDataset, prepare_data
from mila_py.init import manual_seed
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW, GradScaler
from mila_py.precision import Precision
from mila_py.serialization import PRECISION_KEY, load, save
from mila_py.train import evaluate, load_checkpoint, save_checkpoint, train

BF16, FP16, FP32 = Precision.BF16, Precision.FP16, Precision.FP32
T = 8
CFG = LlamaConfig(
    vocab_size=256, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=24, max_seq_len=16
)


def llama(precision: Precision, batch: int = 2, init: list[np.ndarray] | None = None) -> Llama:
    """A tiny TRAINING Llama; ``init``: FP32 weights to start from (rounded to ``precision``)."""
    manual_seed(0)
    model = Llama("llama", CFG, device="CPU", precision=precision)
    model.build(BuildContext((batch, T), RuntimeMode.TRAINING))
    if init is not None:
        for (_, p), w in zip(model.named_parameters(), init, strict=True):
            p[...] = w.astype(p.dtype)
    return model


def fill_gradients(model: Any, step: int) -> None:
    """Random FP32 gradients, the same for every model of one architecture at one step."""
    for i, (_, g) in enumerate(model.named_gradients()):
        g[...] = np.random.default_rng(1000 * step + i).normal(0.0, 0.1, g.shape)


def snapshot(model: Any, opt: AdamW) -> list[bytes]:
    arrays = [p for _, p in model.named_parameters()]
    arrays += [w for w in opt._master if w is not None] + opt._m + opt._v
    return [np.asarray(a).tobytes() for a in arrays]


# ------------------------------------------------------------------- master weights, moments


@pytest.mark.parametrize("precision", [BF16, FP16])
def test_16_bit_parameters_get_fp32_masters_and_moments(precision: Precision) -> None:
    model = llama(precision)
    opt = AdamW(model)
    params = [p for _, p in model.named_parameters()]
    assert all(p.dtype == precision.numpy_dtype for p in params)
    for p, w, m, v in zip(params, opt._master, opt._m, opt._v, strict=True):
        assert w.dtype == m.dtype == v.dtype == np.float32
        assert w.shape == m.shape == v.shape == p.shape
        np.testing.assert_array_equal(w, p.astype(np.float32))  # a copy, exact
        assert not np.shares_memory(w, p)
    n = sum(p.size for p in params)
    stats = opt.get_memory_stats()
    # masters + m + v: 12 bytes per parameter, all FP32
    assert stats.device_state_bytes == 12 * n  # the CPU is the device here
    assert stats.by_dtype == {"FP32": 12 * n}


def test_fp32_parameters_have_no_master_copy() -> None:
    model = llama(FP32)
    opt = AdamW(model)
    n = sum(p.size for p in model.get_parameters())
    assert opt._master == [None] * len(opt._m)
    assert opt.get_memory_stats().by_dtype == {"FP32": 8 * n}
    assert "master" not in opt.state_dict()


def test_a_bf16_step_is_the_fp32_step_of_its_master_rounded_to_nearest_even() -> None:
    """The same gradients into a BF16 model and an FP32 model that starts from its weights:
    after each step the masters are the FP32 model's weights bit for bit, and the BF16
    parameters are those rounded to nearest even (ml_dtypes' cast, as torch's)."""
    low = llama(BF16)
    high = llama(FP32, init=[p.astype(np.float32) for _, p in low.named_parameters()])
    low_opt, high_opt = AdamW(low, lr=3e-3), AdamW(high, lr=3e-3)
    for step in range(3):
        fill_gradients(low, step)
        fill_gradients(high, step)
        low_opt.step()
        high_opt.step()
        for (_, p), (_, q), w in zip(
            low.named_parameters(), high.named_parameters(), low_opt._master, strict=True
        ):
            np.testing.assert_array_equal(w, q)
            np.testing.assert_array_equal(p.view(np.uint16), q.astype(p.dtype).view(np.uint16))
    for mine, ref in zip(low_opt._m + low_opt._v, high_opt._m + high_opt._v, strict=True):
        np.testing.assert_array_equal(mine, ref)


def test_master_weights_keep_updates_that_bf16_rounds_away() -> None:
    """Weights of 1.0 (BF16 steps of 2**-8 just below it) and a constant gradient: each Adam
    step moves a weight by about lr = 1e-3, under half a step. Applied to the BF16 weights
    themselves every step rounds back to 1.0; the FP32 master gathers the ten steps
    (1.0 - 10 * lr = 0.990) and the BF16 weight follows it (0.98828125, its rounding)."""
    model = llama(BF16)
    opt = AdamW(model, lr=1e-3, weight_decay=0.0)
    for _, p in model.named_parameters():
        p[...] = 1.0
    opt.sync_master_weights()
    naive = np.ones(4, dtype=ml_dtypes.bfloat16)
    for _ in range(10):
        for _, g in model.named_gradients():
            g[...] = 0.5
        opt.step()
        # the update without a master: the same step rounded into the BF16 weight each time
        naive = (naive.astype(np.float32) - np.float32(1e-3)).astype(ml_dtypes.bfloat16)
    assert (naive == 1.0).all()
    for (_, p), w in zip(model.named_parameters(), opt._master, strict=True):
        np.testing.assert_allclose(w, 0.99, rtol=1e-5)
        np.testing.assert_array_equal(p.view(np.uint16), w.astype(p.dtype).view(np.uint16))
        assert (p < 1.0).all()


def test_sync_master_weights_takes_weights_loaded_after_the_optimizer(tmp_path: Path) -> None:
    """The masters are copied at construction; weights loaded later are taken by a sync (and
    a step without one would write the old masters back)."""
    trained = llama(BF16)
    for _, p in trained.named_parameters():
        p[...] = p.astype(np.float32) * 2.0 + 0.25
    save(trained, tmp_path / "w.safetensors")
    model = llama(BF16)
    opt = AdamW(model)
    load(model, tmp_path / "w.safetensors")
    stale = [p for (_, p), w in zip(model.named_parameters(), opt._master, strict=True)
             if not np.array_equal(w, p.astype(np.float32))]  # fmt: skip
    assert stale
    opt.sync_master_weights()
    for (_, p), w in zip(model.named_parameters(), opt._master, strict=True):
        np.testing.assert_array_equal(w, p.astype(np.float32))


def test_a_resumed_bf16_run_continues_bit_for_bit(tmp_path: Path) -> None:
    """Three steps, a checkpoint (masters in it), three more in a fresh model and optimizer:
    the same bytes as six steps in one go (and without the masters it would differ)."""
    straight = llama(BF16)
    straight_opt = AdamW(straight, lr=1e-3)
    for step in range(6):
        fill_gradients(straight, step)
        straight_opt.step()

    first = llama(BF16)
    first_opt = AdamW(first, lr=1e-3)
    for step in range(3):
        fill_gradients(first, step)
        first_opt.step()
    state = first_opt.state_dict()
    assert set(state["master"]) == {n for n, _ in first.named_parameters()}
    assert all(a.dtype == np.float32 for a in state["master"].values())
    save_checkpoint(tmp_path / "ckpt", first, first_opt)

    resumed = llama(BF16)
    resumed_opt = AdamW(resumed, lr=5.0)  # the saved hyper-parameters replace these
    load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    for step in range(3, 6):
        fill_gradients(resumed, step)
        resumed_opt.step()
    assert snapshot(resumed, resumed_opt) == snapshot(straight, straight_opt)


def test_a_state_without_its_masters_is_refused_and_nothing_loads() -> None:
    model = llama(BF16)
    opt = AdamW(model)
    fill_gradients(model, 0)
    opt.step()
    state = opt.state_dict()
    del state["master"]
    fresh = AdamW(llama(BF16))
    before = snapshot(fresh.model, fresh)
    with pytest.raises(ValueError, match="missing entry: master"):
        fresh.load_state_dict(state)
    assert snapshot(fresh.model, fresh) == before


# --------------------------------------------------------------------------------- GradScaler


def linear_model() -> Linear:
    lin = Linear("lin", LinearConfig(4, 3, bias=True), device="CPU")
    lin.build(BuildContext((2, 4), RuntimeMode.TRAINING))
    return lin


def test_grad_scaler_defaults_are_torchs() -> None:
    torch = pytest.importorskip("torch")
    ref = torch.amp.GradScaler("cpu")
    ours = GradScaler()
    assert ours.get_scale() == ref.get_scale() == 2.0**16
    assert ours.growth_factor == ref.get_growth_factor()
    assert ours.backoff_factor == ref.get_backoff_factor()
    assert ours.growth_interval == ref.get_growth_interval()


def test_grad_scaler_follows_torchs_scales_skips_and_unscaled_gradients() -> None:
    """One sequence of finite and non-finite gradients through both scalers: the same scale
    after every update, the same steps skipped, the same unscaled FP32 gradients."""
    torch = pytest.importorskip("torch")
    overflow = [0, 1, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]  # 1: inf, 2: NaN
    kwargs = {"init_scale": 1024.0, "growth_interval": 3}
    ref, ours = torch.amp.GradScaler("cpu", **kwargs), GradScaler(**kwargs)
    model = linear_model()
    opt = AdamW(model, lr=1e-2)
    names = [n for n, _ in model.named_gradients()]
    tensors = [torch.zeros(g.shape, dtype=torch.float32, requires_grad=True)
               for _, g in model.named_gradients()]  # fmt: skip
    ref_opt = torch.optim.SGD(tensors, lr=1.0)
    rng = np.random.default_rng(5)
    ref_scales, scales, ref_applied, applied = [], [], [], []
    for kind in overflow:
        # the scaled loss (torch makes its scale on the first call)
        assert float(ref.scale(torch.ones(()))) == ours.scale(1.0) == ours.get_scale()
        grads = {n: (rng.normal(size=g.shape) * ours.get_scale()).astype(np.float32)
                 for n, g in model.named_gradients()}  # fmt: skip
        if kind:
            grads[names[0]][0, 1] = np.inf if kind == 1 else np.nan
        for (n, g), t in zip(model.named_gradients(), tensors, strict=True):
            g[...] = grads[n]
            t.grad = torch.from_numpy(grads[n].copy())
        before = [t.detach().clone() for t in tensors]
        ref.unscale_(ref_opt)
        ours.unscale_(opt)
        for (_, g), t in zip(model.named_gradients(), tensors, strict=True):
            np.testing.assert_array_equal(g, t.grad.numpy())
        ref.step(ref_opt)
        ref.update()
        ref_applied.append(any(not torch.equal(b, t) for b, t in zip(before, tensors, strict=True)))
        ref_scales.append(ref.get_scale())
        applied.append(ours.step(opt))
        ours.update()
        scales.append(ours.get_scale())
    assert applied == ref_applied == [k == 0 for k in overflow]
    assert scales == ref_scales
    assert opt.skipped_steps == sum(1 for k in overflow if k)
    assert opt.step_count == overflow.count(0)
    assert ours.state_dict()["growth_tracker"] == ref.state_dict()["_growth_tracker"]


def test_an_overflowing_fp16_step_changes_nothing_but_the_scale_and_the_skip_count() -> None:
    model = llama(FP16)
    opt = AdamW(model, lr=1e-3)
    scaler = GradScaler()
    fill_gradients(model, 0)  # a good step first: moments and masters that are not trivial
    for _, g in model.named_gradients():
        g *= scaler.get_scale()
    assert scaler.step(opt)
    scaler.update()
    before = snapshot(model, opt)
    fill_gradients(model, 1)
    next(model.named_gradients())[1][0, 0] = np.inf
    assert not scaler.step(opt)
    scaler.update()
    assert snapshot(model, opt) == before
    assert (opt.step_count, opt.skipped_steps) == (1, 1)
    assert scaler.get_scale() == 2.0**15


def test_grad_scaler_refuses_misuse_and_bad_states() -> None:
    opt = AdamW(linear_model())
    with pytest.raises(ValueError, match=r"growth_factor must be > 1, got 1\.0"):
        GradScaler(growth_factor=1.0)
    with pytest.raises(ValueError, match="init_scale must be finite and > 0"):
        GradScaler(init_scale=math.inf)
    scaler = GradScaler()
    with pytest.raises(RuntimeError, match="update: no step"):
        scaler.update()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_: already called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step: already called"):
        scaler.step(opt)
    scaler.update()
    state = json.loads(json.dumps(scaler.state_dict()))
    other = GradScaler(init_scale=8.0)
    other.load_state_dict(state)
    assert other.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match="growth_tracker must be an int in"):
        other.load_state_dict({**state, "growth_tracker": 2000})
    assert other.state_dict() == scaler.state_dict()


def test_a_disabled_scaler_passes_everything_through() -> None:
    opt = AdamW(linear_model())
    scaler = GradScaler(enabled=False)
    grads = np.ones((2, 3), np.float32)
    assert scaler.scale(grads) is grads and scaler.get_scale() == 1.0
    assert scaler.step(opt) and opt.step_count == 1
    scaler.update()
    assert scaler.state_dict() == {}


# --------------------------------------------------------------------------- backward dlogits


@pytest.mark.parametrize("precision", [BF16, FP16])
def test_backward_takes_dlogits_in_the_models_precision_or_fp32(precision: Precision) -> None:
    """16-bit ``dlogits`` give the FP32 gradients of their FP32 values exactly; FP32 ``dlogits``
    the same up to the rounding of ``dlogits`` to 16 bits."""
    model = llama(precision)
    x = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, T))
    dlogits = np.random.default_rng(1).normal(0.0, 1e-2, (2, T, CFG.vocab_size))
    dlogits = dlogits.astype(np.float32)
    rounded = dlogits.astype(precision.numpy_dtype)

    def gradients(dy: np.ndarray) -> list[np.ndarray]:
        model.zero_gradients()
        model.forward(x)
        model.backward(dy)
        grads = [g.copy() for _, g in model.named_gradients()]
        assert all(g.dtype == np.float32 for g in grads)
        return grads

    from_16 = gradients(rounded)
    from_rounded_32 = gradients(rounded.astype(np.float32))
    from_32 = gradients(dlogits)
    for a, b, c in zip(from_16, from_rounded_32, from_32, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(c, a, rtol=0.05, atol=0.02 * float(np.abs(a).max()))


# ------------------------------------------------------------------------- saving in precision


def test_a_bf16_model_saved_as_fp32_and_an_fp32_model_as_bf16(tmp_path: Path) -> None:
    from safetensors import safe_open

    low = llama(BF16)
    save(low, tmp_path / "as32.safetensors", precision="fp32")
    with safe_open(tmp_path / "as32.safetensors", "numpy") as f:
        assert f.metadata()[PRECISION_KEY] == "FP32"
        for name, p in low.named_parameters():
            np.testing.assert_array_equal(f.get_tensor(name), p.astype(np.float32))

    high = llama(FP32)
    high.save(tmp_path / "as16.safetensors", precision=BF16)
    with safe_open(tmp_path / "as16.safetensors", "numpy") as f:
        assert f.metadata()[PRECISION_KEY] == "BF16"
        for name, p in high.named_parameters():
            stored = f.get_tensor(name)
            assert stored.dtype == ml_dtypes.bfloat16
            expected = p.astype(ml_dtypes.bfloat16).view(np.uint16)
            np.testing.assert_array_equal(stored.view(np.uint16), expected)

    # loading converts: the FP32 file into a BF16 model rounds, the BF16 file into FP32 is exact
    into_low, into_high = llama(BF16), llama(FP32)
    load(into_low, tmp_path / "as32.safetensors")
    load(into_high, tmp_path / "as16.safetensors")
    for (_, a), (_, b) in zip(into_low.named_parameters(), low.named_parameters(), strict=True):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    for (_, a), (_, b) in zip(into_high.named_parameters(), high.named_parameters(), strict=True):
        np.testing.assert_array_equal(a, b.astype(ml_dtypes.bfloat16).astype(np.float32))

    save(high, tmp_path / "plain.safetensors")
    with safe_open(tmp_path / "plain.safetensors", "numpy") as f:
        assert f.metadata()[PRECISION_KEY] == "FP32"


def test_save_refuses_an_unknown_precision_and_writes_nothing(tmp_path: Path) -> None:
    model = llama(FP32)
    with pytest.raises(ValueError, match=r"Llama 'llama'.*save\(precision=...\).*'fp8'"):
        save(model, tmp_path / "x.safetensors", precision="fp8")
    assert not (tmp_path / "x.safetensors").exists()


# -------------------------------------------------------------------------- training learns


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog; " * 60)
    return prepare_data(None, tmp_path / "data", [text])


def test_bf16_and_fp16_training_learn_as_fp32_does(data_dir: Path) -> None:
    """40 steps of train() from the same weights (lr 1e-2, batch 4): the held-out loss falls
    from 5.558 to 0.6015 in FP32, 0.6017 in BF16 (masters) and 0.6024 in FP16 (masters and
    the default loss scaler, no step skipped) as measured; each must land within 0.05 of
    FP32's and below a fifth of the initial loss."""
    init = [p.astype(np.float32) for _, p in llama(FP32, batch=4).named_parameters()]
    results = {}
    for precision in (FP32, BF16, FP16):
        model = llama(precision, batch=4, init=init)
        opt = AdamW(model, lr=1e-2)
        held_out = TokenDataset(data_dir, T, 4, seed=2)
        start = evaluate(model, held_out, 4)
        train(model, opt, TokenDataset(data_dir, T, 4, seed=1), steps=40, progress=False)
        results[precision] = (start, evaluate(model, held_out, 4))
    start, reference = results[FP32]
    assert reference < start / 5
    for precision in (BF16, FP16):
        assert results[precision][1] < start / 5
        assert abs(results[precision][1] - reference) < 0.05, (precision, results)


def test_train_scales_the_loss_of_fp16_models_only(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scaler="auto"`` makes a GradScaler for FP16 models, none for BF16 and FP32."""
    import mila_py.train

    made: list[GradScaler] = []

    class Recorded(GradScaler):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(mila_py.train, "GradScaler", Recorded)
    for precision in (FP32, BF16, FP16):
        model = llama(precision, batch=4)
        train(model, AdamW(model, lr=1e-3), TokenDataset(data_dir, T, 4, seed=1), steps=2,
              progress=False)  # fmt: skip
        assert len(made) == (precision is FP16)
    assert made[0]._growth_tracker == 2  # it drove both steps


def test_train_skips_an_overflowing_step_and_checkpoints_the_scaler(
    data_dir: Path, tmp_path: Path
) -> None:
    """A scale of 2**100 overflows FP16's dlogits: the first step is skipped and the scale
    backs off; the scaler's state is saved with the checkpoint and restored."""
    model = llama(FP16, batch=4)
    opt = AdamW(model, lr=1e-3)
    scaler = GradScaler(init_scale=2.0**100)
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the point
        records = train(model, opt, TokenDataset(data_dir, T, 4, seed=1), steps=2,
                        progress=False, scaler=scaler, checkpoint_dir=tmp_path / "ckpt")  # fmt: skip
    assert records[0].get("skipped") is True and opt.skipped_steps >= 1
    assert scaler.get_scale() < 2.0**100
    other = llama(FP16, batch=4)
    restored = GradScaler(init_scale=1.0)
    load_checkpoint(tmp_path / "ckpt", other, AdamW(other), scaler=restored)
    assert restored.state_dict() == scaler.state_dict()


# ----------------------------------------------------------------- the CUDA kernel


@pytest.mark.parametrize("precision", [BF16, FP16])
def test_the_cuda_master_kernel_is_the_array_code(cuda_device: str, precision: Precision) -> None:
    """CUDA AdamW over a 16-bit layer runs ``adamw_master_step<T>`` (one launch per
    parameter): masters, moments and 16-bit weights equal the CPU's array code, bit for bit on
    the emulator (on a GPU: the float32 arrays to 1e-6, the 16-bit weights to one of their
    roundings, where a master one float32 rounding off may round the other way)."""
    skip_bf16_without_arrays(cuda_device, precision)
    layers = []
    for device in ("CPU", cuda_device):
        manual_seed(0)
        layer = Linear("lin", LinearConfig(9, 5, bias=True), device=device, precision=precision)
        layer.build(BuildContext((2, 9), RuntimeMode.TRAINING))
        layers.append(layer)
    cpu, gpu = layers
    for (_, p), (_, q) in zip(cpu.named_parameters(), gpu.named_parameters(), strict=True):
        q[...] = dev(p)
    cpu_opt, gpu_opt = AdamW(cpu, lr=3e-3), AdamW(gpu, lr=3e-3)
    assert cpu_opt._fused is None and gpu_opt._fused is not None
    for step in range(3):
        fill_gradients(cpu, step)
        for (_, g), (_, h) in zip(cpu.named_gradients(), gpu.named_gradients(), strict=True):
            h[...] = dev(g)
        cpu_opt.step()
        gpu_opt.step()
    ctx = gpu.execution_context
    params = [
        (p, q)
        for (_, p), (_, q) in zip(cpu.named_parameters(), gpu.named_parameters(), strict=True)
    ]
    state = list(
        zip(
            cpu_opt._master + cpu_opt._m + cpu_opt._v,
            gpu_opt._master + gpu_opt._m + gpu_opt._v,
            strict=True,
        )
    )
    assert len(params) == 2 and len(state) == 6
    for ref, mine in [*params, *state]:
        got = host(mine)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        if EMULATED:
            assert got.tobytes() == ref.tobytes()
        else:
            rtol = 1e-6 if ref.dtype == np.float32 else 2.0 ** -(8 if precision is BF16 else 10)
            np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=rtol)
    if EMULATED:
        name = f"adamw_master_step<{'mila_bf16' if precision is BF16 else 'mila_half'}>"
        assert ctx.launches == [name] * 6


def test_save_hf_checkpoint_writes_the_precision_asked_for(tmp_path: Path) -> None:
    from safetensors import safe_open

    from mila_py.interop.hf import save_hf_checkpoint

    model = llama(FP32)
    save_hf_checkpoint(model, tmp_path / "hf", precision="bf16")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    with safe_open(tmp_path / "hf" / "model.safetensors", "numpy") as f:
        head = f.get_tensor("model.norm.weight")
    assert head.dtype == ml_dtypes.bfloat16
    norm = dict(model.named_parameters())["norm.weight"]
    np.testing.assert_array_equal(head.view(np.uint16), norm.astype(head.dtype).view(np.uint16))
    with pytest.raises(ValueError, match="save_hf_checkpoint: precision"):
        save_hf_checkpoint(model, tmp_path / "other", precision="int4")
    assert not (tmp_path / "other").exists()
