"""SoftmaxCrossEntropy: the mean next-token loss of logits against integer targets."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.components._layer import Layer, check_sizes, is_int

__all__ = ["SoftmaxCrossEntropy", "SoftmaxCrossEntropyConfig"]


@dataclass(frozen=True)
class SoftmaxCrossEntropyConfig:
    """Configuration of a :class:`SoftmaxCrossEntropy` loss.

    Args:
        vocab_size: number of classes ``V`` (the logits' last axis).
        ignore_index: target value of positions that do not count (padding, prompt tokens),
            as in PyTorch's ``cross_entropy``.

    Raises:
        TypeError: a non-int field.
        ValueError: ``vocab_size <= 0``.
    """

    vocab_size: int
    ignore_index: int = -100

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (called on construction)."""
        check_sizes(self, "vocab_size")
        if not is_int(self.ignore_index):
            raise TypeError(
                f"SoftmaxCrossEntropyConfig: ignore_index must be an int, got {self.ignore_index!r}"
            )


class SoftmaxCrossEntropy(Layer):
    """``loss = mean over counted positions of -log softmax(logits)[target]``.

    Positions whose target is ``ignore_index`` do not count; with none counted the loss is NaN
    and the gradient zero (as PyTorch). Log-sum-exp keeps it finite for any finite logits.

    The build shape is the logits', ``[B, T, vocab_size]``; calls may use ``B' <= B``,
    ``T' <= T``. Every build owns ``lse [B, T]`` (each row's log-sum-exp); TRAINING builds own
    ``targets [B, T]`` (int64, a copy of the last forward's targets) and ``dinput [B, T, V]``.

    Args:
        name: component name.
        config: a :class:`SoftmaxCrossEntropyConfig`.
        device: ``"CPU"``, ... for a standalone component; None inside a Network.
        precision: of the logits and their gradient: FP32, BF16 or FP16 (FP64 on the CPU);
            the softmax, ``lse`` and the loss are computed in FP32 (float64 for the loss).
    """

    _OP_NAME = "SoftmaxCrossEntropyOp"
    _CONFIG_TYPE = SoftmaxCrossEntropyConfig
    config: SoftmaxCrossEntropyConfig

    def _on_building(self, build_context: BuildContext) -> None:
        lead = self._build_lead(build_context, self.config.vocab_size, "[B, T, vocab_size]")
        self._add_state("lse", self._allocate(lead, np.promote_types(self._dtype, np.float32)))
        if build_context.is_training:
            self._add_state("targets", self._allocate(lead, np.int64))
            self._add_state("dinput", self._allocate(build_context.input_shape))
        self._max_lead = lead
        self._count = 0

    def forward(self, logits: Any, targets: Any) -> float:
        """The mean cross-entropy over the positions whose target is not ``ignore_index``.

        Args:
            logits: ``[B', T', vocab_size]`` with ``B' <= B``, ``T' <= T``. On TRAINING builds it
                is kept (not copied) for :meth:`backward`: do not modify it.
            targets: integer class ids ``[B', T']``, each in ``[0, vocab_size)`` or
                ``ignore_index``.

        Returns:
            The loss as a Python float (NaN when every target is ignored).

        Raises:
            TypeError: a wrong array type or dtype.
            ValueError: shapes that do not match or exceed the build shape, or a target out of
                range.
            RuntimeError: before build.
        """
        self._require_built("forward()")
        lead = self._check_floats(logits, "logits", self.config.vocab_size)
        self._check_ints(targets, "targets")
        if tuple(targets.shape) != lead:
            raise ValueError(
                f"{self._describe()}: targets must have the logits' leading shape {list(lead)}, "
                f"got {list(targets.shape)}"
            )
        self._check_targets(targets)
        if self.build_context.is_training:
            kept = self._view("targets", lead)
            kept[...] = targets
            targets = kept
        loss, count = self._op.forward(logits, targets, self._view("lse", lead))
        if self.build_context.is_training:
            self._saved = (logits, targets)
            self._count = count
        return loss

    def backward(self, dloss: float = 1.0) -> Any:
        """Gradient of ``dloss * loss`` with respect to the logits of the last forward.

        Args:
            dloss: the upstream gradient of the loss (e.g. ``1 / micro_batches``).

        Returns:
            ``[B', T', vocab_size]`` ``= (softmax - onehot(target)) * dloss / count``, zero at
            ignored positions: a view of the component-owned ``dinput`` buffer, overwritten by
            the next backward.

        Raises:
            RuntimeError: on INFERENCE builds, or before any forward.
            TypeError: ``dloss`` is not a real number.
            ValueError: ``dloss`` is not finite.
        """
        self._require_backward()
        if isinstance(dloss, bool) or not isinstance(dloss, numbers.Real):
            raise TypeError(f"{self._describe()}: dloss must be a real number, got {dloss!r}")
        if not math.isfinite(dloss):
            raise ValueError(f"{self._describe()}: dloss must be finite, got {dloss!r}")
        logits, targets = self._saved
        dlogits = self._view("dinput", tuple(logits.shape))
        scale = float(dloss) / self._count if self._count else 0.0
        lse = self._view("lse", tuple(targets.shape))
        self._op.backward(logits, targets, lse, dlogits, scale)
        return dlogits

    def _check_targets(self, targets: Any) -> None:
        ignore, vocab = self.config.ignore_index, self.config.vocab_size
        bad = targets[(targets != ignore) & ((targets < 0) | (targets >= vocab))]
        if bad.size:
            raise ValueError(
                f"{self._describe()}: target {int(bad.reshape(-1)[0])} is out of range: targets "
                f"must be in [0, vocab_size = {vocab}) or ignore_index = {ignore}"
            )

    def _extra_repr(self) -> str:
        return f"vocab={self.config.vocab_size}, ignore_index={self.config.ignore_index}"
