"""Optimizers over a component's parameters and gradients, and gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from mila_py.component import Component
from mila_py.memory import MemoryCategory, MemoryStats
from mila_py.ops.registry import create_op, is_supported

__all__ = ["AdamW", "clip_grad_norm"]


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
    lr: Any, betas: Any, eps: Any, weight_decay: Any
) -> tuple[float, float, float, float, float]:
    """``(lr, beta1, beta2, eps, weight_decay)`` as Python floats.

    Raises:
        ValueError: one is not a real number, ``betas`` is not a pair, or a value is out of
            range (``0 < lr < inf``, ``0 <= beta < 1``, ``0 < eps < inf``,
            ``0 <= weight_decay < inf``); the message names it.
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
    if not 0 < lr < math.inf:
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
        lr: learning rate (may be changed between steps through ``opt.lr``).
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
        step_count: the steps applied. skipped_steps: the steps skipped (``skip_nonfinite``).
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
            self._m = [xp.zeros_like(p) for _, p, _ in self._pairs]
            self._v = [xp.zeros_like(p) for _, p, _ in self._pairs]
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
            self.lr, self.betas, self.eps, self.weight_decay
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
        for (_, p, g), m, v, decays in zip(
            self._pairs, self._m, self._v, self._decays, strict=True
        ):
            if fused is not None and fused.accepts(p, g, m, v):
                factor = 1.0 - lr * weight_decay if decays and weight_decay else None
                fused.step(
                    p, g, m, v, decay=factor, betas=(beta1, beta2), correction2=correction2,
                    eps=eps, step_size=step_size,
                )  # fmt: skip
                continue
            if decays and weight_decay:
                p *= 1.0 - lr * weight_decay
            m *= beta1
            m += (1.0 - beta1) * g
            v *= beta2
            v += (1.0 - beta2) * g * g  # scaled, then squared, as torch: no early overflow
            denom = xp.sqrt(v)  # sqrt first, then the correction, as torch: v / c2 overflows first
            denom /= math.sqrt(correction2)
            denom += eps
            p -= step_size * (m / denom)

    def zero_grad(self) -> None:
        self.model.zero_gradients()

    def get_memory_stats(self) -> MemoryStats:
        """The optimizer's own state (the two moments) as host/device state bytes."""
        loc = self.model._location_of
        return MemoryStats.from_arrays(
            (MemoryCategory.STATE, loc(a), a) for a in (*self._m, *self._v)
        )


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
