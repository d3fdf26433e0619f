"""Components: one module per component and its config."""

from __future__ import annotations

from mila_py.components.rope import Rope
from mila_py.components.rope_config import RopeConfig, RopeLayout
from mila_py.components.rope_scaling import register_rope_type, registered_rope_types
from mila_py.components.rope_table import RopeTable, clear_rope_cache, get_rope

__all__ = [
    "Rope",
    "RopeConfig",
    "RopeLayout",
    "RopeTable",
    "clear_rope_cache",
    "get_rope",
    "register_rope_type",
    "registered_rope_types",
]
