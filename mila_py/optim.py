"""Optimizers over a component's parameters and gradients, and gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mila_py.component import Component
from mila_py.memory import MemoryCategory, MemoryStats
from mila_py.ops.registry import create_op, is_supported

__all__ = [
    "AdamW",
    "ConstantSchedule",
    "CosineSchedule",
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
    counts and the hyper-parameters, so that a resumed run continues bit for bit.
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
            "exp_avg": {name: np.ndarray}, "exp_avg_sq": {name: np.ndarray}}``; each moment
            has its parameter's shape and the moments' dtype, and is a NumPy copy that later
            steps do not change.

        Raises:
            ValueError: two parameters share a dotted name.
        """
        names = self._names()
        ctx = self.model.execution_context
        with ctx.activate():
            exp_avg = {n: ctx.to_host(m) for n, m in zip(names, self._m, strict=True)}
            exp_avg_sq = {n: ctx.to_host(v) for n, v in zip(names, self._v, strict=True)}
        beta1, beta2 = self.betas
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
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`: the moments, step counts and hyper-parameters (the
        saved ones replace those given at construction, as torch's optimizers do).

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
        keys = ("step_count", "skipped_steps", "hyperparameters", "decay", "exp_avg", "exp_avg_sq")
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
        for key, live in (("exp_avg", self._m), ("exp_avg_sq", self._v)):
            arrays = state.get(key)
            if key not in state:
                continue
            if not isinstance(arrays, Mapping):
                problems.append(f"{key}: expected a mapping of names to arrays, got {arrays!r}")
                continue
            problems += _name_problems(key, arrays, names)
            for name, mine in zip(names, live, strict=True):
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

    def _apply_state(self, parsed: dict[str, Any]) -> None:
        """Set what :meth:`_parse_state` checked (nothing here can fail on valid input)."""
        names = self._names()
        ctx = self.model.execution_context
        moments = parsed["moments"]
        with ctx.activate():
            for key, live in (("exp_avg", self._m), ("exp_avg_sq", self._v)):
                for name, mine in zip(names, live, strict=True):
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
