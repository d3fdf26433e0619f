"""Deterministic parameter initialization: one base seed, one random stream per component.

Each component draws its initial values from ``rng_for(init_name(component))``: a generator
seeded from the module-global base seed and the CRC-32 of the component's *init name*. The
result depends only on (base seed, init name), never on the order in which components are
built, so a network built twice, or built in another order, starts from the same weights.

The init name is the component's name unless a parent set a longer one with
:func:`set_init_name` (e.g. ``"layer3.mlp.gate_proj"``): a tree that holds several components
with the same local name (every block's ``gate_proj``) must give each its dotted path, or they
start with identical weights. :func:`assign_init_names` does that for a whole tree in one call
(a network calls it at the start of its ``_on_building``).
"""

from __future__ import annotations

import operator
import zlib
from typing import Any

import numpy as np

__all__ = [
    "assign_init_names",
    "init_name",
    "initial_seed",
    "manual_seed",
    "rng_for",
    "set_init_name",
]

_base_seed = 0


def manual_seed(seed: int) -> None:
    """Set the base seed every later :func:`rng_for` derives from (default 0).

    Raises:
        TypeError: ``seed`` is not an int.
        ValueError: ``seed`` is negative.
    """
    global _base_seed
    if isinstance(seed, bool):
        raise TypeError(f"manual_seed: seed must be an int, got {seed!r}")
    try:
        value = operator.index(seed)
    except TypeError:
        raise TypeError(f"manual_seed: seed must be an int, got {seed!r}") from None
    if value < 0:
        raise ValueError(f"manual_seed: seed must be >= 0, got {value}")
    _base_seed = value


def initial_seed() -> int:
    """The current base seed."""
    return _base_seed


def rng_for(name: str) -> np.random.Generator:
    """A fresh generator seeded from (base seed, CRC-32 of ``name``).

    Raises:
        TypeError: ``name`` is not a str.
    """
    if not isinstance(name, str):
        raise TypeError(f"rng_for: name must be a str, got {name!r}")
    return np.random.default_rng([_base_seed, zlib.crc32(name.encode("utf-8"))])


def init_name(component: Any) -> str:
    """The name ``component`` seeds its initialization with: its init name or its name."""
    return component.__dict__.get("_init_name") or component.name


def set_init_name(component: Any, name: str) -> None:
    """Make ``component`` seed its initialization with ``name`` (a parent's dotted path).

    Stored in the component's ``__dict__``, so a failed build rolls it back with everything else.

    Raises:
        TypeError: ``name`` is not a str.
    """
    if not isinstance(name, str):
        raise TypeError(f"set_init_name: name must be a str, got {name!r}")
    component.__dict__["_init_name"] = name


def assign_init_names(root: Any) -> None:
    """Give every descendant of ``root`` its dotted path below ``root`` as its init name.

    The paths are those of ``root.named_parameters()`` without the parameter name (a child
    ``mlp`` of a block ``layer3`` of the root seeds with ``"layer3.mlp"``), independent of the
    root's own name.

    Raises:
        ValueError: two components have one path (a child named ``"a.b"`` beside a child ``a``
            with a child ``b``): their parameters would share names and initial values, and
            no save could tell them apart. Nothing is assigned then.
    """
    found: dict[str, Any] = {}

    def visit(node: Any, prefix: str) -> None:
        for child in node._children():
            path = prefix + child.name
            if path in found:
                raise ValueError(
                    f"{found[path]._describe()} and {child._describe()} both have the path "
                    f"'{path}' below {root._describe()}: rename one (dots in names join paths)"
                )
            found[path] = child
            visit(child, path + ".")

    visit(root, "")
    for path, child in found.items():
        set_init_name(child, path)
