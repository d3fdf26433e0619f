"""CUDA TokenEmbeddingOp: a table lookup (CuPy ``take``) and its scatter-add gradient (a kernel).

::

    forward   y [N, D] = W [V, D] [tokens [N]]      cupy.take into the output buffer (a decode
                                                    plan: one kernel reading int32 device ids)
    backward  dW [tokens[i]] += dy [i]               one block per token, atomicAdd per element

Repeated ids are added with float atomics, so their order (and the last bits of a row that many
tokens share) may vary from run to run; the CPU op sums each id's rows in a fixed order. FP16
and BF16 tables are looked up as they are; their gradient is float32 (the kernel is a template
over the storage type of ``dy``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cuda import _kernels
from mila_py.ops.registry import register_op

__all__ = ["CudaTokenEmbeddingOp"]


@register_op("TokenEmbeddingOp", DeviceType.CUDA, precisions=_kernels.CUDA_PRECISIONS)
class CudaTokenEmbeddingOp(_kernels.KernelOp):
    """Embedding lookup and scatter-add gradient (same contract as the CPU op)."""

    FILE = "token_embedding.cu"
    TEMPLATES = ("token_embedding_backward", "token_embedding_lookup")

    def forward(self, tokens: Any, weight: Any, out: Any) -> None:
        """``out[...] = weight[tokens]`` (ids already validated to be in ``[0, V)``)."""
        ctx: Any = self.context
        with ctx.activate():
            ctx.xp.take(weight, tokens, axis=0, out=out)

    def bind_forward(self, tokens: Any, weight: Any, out: Any) -> Callable[[], Any]:
        """:meth:`forward` of fixed buffers (a decode plan): for C-contiguous int32 ``tokens``
        (the step's token buffer), ``weight`` and ``out``, one ``token_embedding_lookup``
        launch, which reads the ids on the device; else the general call."""
        dense = all(a.flags.c_contiguous for a in (tokens, weight, out))
        n_rows = int(tokens.size)
        if not dense or tokens.dtype != np.int32 or n_rows == 0:
            return super().bind_forward(tokens, weight, out)
        vocab, dim = int(weight.shape[0]), int(weight.shape[1])
        args = (tokens, weight, out, np.int64(n_rows), np.int32(dim), np.int32(vocab))
        grid = _kernels.grid_1d(n_rows, 1)

        def lookup() -> None:
            self._launch("token_embedding_lookup", grid, _kernels.ROW_THREADS, args)

        return lookup

    def backward(self, tokens: Any, dy: Any, dweight: Any) -> None:
        """``dweight[tokens[i]] += dy[i]`` for every position ``i`` (repeated ids accumulate)."""
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            ids = xp.ascontiguousarray(tokens.reshape(-1), dtype=np.int64)  # [N]
            n_rows = int(ids.shape[0])
            if n_rows == 0:
                return
            dy2 = _kernels.contiguous_rows(xp, self._storage(dy))  # [N, D]
            if not dweight.flags.c_contiguous:
                raise ValueError(
                    f"CUDA TokenEmbeddingOp: dweight must be C-contiguous, got {dweight.strides}"
                )
            dim = int(dy2.shape[1])
            self._launch(
                "token_embedding_backward",
                _kernels.grid_1d(n_rows, 1),
                _kernels.ROW_THREADS,
                (ids, dy2, dweight, np.int64(n_rows), np.int32(dim)),
            )
