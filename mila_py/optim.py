"""Optimizers over a component's parameters and gradients, gradient clipping, and dynamic loss
scaling for FP16 training (:class:`GradScaler`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from mila_py.component import Component
from mila_py.memory import MemoryCategory, MemoryStats
from mila_py.ops.registry import create_op, is_supported

__all__ = [
    "AdamW",
    "ConstantSchedule",
    "CosineSchedule",
    "GradScaler",
    "LinearSchedule",
    "clip_grad_norm",
]


def _pairs(model: Component) -> list[tuple[str, Any, Any]]:
    if not isinstance(model, Component):  # torch's habit: AdamW(model.parameters())
        raise TypeError(
            f"expected the model (a built Component), got {type(model).__name__}: pass the "
            "model itself, not its parameters (its gradients are paired with them)"
        )
    pairs = list(model.named_parameter_gradients())
    if not pairs:
        raise RuntimeError(
            f"{model._describe()} has no parameter gradients: build it with RuntimeMode.TRAINING"
        )
    return pairs


def _default_decay(name: str, param: Any) -> bool:
    # Matrices decay; vectors (norm weights, biases) do not, as in most LLM training recipes.
    return param.ndim >= 2


def _hyperparameters(
    lr: Any, betas: Any, eps: Any, weight_decay: Any, *, zero_lr: bool = False
) -> tuple[float, float, float, float, float]:
    """``(lr, beta1, beta2, eps, weight_decay)`` as Python floats.

    Args:
        zero_lr: accept ``lr == 0`` (a schedule's rate between steps; the rate given at
            construction must be > 0).

    Raises:
        ValueError: one is not a real number, ``betas`` is not a pair, or a value is out of
            range (``0 < lr < inf``, or ``0 <= lr`` with ``zero_lr``; ``0 <= beta < 1``,
            ``0 < eps < inf``, ``0 <= weight_decay < inf``); the message names it.
    """
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"AdamW: betas must be a pair (beta1, beta2), got {betas!r}") from None
    named = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    values = {}
    for name, value in named.items():
        try:
            if isinstance(value, bool | str | bytes):
                raise TypeError
            values[name] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"AdamW: {name} must be a real number, got {value!r}") from None
    lr, beta1, beta2, eps, weight_decay = values.values()
    # written so that NaN fails every test
    if zero_lr and not 0 <= lr < math.inf:
        raise ValueError(f"AdamW: lr must be finite and >= 0, got {named['lr']!r}")
    if not zero_lr and not 0 < lr < math.inf:
        raise ValueError(f"AdamW: lr must be finite and > 0, got {named['lr']!r}")
    for name in ("beta1", "beta2"):
        if not 0 <= values[name] < 1:
            raise ValueError(f"AdamW: {name} must be in [0, 1), got {named[name]!r}")
    if not 0 < eps < math.inf:
        raise ValueError(f"AdamW: eps must be finite and > 0, got {named['eps']!r}")
    if not 0 <= weight_decay < math.inf:
        raise ValueError(
            f"AdamW: weight_decay must be finite and >= 0, got {named['weight_decay']!r}"
        )
    return lr, beta1, beta2, eps, weight_decay


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter) and bias correction.

    ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)`` for parameters that decay.

    Args:
        model: a built TRAINING component (its parameters and gradients are walked once).
        lr: learning rate, > 0 (may be changed between steps through ``opt.lr``, where 0 is
            allowed: a schedule's warmup starts at 0; such a step moves no parameter but
            advances the moments and the step count, as torch's does).
        betas: moment decay rates; eps: denominator guard.
        weight_decay: decoupled decay factor.
        decay: ``(name, param) -> bool`` choosing which parameters decay (default: ndim >= 2).
        skip_nonfinite: check the gradients before each step and skip a step whose gradients
            hold NaN or inf (the overflow steps of FP16 loss scaling): it leaves the parameters,
            the moments and ``step_count`` exactly as they were, returns False from
            :meth:`step` and counts in ``skipped_steps``. Costs one pass over the gradients
            and one device-to-host readback per step. Off by default: such a step then writes
            NaN into the parameters and moments for good.

    Attributes:
        step_count: the steps applied. skipped_steps: the steps skipped (``skip_nonfinite``,
            or a training loop that found the gradients' norm not finite).

    :meth:`state_dict` and :meth:`load_state_dict` save and restore the moments, the step
    counts and the hyper-parameters (and the master weights), so that a resumed run continues
    bit for bit.

    Mixed precision: for each 16-bit parameter (a BF16 or FP16 model) the optimizer keeps an
    FP32 master copy and FP32 moments. A step updates the master in FP32 from the FP32
    gradients (the same arithmetic as for an FP32 parameter) and writes it, rounded to nearest
    even, into the 16-bit parameter: updates far below the parameter's last bit add up in the
    master instead of rounding away. That is 12 bytes of state per parameter (master, m, v),
    counted by :meth:`get_memory_stats`. FP32 and FP64 parameters have no master copy and
    their moments have their dtype.

    The masters are copied from the parameters when the optimizer is made, as a torch
    optimizer takes its parameters then: weights loaded into the model later (``load``) are
    overwritten by the next step's masters. Make the optimizer after loading the weights, or
    call :meth:`sync_master_weights` (or :meth:`load_state_dict` of a saved state, which
    restores the masters).
    """

    def __init__(
        self,
        model: Component,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        decay: Callable[[str, Any], bool] = _default_decay,
        skip_nonfinite: bool = False,
    ) -> None:
        _hyperparameters(lr, betas, eps, weight_decay)
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"AdamW: skip_nonfinite must be a bool, got {skip_nonfinite!r}")
        self.model = model
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self._pairs = _pairs(model)
        xp = model.execution_context.xp
        with model.execution_context.activate():  # on the parameters' device
            # None for a parameter updated in its own dtype (FP32, FP64)
            self._master: list[Any] = [
                p.astype(np.float32) if _is_16_bit(p) else None for _, p, _ in self._pairs
            ]
            self._m = [
                xp.zeros_like(p if w is None else w)
                for (_, p, _), w in zip(self._pairs, self._master, strict=True)
            ]
            self._v = [xp.zeros_like(m) for m in self._m]
        self._decays = [decay(name, p) for name, p, _ in self._pairs]
        self.step_count = 0
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0
        # A device with a fused update kernel (CUDA) runs it per parameter; the array code
        # below is the reference and the CPU path.
        ctx = model.execution_context
        self._fused: Any = None
        if is_supported("AdamWOp", ctx.device_type, model.precision):
            self._fused = create_op("AdamWOp", ctx, None, model.precision)

    def step(self) -> bool:
        """One update from the current gradients (they are left as they are).

        Returns:
            True when the update was applied; False when ``skip_nonfinite`` found a NaN or inf
            gradient and skipped it (nothing changed but ``skipped_steps``).

        Raises:
            ValueError: a hyper-parameter (``lr``, ``betas``, ``eps``, ``weight_decay``, which
                may be changed between steps) is not valid; nothing changes, the step count
                included.
        """
        # checked (and made Python floats) before the step counts: a refused step changes nothing.
        # Python floats: NumPy rounds them to the parameters' dtype in every operation, as the
        # fused kernels do (a np.float64 lr from a schedule would make the array code compute
        # in float64 and round once, and the two paths would differ in the last bit)
        lr, beta1, beta2, eps, weight_decay = _hyperparameters(
            self.lr, self.betas, self.eps, self.weight_decay, zero_lr=True
        )
        ctx = self.model.execution_context
        with ctx.activate():  # the model's device and stream, for the array code too
            if self.skip_nonfinite and not self._gradients_finite(ctx.xp):
                self.skipped_steps += 1
                return False
            self.step_count += 1
            correction1 = 1.0 - beta1**self.step_count
            correction2 = 1.0 - beta2**self.step_count
            self._update(ctx.xp, lr, beta1, beta2, eps, weight_decay, correction1, correction2)
        return True

    def _gradients_finite(self, xp: Any) -> bool:
        """Whether every gradient is finite: one flag per gradient on the device, one readback."""
        flags = [_finite(xp, g) for _, _, g in self._pairs]
        return bool(xp.stack(flags).all())

    def _update(
        self,
        xp: Any,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        correction1: float,
        correction2: float,
    ) -> None:
        step_size = lr / correction1
        fused = self._fused
        for (_, p, g), master, m, v, decays in zip(
            self._pairs, self._master, self._m, self._v, self._decays, strict=True
        ):
            if fused is not None and fused.accepts(p, g, m, v, master):
                factor = 1.0 - lr * weight_decay if decays and weight_decay else None
                fused.step(
                    p, g, m, v, decay=factor, betas=(beta1, beta2), correction2=correction2,
                    eps=eps, step_size=step_size, master=master,
                )  # fmt: skip
                continue
            # the weights updated: the parameter itself, or its FP32 master copy
            w = p if master is None else master
            if decays and weight_decay:
                w *= 1.0 - lr * weight_decay
            m *= beta1
            m += (1.0 - beta1) * g
            v *= beta2
            v += (1.0 - beta2) * g * g  # scaled, then squared, as torch: no early overflow
            denom = xp.sqrt(v)  # sqrt first, then the correction, as torch: v / c2 overflows first
            denom /= math.sqrt(correction2)
            denom += eps
            w -= step_size * (m / denom)
            if master is not None:
                p[...] = master.astype(p.dtype)  # rounded to nearest even

    def zero_grad(self) -> None:
        self.model.zero_gradients()

    def sync_master_weights(self) -> None:
        """Copy the model's 16-bit parameters into their FP32 master copies (exact: every
        16-bit value is a float32), after weights were loaded into the model behind the
        optimizer's back. The moments and step counts are left as they are. Nothing to do for
        FP32 parameters, which have no master copy."""
        ctx = self.model.execution_context
        with ctx.activate():
            for (_, p, _), master in zip(self._pairs, self._master, strict=True):
                if master is not None:
                    master[...] = p.astype(np.float32)

    def get_memory_stats(self) -> MemoryStats:
        """The optimizer's own state (the two moments, and the FP32 master copies of 16-bit
        parameters) as host/device state bytes."""
        loc = self.model._location_of
        masters = [w for w in self._master if w is not None]
        return MemoryStats.from_arrays(
            (MemoryCategory.STATE, loc(a), a) for a in (*masters, *self._m, *self._v)
        )

    def _describe(self) -> str:
        return f"AdamW over {self.model._describe()}"

    def _names(self) -> list[str]:
        """The parameters' dotted names, in order, each once."""
        names = [name for name, _, _ in self._pairs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"{self._describe()}: several parameters are named {twice} (a child name with "
                "dots spells another child's path); their state cannot be named apart"
            )
        return names

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's whole state, to resume it: a new dict of host copies.

        Returns:
            ``{"step_count": int, "skipped_steps": int, "hyperparameters": {"lr", "betas",
            "eps", "weight_decay", "skip_nonfinite"}, "decay": {name: bool},
            "exp_avg": {name: np.ndarray}, "exp_avg_sq": {name: np.ndarray}}``, and
            ``"master": {name: np.ndarray}`` (float32) for the 16-bit parameters where there
            are any; each array has its parameter's shape and the moments' (or masters')
            dtype, and is a NumPy copy that later steps do not change.

        Raises:
            ValueError: two parameters share a dotted name.
        """
        names = self._names()
        ctx = self.model.execution_context
        with ctx.activate():
            exp_avg = {n: ctx.to_host(m) for n, m in zip(names, self._m, strict=True)}
            exp_avg_sq = {n: ctx.to_host(v) for n, v in zip(names, self._v, strict=True)}
            master = {
                n: ctx.to_host(w) for n, w in zip(names, self._master, strict=True) if w is not None
            }
        beta1, beta2 = self.betas
        masters = {"master": master} if master else {}
        return {
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
            "hyperparameters": {
                "lr": float(self.lr),
                "betas": [float(beta1), float(beta2)],
                "eps": float(self.eps),
                "weight_decay": float(self.weight_decay),
                "skip_nonfinite": self.skip_nonfinite,
            },
            "decay": {n: bool(d) for n, d in zip(names, self._decays, strict=True)},
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
            **masters,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`: the moments, master weights, step counts and
        hyper-parameters (the saved ones replace those given at construction, as torch's
        optimizers do). The model's parameters are not touched: load them from the same
        checkpoint.

        Every problem is listed in one error and then nothing has changed: a missing or
        unexpected parameter name, a moment of another shape or dtype or that is not a NumPy
        array, a parameter that decays in one and not the other, a count or hyper-parameter
        out of range.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: ``"AdamW over <model>: cannot load the state; nothing was loaded"``,
                then each problem naming its entry.
        """
        parsed = self._parse_state(state)
        self._apply_state(parsed)

    def _parse_state(self, state: Any) -> dict[str, Any]:
        """``state`` checked in full (see :meth:`load_state_dict`), without changing anything."""
        who = self._describe()
        if not isinstance(state, Mapping):
            raise TypeError(f"{who}: load_state_dict expects a mapping, got {type(state).__name__}")
        problems: list[str] = []
        keys: tuple[str, ...] = (
            "step_count", "skipped_steps", "hyperparameters", "decay", "exp_avg", "exp_avg_sq",
        )  # fmt: skip
        if self._has_masters():
            keys += ("master",)
        problems += [f"missing entry: {key}" for key in keys if key not in state]
        problems += [f"unexpected entry: {key}" for key in state if key not in keys]
        counts = {}
        for key in ("step_count", "skipped_steps"):
            value = state.get(key)
            if key in state and not (_is_count(value)):
                problems.append(f"{key}: expected an int >= 0, got {value!r}")
            counts[key] = value
        hyper: tuple[float, float, float, float, float] | None = None
        skip = self.skip_nonfinite
        found = state.get("hyperparameters")
        if "hyperparameters" in state:
            expected = {"lr", "betas", "eps", "weight_decay", "skip_nonfinite"}
            if not isinstance(found, Mapping) or set(found) != expected:
                got = sorted(found) if isinstance(found, Mapping) else repr(found)
                problems.append(f"hyperparameters: expected the keys {sorted(expected)}, got {got}")
            else:
                try:
                    hyper = _hyperparameters(
                        found["lr"], found["betas"], found["eps"], found["weight_decay"],
                        zero_lr=True,
                    )  # fmt: skip
                except ValueError as exc:
                    problems.append(f"hyperparameters: {exc}")
                skip = found["skip_nonfinite"]
                if not isinstance(skip, bool):
                    problems.append(
                        f"hyperparameters.skip_nonfinite: expected a bool, got {skip!r}"
                    )
        names = self._names()
        decays = state.get("decay")
        if "decay" in state:
            if not isinstance(decays, Mapping):
                problems.append(f"decay: expected a mapping of names to bools, got {decays!r}")
            else:
                problems += _name_problems("decay", decays, names)
                for name, mine in zip(names, self._decays, strict=True):
                    if name in decays and decays[name] is not bool(mine):
                        problems.append(
                            f"decay of {name}: saved {decays[name]!r}, this optimizer {mine!r} "
                            "(its decay rule differs)"
                        )
        moments = {}
        for key, live_names, live in self._state_arrays(names):
            arrays = state.get(key)
            if key not in state:
                continue
            if not isinstance(arrays, Mapping):
                problems.append(f"{key}: expected a mapping of names to arrays, got {arrays!r}")
                continue
            problems += _name_problems(key, arrays, live_names)
            for name, mine in zip(live_names, live, strict=True):
                array = arrays.get(name)
                if name not in arrays:
                    continue
                if not isinstance(array, np.ndarray):
                    problems.append(
                        f"{key}.{name}: expected a NumPy array, got {type(array).__name__}"
                    )
                elif array.shape != tuple(mine.shape):
                    problems.append(
                        f"{key}.{name}: shape {array.shape}, expected {tuple(mine.shape)}"
                    )
                elif array.dtype != mine.dtype:
                    problems.append(f"{key}.{name}: dtype {array.dtype}, expected {mine.dtype}")
            moments[key] = arrays
        if problems:
            raise ValueError(
                f"{who}: cannot load the state; nothing was loaded:\n  " + "\n  ".join(problems)
            )
        assert hyper is not None
        return {"counts": counts, "hyper": hyper, "skip": skip, "moments": moments}

    def _has_masters(self) -> bool:
        return any(w is not None for w in self._master)

    def _state_arrays(self, names: list[str]) -> list[tuple[str, list[str], list[Any]]]:
        """``(key, names, arrays)`` of each saved family of arrays: the moments of every
        parameter, the masters of the 16-bit ones (where there are any)."""
        families = [("exp_avg", names, self._m), ("exp_avg_sq", names, self._v)]
        if self._has_masters():
            kept = [(n, w) for n, w in zip(names, self._master, strict=True) if w is not None]
            families.append(("master", [n for n, _ in kept], [w for _, w in kept]))
        return families

    def _apply_state(self, parsed: dict[str, Any]) -> None:
        """Set what :meth:`_parse_state` checked (nothing here can fail on valid input)."""
        names = self._names()
        ctx = self.model.execution_context
        moments = parsed["moments"]
        with ctx.activate():
            for key, live_names, live in self._state_arrays(names):
                for name, mine in zip(live_names, live, strict=True):
                    array = moments[key][name]
                    mine[...] = array if isinstance(mine, np.ndarray) else ctx.to_device(array)
        lr, beta1, beta2, eps, weight_decay = parsed["hyper"]
        self.lr, self.betas, self.eps, self.weight_decay = lr, (beta1, beta2), eps, weight_decay
        self.skip_nonfinite = parsed["skip"]
        self.step_count = int(parsed["counts"]["step_count"])
        self.skipped_steps = int(parsed["counts"]["skipped_steps"])


def _is_count(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool) and bool(value >= 0)


def _name_problems(what: str, found: Mapping[str, Any], names: list[str]) -> list[str]:
    """Missing and unexpected parameter names of ``found``."""
    known = set(names)
    problems = [f"{what}: missing parameter {n}" for n in names if n not in found]
    problems += [f"{what}: unexpected parameter {n}" for n in found if n not in known]
    return problems


#: the parameter dtypes that get an FP32 master copy in AdamW
_16_BIT = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _is_16_bit(array: Any) -> bool:
    return np.dtype(array.dtype) in _16_BIT


def _finite(xp: Any, array: Any) -> Any:
    """Whether every element of ``array`` is finite, as a device scalar. A ``uint16`` array
    holds bfloat16 bits (a CuPy without bfloat16): finite unless its exponent bits are all
    ones."""
    if array.dtype == "uint16":
        return ((array & 0x7F80) != 0x7F80).all()
    return xp.isfinite(array).all()


def clip_grad_norm(model: Component, max_norm: float, *, error_if_nonfinite: bool = False) -> float:
    """Scale every gradient so their global L2 norm is at most ``max_norm``; returns the norm
    before clipping.

    A non-finite norm (an ``inf`` or NaN gradient) is returned with every gradient left as it
    is, so the caller can skip the step (an AdamW step on it would write NaN into the
    parameters and moments for good); ``error_if_nonfinite=True`` raises instead, as torch's
    ``clip_grad_norm_`` does.

    Raises:
        ValueError: ``max_norm`` is not a number > 0 (nothing is touched); ``inf`` returns the
            norm without clipping. A non-finite norm with ``error_if_nonfinite``.
        RuntimeError: ``model`` has no parameter gradients (not a TRAINING build).
    """
    try:
        if isinstance(max_norm, bool | str | bytes):
            raise TypeError
        limit = float(max_norm)
    except (TypeError, ValueError):
        limit = math.nan
    if not limit > 0:  # NaN, zero, negative, or not a number; inf measures without clipping
        raise ValueError(f"clip_grad_norm: max_norm must be a number > 0, got {max_norm!r}")
    grads = [g for _, _, g in _pairs(model)]
    with model.execution_context.activate():  # the model's device and stream
        # One device-to-host transfer: the per-gradient sums stay on the device until float().
        total = math.sqrt(float(sum((g.astype("float64") ** 2).sum() for g in grads)))
        if not math.isfinite(total):
            if error_if_nonfinite:
                raise ValueError(
                    f"clip_grad_norm: the gradients' norm is {total} (an inf or NaN "
                    "gradient); nothing was clipped"
                )
            return total
        if total > limit:
            scale = limit / (total + 1e-6)
            for g in grads:
                g *= scale
    return total


class GradScaler:
    """Dynamic loss scaling for FP16 training, as ``torch.amp.GradScaler``.

    FP16's smallest normal value is ``6.1e-5``: small activation gradients of an FP16 network
    underflow to zero. The scaler multiplies the loss gradient by ``scale`` before backward,
    so every gradient of the network is ``scale`` times larger, then divides the FP32
    parameter gradients by ``scale`` before the optimizer step. A step whose gradients
    overflowed (inf or NaN) is skipped and the scale halved; after ``growth_interval`` good
    steps in a row the scale doubles. One step::

        dlogits = loss_fn.backward(scaler.scale(1.0))
        model.backward(dlogits)
        scaler.unscale_(optimizer)        # optional: only to clip the true gradients
        clip_grad_norm(model, 1.0)
        scaler.step(optimizer)            # skipped on inf/NaN
        scaler.update()
        model.zero_gradients()

    BF16 has FP32's range and needs no scaling; :func:`mila_py.train.train` makes a scaler for
    FP16 models only.

    Args:
        init_scale: the first scale (> 0, finite).
        growth_factor: the factor applied after ``growth_interval`` good steps (> 1).
        backoff_factor: the factor applied after a step with inf/NaN gradients (in (0, 1)).
        growth_interval: good steps in a row before the scale grows (int >= 1).
        enabled: False makes every method a pass-through (``scale`` returns its argument,
            ``step`` calls ``optimizer.step()``), so one loop serves every precision.

    Raises:
        ValueError: an argument out of range, naming it.

    The scale is a float32 value (as torch keeps it); :meth:`state_dict` and
    :meth:`load_state_dict` save and restore it with the count of good steps.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"GradScaler: enabled must be a bool, got {enabled!r}")
        _check_scaler(
            init_scale, growth_factor, backoff_factor, growth_interval, "GradScaler:", "init_scale"
        )
        self.enabled = enabled
        self._scale = float(np.float32(init_scale))
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._growth_tracker = 0
        # this step's inf/NaN finding: None until unscale_ (or step) looked at the gradients
        self._found_inf: bool | None = None
        self._stepped = False

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale(self, value: Any) -> Any:
        """``value * scale``: the loss gradient handed to the loss's backward (a number), or
        ``dlogits`` (an array, keeping its dtype). ``value`` itself when disabled."""
        if not self.enabled:
            return value
        return value * self._scale

    def unscale_(self, optimizer: AdamW) -> None:
        """Divide the model's gradients by the scale in place (multiplied by the float32
        ``1 / scale``, as torch does) and record whether any is inf or NaN. Call it before
        clipping; :meth:`step` calls it where it was not called.

        Raises:
            RuntimeError: called twice in one step (before :meth:`update`).
        """
        if not self.enabled:
            return
        if self._found_inf is not None:
            raise RuntimeError(
                "GradScaler.unscale_: already called since the last update(); call it once "
                "per optimizer step"
            )
        ctx = optimizer.model.execution_context
        inverse = float(np.float32(1.0 / self._scale))
        with ctx.activate():
            # checked before the division, as torch does (a finite value stays finite)
            finite = optimizer._gradients_finite(ctx.xp)
            for _, _, g in optimizer._pairs:
                g *= inverse
        self._found_inf = not finite

    def step(self, optimizer: AdamW) -> bool:
        """Unscale the gradients (unless :meth:`unscale_` did) and step the optimizer, unless
        they hold inf or NaN: then the step is skipped (the parameters, masters, moments and
        ``optimizer.step_count`` stay as they are) and counted in ``optimizer.skipped_steps``.

        Returns:
            True when the optimizer stepped.

        Raises:
            RuntimeError: called twice in one step (before :meth:`update`).
        """
        if not self.enabled:
            return optimizer.step()
        if self._stepped:
            raise RuntimeError(
                "GradScaler.step: already called since the last update(); call update() "
                "after each step"
            )
        if self._found_inf is None:
            self.unscale_(optimizer)
        self._stepped = True
        if self._found_inf:
            optimizer.skipped_steps += 1
            return False
        return optimizer.step()

    def update(self) -> None:
        """End the step: back off after inf/NaN gradients, else count a good step and grow the
        scale after ``growth_interval`` of them (a growth that would overflow float32 is
        dropped, as torch does).

        Raises:
            RuntimeError: no :meth:`unscale_` or :meth:`step` since the last update.
        """
        if not self.enabled:
            return
        if self._found_inf is None:
            raise RuntimeError(
                "GradScaler.update: no step since the last update(); call step(optimizer) first"
            )
        if self._found_inf:
            self._scale = float(np.float32(self._scale * self.backoff_factor))
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = self._scale * self.growth_factor
                if math.isfinite(grown) and math.isfinite(np.float32(grown)):
                    self._scale = float(np.float32(grown))
                self._growth_tracker = 0
        self._found_inf = None
        self._stepped = False

    def state_dict(self) -> dict[str, Any]:
        """``{"scale", "growth_factor", "backoff_factor", "growth_interval",
        "growth_tracker"}`` (JSON-able; torch's keys, its ``_growth_tracker`` without the
        underscore); empty when disabled, as torch's."""
        if not self.enabled:
            return {}
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (its values replace those given at construction).

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: an empty state (saved disabled) into an enabled scaler, other entries,
                or a value out of range; nothing has changed then.
        """
        self._apply_state(self._parse_state(state))

    def _parse_state(self, state: Any) -> dict[str, Any]:
        who = "GradScaler"
        if not isinstance(state, Mapping):
            raise TypeError(f"{who}: load_state_dict expects a mapping, got {type(state).__name__}")
        keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "growth_tracker"}
        if set(state) != keys:
            raise ValueError(
                f"{who}: cannot load the state: expected the entries {sorted(keys)}, got "
                f"{sorted(state)}" + (" (saved from a disabled scaler)" if not state else "")
            )
        _check_scaler(
            state["scale"], state["growth_factor"], state["backoff_factor"],
            state["growth_interval"], f"{who}: cannot load the state:", "scale",
        )  # fmt: skip
        tracker = state["growth_tracker"]
        if not _is_count(tracker) or tracker >= state["growth_interval"]:
            raise ValueError(
                f"{who}: cannot load the state: growth_tracker must be an int in [0, "
                f"growth_interval), got {tracker!r}"
            )
        return dict(state)

    def _apply_state(self, state: dict[str, Any]) -> None:
        self._scale = float(np.float32(state["scale"]))
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["growth_tracker"])

    def __repr__(self) -> str:
        return (
            f"GradScaler(scale={self.get_scale()}, growth_tracker={self._growth_tracker}, "
            f"enabled={self.enabled})"
        )


def _check_scaler(
    scale: Any, growth: Any, backoff: Any, interval: Any, who: str, scale_name: str
) -> None:
    """Raise ValueError for a GradScaler argument out of range, naming it."""
    checks = (
        (scale_name, scale, _is_real(scale) and 0 < float(scale) < math.inf, "finite and > 0"),
        ("growth_factor", growth, _is_real(growth) and 1 < float(growth) < math.inf, "> 1"),
        ("backoff_factor", backoff, _is_real(backoff) and 0 < float(backoff) < 1, "in (0, 1)"),
        ("growth_interval", interval, _is_count(interval) and interval >= 1, "an int >= 1"),
    )
    for name, value, ok, expected in checks:
        if not ok:
            raise ValueError(f"{who} {name} must be {expected}, got {value!r}")


class _Schedule:
    """A learning-rate schedule with state: ``optimizer.lr = base_lr * factor(step)``.

    The rate given to the optimizer at construction is the base (peak) rate. Construction
    sets ``optimizer.lr`` for the first step (step 0); each :meth:`step`, called after the
    optimizer's step, sets it for the next one, as torch's ``LambdaLR`` does.

    Attributes:
        optimizer: anything with a settable ``lr`` (an :class:`AdamW`).
        base_lr: the rate the factor scales. step_count: the :meth:`step` calls so far (the
            index of the optimizer step the current rate is for).
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_lr: float = 0.0,
    ) -> None:
        who = type(self).__name__
        base_lr: Any = getattr(optimizer, "lr", None)
        if not _is_real(base_lr) or not 0 < float(base_lr) < math.inf:
            raise ValueError(
                f"{who}: the optimizer's lr is the base rate and must be a finite number > 0, "
                f"got {base_lr!r} (is another schedule driving it already?)"
            )
        self._check(float(base_lr), warmup_steps, total_steps, min_lr)
        self.optimizer = optimizer
        self.base_lr = float(base_lr)
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr = float(min_lr)
        self.step_count = 0
        optimizer.lr = self.lr

    def _check(self, base_lr: float, warmup: Any, total: Any, min_lr: Any) -> None:
        who = type(self).__name__
        if not _is_count(warmup):
            raise ValueError(f"{who}: warmup_steps must be an int >= 0, got {warmup!r}")
        if total is not None:
            if not _is_count(total) or total < 1:
                raise ValueError(f"{who}: total_steps must be an int >= 1, got {total!r}")
            if warmup > total:
                raise ValueError(f"{who}: warmup_steps ({warmup}) must be <= total_steps ({total})")
        if not _is_real(min_lr) or not 0 <= float(min_lr) <= base_lr:
            raise ValueError(
                f"{who}: min_lr must be a number in [0, base lr {base_lr}], got {min_lr!r}"
            )

    def _factor(self, step: int) -> float:
        raise NotImplementedError

    def _warmup(self, step: int) -> float | None:
        """The warmup factor (``step / warmup_steps``, from 0), or None after the warmup."""
        if step < self.warmup_steps:
            return float(step) / float(max(1, self.warmup_steps))
        return None

    @property
    def lr(self) -> float:
        """The rate of the optimizer step with index :attr:`step_count`."""
        return self.base_lr * self._factor(self.step_count)

    def step(self) -> None:
        """Advance one step and set ``optimizer.lr`` to the next step's rate."""
        self.step_count += 1
        self.optimizer.lr = self.lr

    def state_dict(self) -> dict[str, Any]:
        """``{"type", "base_lr", "warmup_steps", "total_steps", "min_lr", "step_count"}``."""
        return {
            "type": type(self).__name__,
            "base_lr": self.base_lr,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "min_lr": self.min_lr,
            "step_count": self.step_count,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a saved schedule: its step, base rate and shape replace this one's, and
        ``optimizer.lr`` is set to its current rate.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: a schedule of another type, a missing or unexpected entry, or a value
                out of range (naming it); nothing has changed then.
        """
        self._apply_state(self._parse_state(state))

    def _parse_state(self, state: Any) -> dict[str, Any]:
        who = type(self).__name__
        if not isinstance(state, Mapping):
            raise TypeError(f"{who}: load_state_dict expects a mapping, got {type(state).__name__}")
        keys = set(self.state_dict())
        if set(state) != keys:
            raise ValueError(
                f"{who}: cannot load the state: expected the entries {sorted(keys)}, got "
                f"{sorted(state)}"
            )
        if state["type"] != who:
            raise ValueError(f"{who}: cannot load the state of a {state['type']!r}")
        base_lr = state["base_lr"]
        if not _is_real(base_lr) or not 0 < float(base_lr) < math.inf:
            raise ValueError(f"{who}: cannot load the state: base_lr {base_lr!r} is not > 0")
        if self.total_steps is None and state["total_steps"] is not None:
            raise ValueError(f"{who}: cannot load the state: total_steps {state['total_steps']!r}")
        try:
            self._check(
                float(base_lr), state["warmup_steps"], state["total_steps"], state["min_lr"]
            )
        except ValueError as exc:
            raise ValueError(f"{who}: cannot load the state: {exc}") from None
        if not _is_count(state["step_count"]):
            raise ValueError(
                f"{who}: cannot load the state: step_count must be an int >= 0, got "
                f"{state['step_count']!r}"
            )
        return dict(state)

    def _apply_state(self, state: dict[str, Any]) -> None:
        self.base_lr = float(state["base_lr"])
        self.warmup_steps = int(state["warmup_steps"])
        total = state["total_steps"]
        self.total_steps = None if total is None else int(total)
        self.min_lr = float(state["min_lr"])
        self.step_count = int(state["step_count"])
        self.optimizer.lr = self.lr

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(base_lr={self.base_lr}, warmup_steps={self.warmup_steps}, "
            f"total_steps={self.total_steps}, min_lr={self.min_lr}, step_count="
            f"{self.step_count}, lr={self.lr})"
        )


class ConstantSchedule(_Schedule):
    """A linear warmup from 0 over ``warmup_steps``, then the base rate (transformers'
    ``get_constant_schedule_with_warmup``).

    Args:
        optimizer: its ``lr`` is the base rate.
        warmup_steps: steps of the warmup (0: none).

    Raises:
        ValueError: the optimizer's ``lr`` is not > 0, or ``warmup_steps`` is not an int >= 0.
    """

    def __init__(self, optimizer: Any, warmup_steps: int = 0) -> None:
        super().__init__(optimizer, warmup_steps)

    def _factor(self, step: int) -> float:
        warm = self._warmup(step)
        return 1.0 if warm is None else warm


class LinearSchedule(_Schedule):
    """A linear warmup from 0, then a linear decay to ``min_lr`` at ``total_steps``
    (transformers' ``get_linear_schedule_with_warmup`` where ``min_lr`` is 0). After
    ``total_steps`` the rate stays at ``min_lr``.

    Args:
        optimizer: its ``lr`` is the base (peak) rate.
        warmup_steps: steps of the warmup, ``<= total_steps``.
        total_steps: the step at which the decay reaches ``min_lr``.
        min_lr: the floor, in ``[0, base rate]``.

    Raises:
        ValueError: a value out of range, naming it.
    """

    def __init__(
        self, optimizer: Any, warmup_steps: int, total_steps: int, min_lr: float = 0.0
    ) -> None:
        super().__init__(optimizer, warmup_steps, total_steps, min_lr)

    def _factor(self, step: int) -> float:
        warm = self._warmup(step)
        if warm is not None:
            return warm
        assert self.total_steps is not None
        left = float(self.total_steps - step) / float(max(1, self.total_steps - self.warmup_steps))
        return _floored(max(0.0, left), self.min_lr / self.base_lr)


class CosineSchedule(_Schedule):
    """A linear warmup from 0, then a half cosine down to ``min_lr`` at ``total_steps``
    (transformers' ``get_cosine_schedule_with_warmup``, and with ``min_lr > 0``
    ``get_cosine_with_min_lr_schedule_with_warmup``). After ``total_steps`` the rate stays at
    ``min_lr`` (transformers' cosine would rise again).

    Args:
        optimizer: its ``lr`` is the base (peak) rate.
        warmup_steps: steps of the warmup, ``<= total_steps``.
        total_steps: the step at which the cosine reaches ``min_lr``.
        min_lr: the floor, in ``[0, base rate]``.

    Raises:
        ValueError: a value out of range, naming it.
    """

    def __init__(
        self, optimizer: Any, warmup_steps: int, total_steps: int, min_lr: float = 0.0
    ) -> None:
        super().__init__(optimizer, warmup_steps, total_steps, min_lr)

    def _factor(self, step: int) -> float:
        warm = self._warmup(step)
        if warm is not None:
            return warm
        assert self.total_steps is not None
        span = float(max(1, self.total_steps - self.warmup_steps))
        progress = min(1.0, float(step - self.warmup_steps) / span)
        # transformers' expression with num_cycles = 0.5, kept as written so the rates agree
        # to the last bit
        factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
        return _floored(factor, self.min_lr / self.base_lr)


def _floored(factor: float, floor: float) -> float:
    """``factor`` in [0, 1] mapped onto [floor, 1], as transformers' min-lr schedules do."""
    return max(0.0, factor * (1 - floor) + floor)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
