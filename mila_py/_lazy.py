"""Submodules as package attributes, imported on first access (PEP 562)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from types import ModuleType


def lazy_submodules(
    package: str, path: Iterable[str], names: Callable[[], Iterable[str]]
) -> tuple[Callable[[str], ModuleType], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``package.<name>`` imports the submodule
    ``name`` the first time it is read, so importing the package stays light and a submodule
    never has to be imported by the package's own ``__init__``.

    Args:
        package: the package's ``__name__``.
        path: its ``__path__``.
        names: the names the package has already (its ``globals``), for ``dir()``.
    """

    def __getattr__(name: str) -> ModuleType:
        """``<package>.<name>`` for a submodule not imported yet: imports and returns it.

        Raises:
            AttributeError: ``name`` is private or names no submodule of the package.
        """
        if not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as error:
                if error.name != f"{package}.{name}":
                    raise  # the submodule exists but one of its own imports is missing
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        """The package's names and its public submodules, imported or not (for completion)."""
        modules = (m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_"))
        return sorted({*names(), *modules})

    return __getattr__, __dir__
