"""TokenEmbedding: token ids to vectors through a learned table ``[vocab_size, dim]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.components._layer import Layer, check_sizes

__all__ = ["TokenEmbedding", "TokenEmbeddingConfig"]


@dataclass(frozen=True)
class TokenEmbeddingConfig:
    """Configuration of a :class:`TokenEmbedding`.

    Args:
        vocab_size: number of token ids (ids are ``0 .. vocab_size - 1``).
        dim: width of each embedding vector.

    Raises:
        TypeError: a non-int size.
        ValueError: a size that is not positive.
    """

    vocab_size: int
    dim: int

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (called on construction)."""
        check_sizes(self, "vocab_size", "dim")


class TokenEmbedding(Layer):
    """``y[b, t] = weight[tokens[b, t]]``.

    Parameter: ``weight [vocab_size, dim]`` ~ Normal(0, 0.02) (when the build initializes
    parameters).

    The build shape is the token ids', ``[B, T]``; calls may use ``B' <= B``, ``T' <= T``.
    TRAINING builds own ``tokens [B, T]`` (int64), a copy of the last forward's ids for backward,
    so the caller may reuse its id array.

    Args:
        name: component name.
        config: a :class:`TokenEmbeddingConfig`.
        device: ``"CPU"``, ... for a standalone component; None inside a Network.
        precision: of the table and the output: FP32, BF16 or FP16 (FP64 on the CPU); the
            table's gradient is FP32 for the 16-bit ones.
    """

    _OP_NAME = "TokenEmbeddingOp"
    _CONFIG_TYPE = TokenEmbeddingConfig
    config: TokenEmbeddingConfig

    def _on_building(self, build_context: BuildContext) -> None:
        cfg = self.config
        lead = build_context.input_shape
        if len(lead) != 2:
            raise ValueError(
                f"{self._describe()}: build input_shape must be the token ids' [B, T], got {lead}"
            )
        weight = self._add_parameter("weight", self._allocate((cfg.vocab_size, cfg.dim)))
        if build_context.should_initialize_parameters:
            self._init_normal(weight)
        self._add_state("output", self._allocate((*lead, cfg.dim)))
        if build_context.is_training:
            self._add_state("tokens", self._allocate(lead, np.int64))
        self._max_lead = lead

    @property
    def weight(self) -> Any:
        """``[vocab_size, dim]`` (after build)."""
        self._require_built("weight")
        return self._parameters["weight"]

    def forward(self, tokens: Any) -> Any:
        """Look up the embedding of every id.

        Args:
            tokens: integer ids ``[B', T']`` with ``B' <= B``, ``T' <= T``, each in
                ``[0, vocab_size)``.

        Returns:
            ``[B', T', dim]``: a view of the component-owned output buffer, overwritten by the
            next forward.

        Raises:
            TypeError: ``tokens`` is not an integer array of this device.
            ValueError: a wrong shape, or an id outside ``[0, vocab_size)`` (nothing is written).
            RuntimeError: before build.
        """
        self._require_built("forward()")
        shape = self._check_ints(tokens, "tokens")
        self.check_ids(tokens)
        return self._lookup(tokens, shape)

    def check_ids(self, tokens: Any) -> None:
        """Refuse ids outside ``[0, vocab_size)`` (``tokens``: integers of this device or a
        NumPy array of them, any shape), for a caller that looks up in pieces and must know
        before the first one, or that holds the ids on the host too (no wait for the GPU)."""
        if tokens.size:
            if isinstance(tokens, np.ndarray):
                low, high = int(tokens.min()), int(tokens.max())
            else:  # both in one transfer: one wait for the device
                ctx = self.execution_context
                with ctx.activate():
                    both = ctx.xp.stack((tokens.min(), tokens.max()))
                    low, high = (int(v) for v in ctx.to_host(both))
            if low < 0 or high >= self.config.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"{self._describe()}: token id {bad} is out of range: ids must be in "
                    f"[0, vocab_size = {self.config.vocab_size})"
                )

    def _lookup(self, tokens: Any, shape: tuple[int, ...]) -> Any:
        """:meth:`forward` of checked ``tokens`` of ``shape``."""
        y = self._view("output", (*shape, self.config.dim))
        if self.build_context.is_training:
            kept = self._view("tokens", shape)
            kept[...] = tokens
            tokens = self._saved = kept
        self._op.forward(tokens, self._parameters["weight"], y)
        return y

    def _bind_lookup(self, tokens: Any) -> tuple[list[Any], Any]:
        """``(steps, y)``: callables that look up the ids of the buffer ``tokens [B]`` (int32 on
        this device, its values at call time, checked by the caller) into the output view
        ``y [B, 1, dim]``, for a decode plan (INFERENCE builds)."""
        n_b = int(tokens.shape[0])
        y = self._view("output", (n_b, 1, self.config.dim))
        weight = self._parameters["weight"]
        return [self._op.bind_forward(tokens.reshape(n_b, 1), weight, y)], y

    def backward(self, dy: Any) -> None:
        """Accumulate ``dweight[tokens[b, t]] += dy[b, t]`` (repeated ids add up).

        Token ids have no gradient, so nothing is returned.

        Args:
            dy: ``[B', T', dim]``, the gradient of the last forward's output.

        Raises:
            RuntimeError: on INFERENCE builds, or before any forward.
            TypeError, ValueError: ``dy`` does not match the last forward's output.
        """
        self._require_backward()
        tokens = self._saved
        self._check_grad(dy, "dy", (*tokens.shape, self.config.dim))
        self._op.backward(tokens, dy, self._gradients["weight"])

    def _extra_repr(self) -> str:
        return f"vocab={self.config.vocab_size}, dim={self.config.dim}"
