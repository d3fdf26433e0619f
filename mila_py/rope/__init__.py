"""RoPE's own math: the config, the scaling types and the shared cos/sin tables.

Below the ops (``mila_py.ops.cpu.rope`` and ``mila_py.ops.cuda.rope`` read their tables here)
and above the core; the ``Rope`` component that applies them is
:class:`mila_py.components.Rope`, and reading a Hugging Face ``config.json`` is
:func:`mila_py.interop.hf_rope.rope_config_from_hf`.
"""

from __future__ import annotations

from mila_py.rope.config import FrozenDict, RopeConfig, RopeLayout
from mila_py.rope.scaling import (
    RopeType,
    check_scaling_values,
    default_inv_freq,
    get_rope_type,
    register_rope_type,
    registered_rope_types,
    rope_type_name,
)
from mila_py.rope.table import RopeTable, clear_rope_cache, get_rope, mrope_axes

__all__ = [
    "FrozenDict",
    "RopeConfig",
    "RopeLayout",
    "RopeTable",
    "RopeType",
    "check_scaling_values",
    "clear_rope_cache",
    "default_inv_freq",
    "get_rope",
    "get_rope_type",
    "mrope_axes",
    "register_rope_type",
    "registered_rope_types",
    "rope_type_name",
]
