"""The op registry: ``(op name, device type) -> op class`` plus the precisions it supports.

Op modules live in ``mila_py/ops/<device>/<op>.py`` and register themselves on import; the
registry imports the packages ``mila_py.ops.cpu`` and ``mila_py.ops.cuda`` on first lookup.
Every op module must import without CuPy (CUDA ops import it lazily).
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from mila_py.devices.device import DeviceType
from mila_py.devices.execution_context import ExecutionContext
from mila_py.ops.operation import Operation
from mila_py.precision import DEVICE_PRECISIONS, Precision

__all__ = [
    "OpNotFoundError",
    "RegisteredOp",
    "create_op",
    "find_op",
    "is_supported",
    "register_op",
    "registered_ops",
]

T = TypeVar("T", bound=type[Operation])


class OpNotFoundError(LookupError):
    """No op is registered for the requested (name, device, precision).

    Attributes:
        other_precisions: the precisions the op has on that device (empty: the op is not
            registered for the device at all).
    """

    other_precisions: frozenset[Precision] = frozenset()


@dataclass(frozen=True)
class RegisteredOp:
    name: str
    device_type: DeviceType
    precisions: frozenset[Precision]
    cls: type[Operation]


_REGISTRY: dict[tuple[str, DeviceType], RegisteredOp] = {}
_LOCK = threading.Lock()
_LOADED = False


def register_op(
    name: str, device_type: DeviceType, precisions: Iterable[Precision]
) -> Callable[[T], T]:
    """Class decorator registering an op for a device type and the precisions it supports.

    Raises:
        TypeError: ``name`` is not a str or ``device_type`` is not a DeviceType.
        ValueError: an empty name or precision set, a precision the device does not store
            (``DEVICE_PRECISIONS``: FP64 is CPU-only), or ``(name, device_type)`` already
            registered to another class.
    """
    if not isinstance(name, str):
        raise TypeError(f"register_op: name must be a str, got {name!r}")
    if not name:
        raise ValueError("register_op: name must not be empty")
    if not isinstance(device_type, DeviceType):
        raise TypeError(
            f"register_op({name!r}): device_type must be a DeviceType, got {device_type!r}"
        )
    precision_set = frozenset(precisions)
    if not precision_set or not all(isinstance(p, Precision) for p in precision_set):
        raise ValueError(f"register_op({name!r}): precisions must be non-empty Precision values")
    unstored = sorted(str(p) for p in precision_set - DEVICE_PRECISIONS[device_type])
    if unstored:
        raise ValueError(
            f"register_op({name!r}): {device_type} does not store {', '.join(unstored)} "
            "(see precision.DEVICE_PRECISIONS)"
        )

    def decorator(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, Operation)):
            raise TypeError(f"register_op({name!r}): decorates Operation subclasses, got {cls!r}")
        key = (name, device_type)
        with _LOCK:
            existing = _REGISTRY.get(key)
            # The same class re-registered (a module reloaded) replaces itself; another class
            # under the same (name, device) is an error, even if its name matches.
            if existing is not None and _class_key(existing.cls) != _class_key(cls):
                raise ValueError(
                    f"op {name!r} for {device_type} is already registered as {existing.cls!r}"
                )
            _REGISTRY[key] = RegisteredOp(name, device_type, precision_set, cls)
        return cls

    return decorator


def _class_key(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def _load_op_modules() -> None:
    global _LOADED
    if _LOADED:
        return
    for package_name in ("mila_py.ops.cpu", "mila_py.ops.cuda"):
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{package_name}.{info.name}")
    _LOADED = True


def registered_ops() -> list[RegisteredOp]:
    """Every registered op, sorted by name then device."""
    _load_op_modules()
    return sorted(_REGISTRY.values(), key=lambda r: (r.name, r.device_type.value))


def is_supported(name: str, device_type: DeviceType, precision: Precision) -> bool:
    """True if an op ``name`` exists for ``device_type`` and supports ``precision``.

    Raises:
        TypeError: ``device_type`` is not a DeviceType or ``precision`` not a Precision.
    """
    _check_key("is_supported", device_type, precision)
    _load_op_modules()
    entry = _REGISTRY.get((name, device_type))
    return entry is not None and precision in entry.precisions


def _describe_registry() -> str:
    entries = registered_ops()
    if not entries:
        return "nothing is registered"
    return "registered: " + "; ".join(
        f"{r.name}/{r.device_type}[{','.join(sorted(p.value for p in r.precisions))}]"
        for r in entries
    )


def find_op(name: str, device_type: DeviceType, precision: Precision) -> type[Operation]:
    """The op class for ``(name, device_type, precision)``.

    Raises:
        OpNotFoundError: naming all three and listing what is registered.
        TypeError: ``device_type`` is not a DeviceType or ``precision`` not a Precision.
    """
    _check_key("find_op", device_type, precision)
    _load_op_modules()
    entry = _REGISTRY.get((name, device_type))
    if entry is None or precision not in entry.precisions:
        error = OpNotFoundError(
            f"no op {name!r} for device {device_type} at precision {precision}; "
            f"{_describe_registry()}"
        )
        error.other_precisions = frozenset() if entry is None else entry.precisions
        raise error
    return entry.cls


def create_op(name: str, context: ExecutionContext, config: Any, precision: Precision) -> Operation:
    """Instantiate the op ``name`` for ``context``'s device at ``precision``.

    Raises:
        TypeError: ``context`` is not an ExecutionContext (or a bad precision type).
        OpNotFoundError: see :func:`find_op`.
    """
    if not isinstance(context, ExecutionContext):
        raise TypeError(
            f"create_op({name!r}): context must be an ExecutionContext, got {context!r}"
        )
    cls = find_op(name, context.device_type, precision)
    return cls(context, config, precision)


def _check_key(what: str, device_type: Any, precision: Any) -> None:
    """Refuse lookups by the wrong types (a string "CPU" or "FP32" would find nothing and
    report the op as missing)."""
    if not isinstance(device_type, DeviceType):
        raise TypeError(f"{what}: device_type must be a DeviceType, got {device_type!r}")
    if not isinstance(precision, Precision):
        raise TypeError(f"{what}: precision must be a Precision, got {precision!r}")
