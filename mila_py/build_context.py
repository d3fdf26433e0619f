"""BuildContext: the frozen value every ``Component.build`` receives, and the runtime modes."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Set
from dataclasses import dataclass, replace

__all__ = ["BuildContext", "RuntimeMode", "TrainingMode"]


class RuntimeMode(enum.Enum):
    """Allocation policy fixed at build: INFERENCE allocates no gradients, TRAINING does."""

    INFERENCE = "Inference"
    TRAINING = "Training"


class TrainingMode(enum.Enum):
    """Runtime behaviour switch, legal only on TRAINING builds (INFERENCE builds are always EVAL)."""

    NORMAL = "Normal"
    EVAL = "Eval"


@dataclass(frozen=True)
class BuildContext:
    """What a component is built for.

    Args:
        input_shape: the full input shape the component receives, e.g. ``(B, T, C)``; every entry > 0.
        runtime_mode: INFERENCE or TRAINING.
        initialize_parameters: initialize parameter values after allocation. ``None`` resolves to
            True for TRAINING and False for INFERENCE (inference builds expect loaded weights).
        prefill_size: tokens per prefill pass for inference builds (0 = the whole input length).
        recompute: TRAINING builds of a network of blocks (a Llama) keep only each block's
            input per layer and one workspace for the blocks' internals, which the backward
            pass refills by running each block's forward again right before that block's
            backward: less memory for one more forward pass per step, the same gradients.

    Raises:
        ValueError: empty or non-positive shape, negative prefill size, ``recompute`` on an
            INFERENCE build (which keeps nothing for a backward pass).
        TypeError: a runtime_mode that is not a RuntimeMode, a ``recompute`` that is not a bool.
    """

    input_shape: tuple[int, ...]
    runtime_mode: RuntimeMode
    initialize_parameters: bool | None = None
    prefill_size: int = 0
    recompute: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.input_shape, Set | Mapping):  # no order: (4, 2) or (2, 4)?
            raise TypeError(
                f"BuildContext: input_shape must be an ordered sequence of ints, got "
                f"{self.input_shape!r}"
            )
        try:
            shape = tuple(self.input_shape)
        except TypeError:
            raise TypeError(
                f"BuildContext: input_shape must be a sequence of ints, got {self.input_shape!r}"
            ) from None
        if not shape:
            raise ValueError("BuildContext: input_shape must not be empty")
        for dim in shape:
            if isinstance(dim, bool) or not isinstance(dim, int | _np_integer()):
                raise TypeError(f"BuildContext: input_shape entries must be ints, got {shape!r}")
            if dim <= 0:
                raise ValueError(
                    f"BuildContext: input_shape entries must be positive, got {shape!r}"
                )
        object.__setattr__(self, "input_shape", tuple(int(d) for d in shape))
        if not isinstance(self.runtime_mode, RuntimeMode):
            raise TypeError(
                f"BuildContext: runtime_mode must be a RuntimeMode, got {self.runtime_mode!r}"
            )
        prefill = self.prefill_size
        if isinstance(prefill, bool) or not isinstance(prefill, int | _np_integer()):
            raise TypeError(f"BuildContext: prefill_size must be an int, got {prefill!r}")
        if prefill < 0:
            raise ValueError(f"BuildContext: prefill_size must be >= 0, got {prefill}")
        object.__setattr__(self, "prefill_size", int(prefill))
        init = self.initialize_parameters
        if init is None:
            init = self.runtime_mode is RuntimeMode.TRAINING
        elif not isinstance(init, bool | _np_bool()):
            raise TypeError(
                f"BuildContext: initialize_parameters must be True, False or None, got {init!r}"
            )
        object.__setattr__(self, "initialize_parameters", bool(init))
        if not isinstance(self.recompute, bool | _np_bool()):
            raise TypeError(
                f"BuildContext: recompute must be True or False, got {self.recompute!r}"
            )
        if self.recompute and self.runtime_mode is not RuntimeMode.TRAINING:
            raise ValueError(
                "BuildContext: recompute is for TRAINING builds; an INFERENCE build keeps no "
                "activations for a backward pass (its blocks share one workspace already)"
            )
        object.__setattr__(self, "recompute", bool(self.recompute))

    @property
    def is_training(self) -> bool:
        return self.runtime_mode is RuntimeMode.TRAINING

    @property
    def is_inference(self) -> bool:
        return self.runtime_mode is RuntimeMode.INFERENCE

    @property
    def should_initialize_parameters(self) -> bool:
        return bool(self.initialize_parameters)

    def with_shape(self, input_shape: tuple[int, ...]) -> BuildContext:
        """A copy with another input shape."""
        return replace(self, input_shape=input_shape)  # checked as the constructor checks it

    def with_prefill_size(self, prefill_size: int) -> BuildContext:
        """A copy with another prefill size."""
        return replace(self, prefill_size=prefill_size)


def _np_integer() -> type:
    import numpy as np

    return np.integer


def _np_bool() -> type:
    import numpy as np

    return np.bool_
