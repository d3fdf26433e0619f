"""Save and load a component tree's parameters as safetensors, named by the dotted tree path."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["assign_parameters", "load", "open_safetensors", "read_safetensors", "save"]


def save(component: Any, path: str | os.PathLike[str]) -> None:
    """Write every parameter of ``component`` to ``path`` (safetensors, float arrays as stored).

    Raises:
        RuntimeError: before build (there are no parameters yet).
        OSError: the file cannot be written (no such folder, ``path`` is a folder, ...).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    if not component.is_built:
        raise RuntimeError(f"{component._describe()}: build it before save()")
    ctx = component.execution_context
    tensors = {
        name: np.ascontiguousarray(readable_on_host(ctx, p))
        for name, p in _named(component, "save")
    }
    try:
        save_file(tensors, os.fspath(path), metadata={"format": "mila_py"})
    except SafetensorError as exc:  # the library's I/O errors are plain Exceptions
        raise OSError(f"{component._describe()}: cannot write {os.fspath(path)} ({exc})") from exc


def readable_on_host(ctx: Any, array: Any) -> np.ndarray:
    """``array`` to read on the host: itself where it is a NumPy array already (a save writes
    from the parameters, without a second copy of every weight), else ``ctx.to_host``'s copy."""
    return array if isinstance(array, np.ndarray) else ctx.to_host(array)


def _named(component: Any, what: str) -> list[tuple[str, Any]]:
    """``component.named_parameters()``, each dotted name once.

    Raises:
        ValueError: two parameters share a name (children whose names contain dots spelling
            another child's path, e.g. ``"a.b"`` beside ``"a"`` holding ``"b"``).
    """
    named = list(component.named_parameters())
    seen: set[str] = set()
    twice: set[str] = set()
    for name, _ in named:
        (twice if name in seen else seen).add(name)
    if twice:
        raise ValueError(
            f"{component._describe()}: cannot {what}: several parameters are named "
            f"{sorted(twice)} "
            "(a child name with dots spells another child's path); rename a child"
        )
    return named


def load(component: Any, path: str | os.PathLike[str]) -> None:
    """Load parameters saved by :func:`save` (or any safetensors file with the same names).

    Every missing, unexpected or mis-shaped tensor is reported at once, and then nothing is loaded.

    Raises:
        RuntimeError: before build (nothing to load into).
        FileNotFoundError: no file at ``path``.
        ValueError: listing every mismatch, or a file that is not safetensors.
    """
    if not component.is_built:
        raise RuntimeError(f"{component._describe()}: build it before load()")
    who = component._describe()
    with open_safetensors(path, who) as f:  # the header: names, dtypes, shapes
        names = f.keys()  # (a safe_open handle is not iterable)
        slices = {name: f.get_slice(name) for name in names}
        found: dict[str, Any] = {
            name: _Stored(tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()
        }
    expected = {name for name, _ in _named(component, "load")}
    wanted = [n for n, s in found.items() if n in expected and s.dtype in _NUMPY_READABLE]
    # only the tensors that can be loaded are read; the others are reported from the header
    found.update(read_safetensors(path, who, wanted))
    assign_parameters(component, found, f"cannot load {os.fspath(path)}")


def read_safetensors(
    path: str | os.PathLike[str],
    who: str,
    names: list[str] | None = None,
    convert: Callable[[np.ndarray], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file (``names`` only, when given), as NumPy arrays, each
    passed through ``convert`` as it is read (so a widened copy never waits beside the whole
    file's tensors).

    Raises:
        FileNotFoundError: no file at ``path`` (a folder is not a file either).
        ValueError: the file is not safetensors (its header does not parse), or it lacks one of
            ``names`` (all of them listed); messages start with ``who``.
    """
    out: dict[str, np.ndarray] = {}
    with open_safetensors(path, who) as f:
        available = set(f.keys())
        wanted = sorted(available) if names is None else names
        absent = [n for n in wanted if n not in available]
        if absent:
            raise ValueError(f"{who}: {os.fspath(path)} lacks tensors: {', '.join(absent)}")
        dtypes = {n: f.get_slice(n).get_dtype() for n in wanted}
        unreadable = [f"{n} ({t})" for n, t in dtypes.items() if t not in _NUMPY_READABLE]
        if unreadable:
            raise ValueError(
                f"{who}: {os.fspath(path)} holds tensors of a type NumPy cannot read: "
                f"{', '.join(unreadable)}"
            )
        for name in wanted:
            array = f.get_tensor(name)
            out[name] = array if convert is None else convert(array)
    return out


#: safetensors dtypes NumPy reads (float8 and smaller floats it has no dtype for)
_NUMPY_READABLE = frozenset(
    {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}
)


@dataclass(frozen=True)
class _Stored:
    """A tensor of a file known by its header only (not read: unexpected, or of a dtype
    NumPy has not)."""

    shape: tuple[int, ...]
    dtype: str


@contextlib.contextmanager
def open_safetensors(path: str | os.PathLike[str], who: str) -> Iterator[Any]:
    """``safetensors.safe_open(path)`` for NumPy (the header only is read on opening), with
    the library's errors as ours.

    Raises:
        FileNotFoundError: no file at ``path`` (a folder is not a file either).
        ValueError: the file is not safetensors (its header does not parse); messages start
            with ``who``.
    """
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{who}: {os.fspath(path)} is not a file")
    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            yield f
    except SafetensorError as exc:
        raise ValueError(f"{who}: {os.fspath(path)} is not a safetensors file ({exc})") from exc


def assign_parameters(component: Any, tensors: Mapping[str, Any], what: str) -> None:
    """Copy ``{dotted name: array}`` into ``component``'s parameters, all or nothing.

    Every missing, unexpected, mis-shaped, non-float or non-array value is reported in one
    ValueError (``"<component>: <what>; nothing was loaded: ..."``), and then no parameter has
    changed. Values (NumPy arrays, or arrays of the component's device) are cast to each
    parameter's dtype.
    """
    params = dict(_named(component, "load"))
    problems = [
        f"missing: {name} {tuple(p.shape)}" for name, p in params.items() if name not in tensors
    ]
    problems += [f"unexpected: {name}" for name in tensors if name not in params]
    for name, p in params.items():
        if name not in tensors:
            continue
        array = tensors[name]
        if not hasattr(array, "shape") or not hasattr(array, "dtype"):
            problems.append(f"type of {name}: {type(array).__name__} is not an array")
        elif type(array).__module__.startswith("torch"):
            problems.append(f"type of {name}: a torch tensor (pass tensor.numpy())")
        elif tuple(np.shape(array)) != tuple(p.shape):
            problems.append(
                f"shape of {name}: got {tuple(np.shape(array))}, expected {tuple(p.shape)}"
            )
        elif not _is_float(array.dtype):
            problems.append(f"dtype of {name}: {array.dtype} is not a float type")
    if problems:
        raise ValueError(
            f"{component._describe()}: {what}; nothing was loaded:\n  " + "\n  ".join(problems)
        )
    ctx = component.execution_context
    for name, p in params.items():
        value = tensors[name]
        if ctx.is_device_array(value):  # already on the device (np.asarray refuses CuPy's)
            p[...] = value.astype(p.dtype, copy=False)
        else:
            p[...] = ctx.to_device(np.asarray(value).astype(p.dtype, copy=False))


def _is_float(dtype: Any) -> bool:
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # a safetensors name NumPy has not (F8_E4M3, ...)
        return False
    return bool(np.issubdtype(dtype, np.floating)) or dtype == ml_dtypes.bfloat16
