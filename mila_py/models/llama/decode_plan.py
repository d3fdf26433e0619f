"""A Llama's decode step for ``B`` sequences, bound once to the build's buffers.

The step reads its inputs from two buffers of the plan, written before each run: the token ids
(:attr:`DecodePlan.tokens`, int32 ``[B]``) and the positions (:attr:`DecodePlan.positions`,
host ints and, on a GPU, their int32 ``[B]`` device copy). Its calls (the embedding lookup,
every layer's, the head's) are bound to the build's state buffers, so a run allocates nothing
and makes no view; on a GPU they take everything that changes per step from the device
buffers, so the step is captured once as a CUDA graph and replayed per token
(:func:`mila_py.devices.graph.capture`). A step that must read the positions on the host (a
RoPE scaling whose table depends on the step's length, ``dynamic`` or LongRoPE past its
original context; a context too long for the decode attention kernel) runs eagerly, as on the
CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mila_py.components._layer import leading_view
from mila_py.devices.graph import Step, capture
from mila_py.ops.operation import DecodePositions, write_ints

if TYPE_CHECKING:  # for annotations only: the network imports this module
    from mila_py.models.llama.network import Llama

__all__ = ["DecodePlan"]


class DecodePlan:
    """One decode step of a built Llama for ``B`` sequences (see the module docstring).

    Attributes:
        positions: the step's positions, set before each run.
        tokens: int32 ``[B]`` on the model's device, the step's token ids.
        step: runs the step (a :class:`~mila_py.devices.graph.Step`: eager, or replayed from
            a CUDA graph after its first run).
        logits: ``[B, 1, vocab]``, a view of the buffer the step writes its logits into.
    """

    __slots__ = ("_context", "logits", "positions", "step", "tokens")

    def __init__(self, model: Llama, n_b: int) -> None:
        ctx = model.execution_context
        self._context = ctx
        self.positions = DecodePositions(n_b, ctx, limit=model.context_length)
        self.tokens = ctx.allocate((n_b,), np.int32)
        calls, h = model.embed_tokens._bind_lookup(self.tokens)
        scores = model._state.get("decode_scores")  # CPU builds
        for block in model.layers:
            block_calls, h = block._bind_decode(h, self.positions, scores)
            calls += block_calls
        norm_calls, h = model.norm._bind_forward(h)
        calls += norm_calls
        if model.lm_head is not None:
            head_calls, logits = model.lm_head._bind_forward(h)
            calls += head_calls
        else:
            vocab = model.config.vocab_size
            logits = leading_view(model._state["logits"], (n_b, 1, vocab))
            weight = model.embed_tokens._parameters["weight"]  # [vocab, dim]
            calls.append(model._head_op.bind_forward(h, weight, None, logits))
        self.logits = logits
        # an empty batch has no device work to capture (and kernels of no blocks to avoid)
        self.step: Step = capture(ctx, calls) if n_b else Step(ctx, calls, None)

    def feed(self, ids: Any) -> None:
        """Write the step's token ids ``[B]`` (checked by the caller) into :attr:`tokens`: host
        ints with one copy to the device, device ints with one copy on it (no wait for the
        device either way). Run it with the context active."""
        if isinstance(ids, np.ndarray):
            write_ints(self._context, self.tokens, ids.reshape(-1))
        else:
            self._context.xp.copyto(self.tokens, ids.reshape(-1), casting="unsafe")

    def run(self, positions: Any, lowest: int, highest: int) -> Any:
        """Set the step's positions (an int or ``[B]`` host ints, checked by the caller, and
        their range) and run the step, whose ids were fed; returns :attr:`logits`. Run it with
        the context active."""
        self.positions.set(positions, lowest, highest)
        self.step()
        return self.logits
