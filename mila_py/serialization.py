"""Save and load a component tree's parameters as safetensors, named by the dotted tree path."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["load", "save"]


def save(component: Any, path: str | os.PathLike[str]) -> None:
    """Write every parameter of ``component`` to ``path`` (safetensors, float arrays as stored)."""
    from safetensors.numpy import save_file

    ctx = component.execution_context
    tensors = {
        name: np.ascontiguousarray(ctx.to_host(p)) for name, p in component.named_parameters()
    }
    save_file(tensors, os.fspath(path), metadata={"format": "mila_py"})


def load(component: Any, path: str | os.PathLike[str]) -> None:
    """Load parameters saved by :func:`save` (or any safetensors file with the same names).

    Every missing, unexpected or mis-shaped tensor is reported at once, and then nothing is loaded.

    Raises:
        RuntimeError: before build (nothing to load into).
        ValueError: listing every mismatch.
    """
    from safetensors.numpy import load_file

    if not component.is_built:
        raise RuntimeError(f"{component._describe()}: build it before load()")
    tensors = load_file(os.fspath(path))
    params = dict(component.named_parameters())
    problems = [f"missing: {name}" for name in params if name not in tensors]
    problems += [f"unexpected: {name}" for name in tensors if name not in params]
    problems += [
        f"shape of {name}: file {tuple(tensors[name].shape)}, model {tuple(p.shape)}"
        for name, p in params.items()
        if name in tensors and tuple(tensors[name].shape) != tuple(p.shape)
    ]
    if problems:
        raise ValueError(
            f"{component._describe()}: cannot load {os.fspath(path)}; nothing was loaded:\n  "
            + "\n  ".join(problems)
        )
    ctx = component.execution_context
    for name, p in params.items():
        p[...] = ctx.to_device(tensors[name].astype(p.dtype, copy=False))
