"""Save and load a component tree's parameters as safetensors, named by the dotted tree path.

A file saved here records what it was saved from in its (string to string) metadata: the
component's class (``mila_py.class``), its config as JSON (``mila_py.config``, see
:func:`config_to_json`), the mila_py version (``mila_py.version``) and the precision its
tensors were written in (``mila_py.precision``). :func:`load` refuses a file whose config
differs from the component's, even where every shape agrees, and converts tensors of another
float dtype to the component's (as Hugging Face's ``from_pretrained(torch_dtype=...)`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.metadata
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from mila_py.files import atomic_write
from mila_py.precision import Precision

__all__ = [
    "assign_parameters",
    "checkpoint_metadata",
    "config_to_json",
    "load",
    "open_safetensors",
    "read_safetensors",
    "save",
]

#: metadata keys of a file saved by :func:`save`
CLASS_KEY = "mila_py.class"
CONFIG_KEY = "mila_py.config"
VERSION_KEY = "mila_py.version"
PRECISION_KEY = "mila_py.precision"


def save(
    component: Any, path: str | os.PathLike[str], precision: Precision | str | None = None
) -> None:
    """Write every parameter of ``component`` to ``path`` (safetensors), atomically: a reader
    (or a crash) sees the file ``path`` held before or the new one, whole.

    Args:
        component: a built component.
        path: the file.
        precision: the precision the tensors are written in (a Precision or a name such as
            ``"bf16"``); None: as stored (the model's precision). A BF16 model saved as FP32
            is exact; an FP32 model saved as BF16 or FP16 rounds each value to nearest even
            (as torch's ``.to(torch.bfloat16)``).

    The metadata records the component's class, config, the mila_py version and the
    precision written (see :func:`checkpoint_metadata`).

    Raises:
        RuntimeError: before build (there are no parameters yet).
        TypeError, ValueError: ``precision`` is not a precision (nothing is written).
        OSError: the file cannot be written (no such folder, ``path`` is a folder, a full
            disk, ...); ``path`` is then as it was.
    """
    from safetensors.numpy import save_file

    if not component.is_built:
        raise RuntimeError(f"{component._describe()}: build it before save()")
    try:
        written = Precision.parse(component.precision if precision is None else precision)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{component._describe()}: save(precision=...): {exc}") from None
    dtype = written.numpy_dtype
    ctx = component.execution_context
    tensors = {
        name: np.ascontiguousarray(readable_on_host(ctx, p).astype(dtype, copy=False))
        for name, p in _named(component, "save")
    }
    metadata = checkpoint_metadata(component)
    metadata[PRECISION_KEY] = str(written)
    atomic_write(
        path,
        lambda temporary: save_file(tensors, os.fspath(temporary), metadata=metadata),
        who=component._describe(),
    )


def checkpoint_metadata(component: Any) -> dict[str, str]:
    """The safetensors metadata :func:`save` writes for ``component``: ``format``, its class
    name, its ``config`` as JSON (``null`` for a component without one) and the mila_py
    version. A config :func:`config_to_json` cannot express is left out, with a warning (a
    :func:`load` of the file then warns that it cannot check the config)."""
    metadata = {"format": "mila_py", CLASS_KEY: type(component).__name__}
    metadata[VERSION_KEY] = mila_py_version()
    try:
        metadata[CONFIG_KEY] = json.dumps(
            config_to_json(getattr(component, "config", None)), sort_keys=True
        )
    except TypeError as exc:
        warnings.warn(
            f"{component._describe()}: its config is not recorded in the checkpoint ({exc})",
            UserWarning,
            stacklevel=3,
        )
    return metadata


def config_to_json(config: Any) -> Any:
    """``config`` as a JSON-able value: a dataclass becomes ``{field: value}`` (nested ones
    too), an enum its value, a tuple, list or set a list (sets sorted), a mapping a dict with
    string keys, a NumPy scalar or array its Python value; None, bools, ints, floats and
    strings stay as they are.

    Raises:
        TypeError: a value of another type, naming where it sits (``LlamaConfig.rope_scaling
            ['fn']``).
    """
    return _to_json(config, type(config).__name__)


def _to_json(value: Any, where: str) -> Any:
    if isinstance(value, enum.Enum):  # before str and int: StrEnum and IntEnum are both
        return _to_json(value.value, where)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _to_json(getattr(value, f.name), f"{where}.{f.name}")
            for f in dataclasses.fields(value)
        }
    if isinstance(value, Mapping):
        return {str(k): _to_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, set | frozenset):
        return sorted((_to_json(v, f"{where}[...]") for v in value), key=repr)
    if isinstance(value, np.generic | np.ndarray):
        return _to_json(value.tolist(), where)
    raise TypeError(
        f"config_to_json: {where} is a {type(value).__name__} ({value!r}), which has no JSON "
        "form (expected dataclasses, enums, mappings, sequences, numbers, strings or None)"
    )


def mila_py_version() -> str:
    """``mila_py.__version__``, else the installed ``mila-py`` distribution's, else
    ``"unknown"``."""
    import mila_py

    version = getattr(mila_py, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version("mila-py")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


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


def load(component: Any, path: str | os.PathLike[str], *, check_config: bool = True) -> None:
    """Load parameters saved by :func:`save` (or any safetensors file with the same names).

    Tensors of another float dtype than the component's are converted to its dtype (a BF16
    file into an FP32 model exactly; an FP32 file into a BF16 model rounded to nearest even).

    The config the file records must equal the component's (every differing field is listed,
    with the tensors that do not fit); a file that records none (saved by an older mila_py, or
    elsewhere) loads with a warning that its config could not be checked. Every missing,
    unexpected or mis-shaped tensor is reported at once, and then nothing is loaded.

    Args:
        component: a built component.
        path: a safetensors file.
        check_config: False loads a file saved from another config whose tensors fit, on
            purpose (e.g. a longer ``max_seq_len`` or a RoPE scaling for a longer context).

    Raises:
        RuntimeError: before build (nothing to load into).
        FileNotFoundError: no file at ``path``.
        ValueError: listing every config difference and tensor mismatch, or a file that is not
            safetensors. The parameters are then unchanged.
    """
    if not component.is_built:
        raise RuntimeError(f"{component._describe()}: build it before load()")
    who = component._describe()
    with open_safetensors(path, who) as f:  # the header: names, dtypes, shapes, metadata
        metadata = f.metadata() or {}
        names = f.keys()  # (a safe_open handle is not iterable)
        slices = {name: f.get_slice(name) for name in names}
        found: dict[str, Any] = {
            name: _Stored(tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()
        }
    expected = {name for name, _ in _named(component, "load")}
    differences: list[str] = []
    unchecked = None
    if check_config:
        differences, unchecked = _config_differences(component, metadata)
    if differences:
        raise ValueError(
            f"{who}: cannot load {os.fspath(path)}: it was saved from a "
            f"{metadata.get(CLASS_KEY) or 'component'} of another config (by mila_py "
            f"{metadata.get(VERSION_KEY) or '?'}); nothing was loaded:\n  "
            + "\n  ".join(differences + _problems(component, found))
            + "\n(load(path, check_config=False) loads its tensors anyway where they fit)"
        )
    wanted = [n for n, s in found.items() if n in expected and s.dtype in _NUMPY_READABLE]
    # only the tensors that can be loaded are read; the others are reported from the header
    found.update(read_safetensors(path, who, wanted))
    assign_parameters(component, found, f"cannot load {os.fspath(path)}")
    if unchecked is not None:  # said once the load went through (a refusal says enough)
        warnings.warn(
            f"{who}: loaded {os.fspath(path)}, but its config could not be checked: {unchecked}",
            UserWarning,
            stacklevel=3,  # the caller of Component.load
        )


def _config_differences(
    component: Any, metadata: Mapping[str, str]
) -> tuple[list[str], str | None]:
    """``"config <field>: saved <value>, this model has <value>"`` for every field where the
    config ``metadata`` records differs from ``component``'s, and why the config could not be
    checked (None where it was): the file records none, or the component's config has no JSON
    form."""
    saved_text = metadata.get(CONFIG_KEY)
    if saved_text is None:
        return [], (
            "the file does not record the config it was saved from (saved by an older "
            "mila_py, or not by mila_py); only the tensors' names and shapes were"
        )
    try:
        saved = json.loads(saved_text)
    except json.JSONDecodeError as exc:
        return [
            f"config: the file's {CONFIG_KEY} metadata is not JSON ({exc}): {saved_text!r}"
        ], None
    try:  # through JSON and back, as the saved one went: tuples are lists, keys strings
        mine = json.loads(json.dumps(config_to_json(getattr(component, "config", None))))
    except TypeError as exc:
        return [], str(exc)
    differences = _differences(saved, mine, "")
    saved_class = metadata.get(CLASS_KEY)
    if differences and saved_class not in (None, type(component).__name__):
        differences.insert(
            0, f"class: saved {saved_class}, this model is a {type(component).__name__}"
        )
    return differences, None


def _differences(saved: Any, mine: Any, where: str) -> list[str]:
    """Every leaf where two JSON values differ, dicts compared key by key."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        out = []
        for key in sorted(saved.keys() | mine.keys()):
            at = f"{where}.{key}" if where else key
            if key not in mine:
                out.append(f"config {at}: saved {json.dumps(saved[key])}, this model has none")
            elif key not in saved:
                out.append(f"config {at}: not saved, this model has {json.dumps(mine[key])}")
            else:
                out += _differences(saved[key], mine[key], at)
        return out
    if _same(saved, mine):
        return []
    return [
        f"config {where or '(whole)'}: saved {json.dumps(saved)}, this model has {json.dumps(mine)}"
    ]


def _same(a: Any, b: Any) -> bool:
    """JSON values equal, NaN equal to NaN, a bool never equal to a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


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


#: safetensors dtypes of floats NumPy reads
_FLOAT_NAMES = frozenset({"F64", "F32", "F16", "BF16"})


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
    problems = _problems(component, tensors)
    if problems:
        raise ValueError(
            f"{component._describe()}: {what}; nothing was loaded:\n  " + "\n  ".join(problems)
        )
    ctx = component.execution_context
    for name, p in _named(component, "load"):
        value = tensors[name]
        if ctx.is_device_array(value):  # already on the device (np.asarray refuses CuPy's)
            p[...] = value.astype(p.dtype, copy=False)
        else:
            p[...] = ctx.to_device(np.asarray(value).astype(p.dtype, copy=False))


def _problems(component: Any, tensors: Mapping[str, Any]) -> list[str]:
    """Every missing, unexpected, mis-shaped, non-float or non-array value of ``tensors``
    for ``component``'s parameters (values may be header entries of a file, not read)."""
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
        elif not (
            array.dtype in _FLOAT_NAMES if isinstance(array, _Stored) else _is_float(array.dtype)
        ):
            problems.append(f"dtype of {name}: {array.dtype} is not a float type")
    return problems


def _is_float(dtype: Any) -> bool:
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # a safetensors name NumPy has not (F8_E4M3, ...)
        return False
    return bool(np.issubdtype(dtype, np.floating)) or dtype == ml_dtypes.bfloat16
