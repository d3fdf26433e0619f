"""Checkpoint files that stay safe: a save never damages the file it replaces (a failure or a
kill mid-write leaves the old one whole), a Hugging Face folder is replaced all or nothing,
shard paths stay inside their folder, and a checkpoint records the config it was saved from,
which load checks (no transformers needed)."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import mila_py
from mila_py import BuildContext, RuntimeMode
from mila_py.files import atomic_write, atomic_write_all, atomic_write_text
from mila_py.interop import hf as hf_module
from mila_py.interop.hf import hf_weight_files, read_hf_checkpoint, save_hf_checkpoint
from mila_py.models import Llama, LlamaConfig
from mila_py.rope.config import RopeConfig
from mila_py.serialization import config_to_json

ROOT = Path(__file__).resolve().parents[1]

CFG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)


def built(cfg: LlamaConfig = CFG, shift: float = 0.0) -> Llama:
    """A TRAINING build of ``cfg`` whose parameters are moved by ``shift`` (so two models'
    files differ byte for byte)."""
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    for p in model.get_parameters():
        p += shift
    return model


def params(model: Llama) -> dict[str, bytes]:
    return {name: p.tobytes() for name, p in model.named_parameters()}


def half_then(error: BaseException) -> Any:
    """A stand-in for ``safetensors.numpy.save_file`` that writes the first half of the file
    it was asked for, then raises ``error`` (a full disk, a crash in the library)."""

    def save_half(tensors: Any, filename: Any, metadata: Any = None) -> None:
        data = safetensors.numpy.save(tensors, metadata=metadata)
        with open(filename, "wb") as fh:
            fh.write(data[: len(data) // 2])
        raise error

    return save_half


# ------------------------------------------------------------------ a save never damages
@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device"), RuntimeError("serializer crashed")]
)
def test_a_save_that_fails_halfway_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    path = tmp_path / "w.safetensors"
    built().save(path)
    old = path.read_bytes()
    monkeypatch.setattr(safetensors.numpy, "save_file", half_then(error))
    with pytest.raises(OSError, match=r"Llama 'llama': cannot write .*w\.safetensors") as info:
        built(shift=1.0).save(path)
    assert info.value.__cause__ is error
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["w.safetensors"]  # no temporary file left


def test_a_save_whose_rename_fails_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.safetensors"
    built().save(path)
    old = path.read_bytes()

    def refuse(src: Any, dst: Any) -> None:
        raise PermissionError(13, "Permission denied", os.fspath(dst))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match=r"cannot write .*w\.safetensors.*Permission denied"):
        built(shift=1.0).save(path)
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["w.safetensors"]


def test_a_save_replaces_the_file_whole_and_keeps_its_mode(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    os.umask(umask)
    path = tmp_path / "w.safetensors"
    built().save(path)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open(path, "w") makes it
    path.chmod(0o640)
    new = built(shift=1.0)
    new.save(path)
    assert os.listdir(tmp_path) == ["w.safetensors"]
    assert path.stat().st_mode & 0o777 == 0o640
    loaded = built()
    loaded.load(path)
    assert params(loaded) == params(new)


_KILLED_MID_SAVE = """
import shutil, sys, time
import safetensors.numpy
from mila_py import BuildContext, RuntimeMode
from mila_py.models import Llama, LlamaConfig

path, copy = sys.argv[1], sys.argv[2]
cfg = LlamaConfig(**{config})
model = Llama("llama", cfg, device="CPU")
model.build(BuildContext((1, 8), RuntimeMode.TRAINING))
model.save(path)
shutil.copyfile(path, copy)
for p in model.get_parameters():
    p += 1.0

def save_slowly(tensors, filename, metadata=None):
    data = safetensors.numpy.save(tensors, metadata=metadata)
    with open(filename, "wb") as fh:
        fh.write(data[: len(data) // 2])
        fh.flush()
    print("half written", flush=True)
    time.sleep(600)

safetensors.numpy.save_file = save_slowly
model.save(path)
"""


def test_a_process_killed_in_the_middle_of_save_leaves_the_old_file(tmp_path: Path) -> None:
    path, copy = tmp_path / "ckpt" / "w.safetensors", tmp_path / "good.safetensors"
    path.parent.mkdir()
    script = _KILLED_MID_SAVE.format(config=dataclasses.asdict(CFG))
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(path), str(copy)],
        cwd=ROOT,  # this checkout's mila_py
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the half is on disk, or the child ends
        assert line == "half written\n", child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert path.read_bytes() == copy.read_bytes()
    leftovers = [p for p in path.parent.iterdir() if p != path]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0  # the half went there
    model = built(shift=5.0)
    model.load(path)
    assert params(model) == {n: a.tobytes() for n, a in load_file(copy).items()}


def test_atomic_write_names_the_path_and_refuses_folders(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"writer: cannot write .*no-folder.*FileNotFoundError"):
        atomic_write_text(tmp_path / "no-folder" / "a.txt", "x", who="writer")
    with pytest.raises(OSError, match=r"writer: cannot write .*: it is a folder"):
        atomic_write_text(tmp_path, "x", who="writer")

    def interrupted(temporary: Path) -> None:
        temporary.write_text("partial")
        raise KeyboardInterrupt

    (tmp_path / "a.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):  # not turned into an OSError, but cleaned up
        atomic_write(tmp_path / "a.txt", interrupted, who="writer")
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]
    assert (tmp_path / "a.txt").read_text() == "old"


def test_atomic_write_all_puts_back_what_it_replaced_when_a_later_rename_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / name).write_text(f"old {name}")
    real = os.replace

    def refuse_c(src: Any, dst: Any) -> None:
        if Path(dst).name == "c":
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "replace", refuse_c)
    writes = [(tmp_path / n, lambda t, n=n: t.write_text(f"new {n}")) for n in ("a", "b", "c")]
    with pytest.raises(OSError, match=r"w: cannot write .*c \(OSError"):
        atomic_write_all(writes, who="w")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        "a": "old a",
        "b": "old b",
        "c": "old c",
    }


# ------------------------------------------------------------------ Hugging Face folders
def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_save_hf_checkpoint_that_fails_writing_weights_leaves_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    old_model = built()
    save_hf_checkpoint(old_model, path)
    before = folder_bytes(path)
    new_model = built(dataclasses.replace(CFG, rope_base=500000.0), shift=1.0)
    monkeypatch.setattr(safetensors.numpy, "save_file", half_then(OSError(28, "disk full")))
    with pytest.raises(OSError, match=r"save_hf_checkpoint: cannot write .*model\.safetensors"):
        save_hf_checkpoint(new_model, path)
    monkeypatch.undo()
    assert folder_bytes(path) == before  # no new config, no temporary file
    reloaded = Llama.from_pretrained(path)
    assert reloaded.config.rope_base == CFG.rope_base
    assert params(reloaded) == params(old_model)


def test_save_hf_checkpoint_that_fails_renaming_the_config_puts_the_weights_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    save_hf_checkpoint(built(), path)
    before = folder_bytes(path)
    real = os.replace

    def refuse_config(src: Any, dst: Any) -> None:
        if Path(dst).name == "config.json":
            raise PermissionError(13, "Permission denied")
        real(src, dst)

    monkeypatch.setattr(os, "replace", refuse_config)
    with pytest.raises(OSError, match=r"save_hf_checkpoint: cannot write .*config\.json"):
        save_hf_checkpoint(built(dataclasses.replace(CFG, max_seq_len=128), shift=1.0), path)
    assert folder_bytes(path) == before


def test_save_hf_checkpoint_replaces_a_checkpoint_whole(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save_hf_checkpoint(built(), path)
    (path / "notes.txt").write_text("{}")  # the folder's other files are left alone
    new_model = built(dataclasses.replace(CFG, rope_base=500000.0), shift=1.0)
    save_hf_checkpoint(new_model, path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "notes.txt"]
    reloaded = Llama.from_pretrained(path)
    assert reloaded.config.rope_base == 500000.0
    assert params(reloaded) == params(new_model)
    with pytest.raises(OSError, match="save_hf_checkpoint: cannot write"):
        save_hf_checkpoint(new_model, path / "notes.txt")  # a file, not a folder


# ------------------------------------------------------------------ shards stay inside
@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_hf_checkpoint(built(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def point_index_at(checkpoint: Path, shard: str) -> list[str]:
    """Replace the checkpoint's weights by an index mapping every tensor to ``shard``."""
    names = sorted(load_file(checkpoint / "model.safetensors"))
    (checkpoint / "model.safetensors").unlink()
    index = {"weight_map": dict.fromkeys(names, shard)}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    return names


@pytest.fixture
def elsewhere(checkpoint: Path) -> Path:
    """A valid weights file in a folder beside the checkpoint."""
    other = checkpoint.parent / "other"
    other.mkdir()
    save_file(load_file(checkpoint / "model.safetensors"), other / "model.safetensors")
    return other / "model.safetensors"


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files hf_weight_files opens."""
    calls: list[Path] = []
    real = hf_module.open_safetensors

    def record(path: Any, who: str) -> Any:
        calls.append(Path(path))
        return real(path, who)

    monkeypatch.setattr(hf_module, "open_safetensors", record)
    return calls


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "environ", "symlink"])
def test_shards_outside_the_folder_are_refused_before_anything_is_opened(
    checkpoint: Path, elsewhere: Path, opened: list[Path], kind: str
) -> None:
    shard = {
        "dotdot": "../other/model.safetensors",
        "absolute": str(elsewhere),
        "environ": "/proc/self/environ",
        "symlink": "shard-1.safetensors",
    }[kind]
    if kind == "symlink":
        (checkpoint / shard).symlink_to(elsewhere)
    names = point_index_at(checkpoint, shard)
    with pytest.raises(ValueError, match="outside the checkpoint folder") as info:
        hf_weight_files(checkpoint)
    assert f"{names[0]!r}" in str(info.value) and f"{shard!r}" in str(info.value)
    assert not opened
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        Llama.from_pretrained(checkpoint)


def test_a_single_weights_file_linking_outside_is_refused(
    checkpoint: Path, elsewhere: Path, opened: list[Path]
) -> None:
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(ValueError, match=r"'model\.safetensors' is a link to .*other"):
        hf_weight_files(checkpoint)
    assert not opened


def test_links_inside_the_folder_and_hub_cache_snapshots_are_followed(
    checkpoint: Path, tmp_path: Path
) -> None:
    (checkpoint / "sub").mkdir()
    (checkpoint / "model.safetensors").rename(checkpoint / "sub" / "weights.safetensors")
    (checkpoint / "model.safetensors").symlink_to(Path("sub") / "weights.safetensors")
    config, tensors = read_hf_checkpoint(checkpoint)
    # the Hugging Face hub cache: snapshots/<revision>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name, blob in (("config.json", "1f2e"), ("model.safetensors", "3d4c")):
        (repo / "blobs" / blob).write_bytes((checkpoint / name).read_bytes())
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    cached_config, cached = read_hf_checkpoint(snapshot)
    assert cached_config == config
    assert {n: a.tobytes() for n, a in cached.items()} == {
        n: a.tobytes() for n, a in tensors.items()
    }


# ------------------------------------------------------------------ a checkpoint's config
class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass(frozen=True)
class Inner:
    sizes: tuple[int, ...]
    colour: Colour


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    table: dict[Any, Any]
    scale: np.float32
    name: str | None = None


def test_config_to_json_handles_nested_dataclasses_enums_tuples_and_dicts() -> None:
    config = Outer(Inner((1, 2), Colour.RED), {"a": (3, Colour.RED), 4: None}, np.float32(0.5))
    as_json = config_to_json(config)
    assert as_json == {
        "inner": {"sizes": [1, 2], "colour": "red"},
        "table": {"a": [3, "red"], "4": None},
        "scale": 0.5,
        "name": None,
    }
    assert json.loads(json.dumps(as_json)) == as_json
    rope = RopeConfig(
        64, 4, 2, 128, base=5e5, layout="interleaved", scaling={"rope_type": "linear", "factor": 2}
    )
    rope_json = config_to_json(rope)
    assert rope_json["layout"] == "interleaved" and rope_json["base"] == 5e5
    assert rope_json["scaling"] == {"rope_type": "linear", "factor": 2}
    with pytest.raises(TypeError, match=r"Outer\.table\['f'\] is a function"):
        config_to_json(dataclasses.replace(config, table={"f": print_function}))


def print_function() -> None:
    """A value with no JSON form."""


def test_save_records_the_class_config_and_version(tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        CFG, rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_embeddings=True
    )
    built(cfg).save(tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", framework="numpy") as f:
        metadata = f.metadata()
    assert metadata["mila_py.class"] == "Llama"
    assert json.loads(metadata["mila_py.config"]) == config_to_json(cfg)
    assert metadata["mila_py.version"] == mila_py.__version__


@pytest.mark.parametrize(
    "changes",
    [
        {"n_heads": 8, "n_kv_heads": 4},  # the same shapes at dim 32
        {"rope_base": 500000.0},
        {"max_seq_len": 128},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    ],
    ids=["heads", "rope_base", "max_seq_len", "rope_scaling"],
)
def test_load_refuses_a_checkpoint_of_another_config_whose_shapes_agree(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    path = tmp_path / "w.safetensors"
    built().save(path)
    other_cfg = dataclasses.replace(CFG, **changes)
    other = built(other_cfg, shift=3.0)
    assert {n: p.shape for n, p in other.named_parameters()} == {
        n: a.shape for n, a in load_file(path).items()
    }
    before = params(other)
    with pytest.raises(
        ValueError, match=r"saved from a Llama of another config .*; nothing was loaded"
    ) as info:
        other.load(path)
    message = str(info.value)
    for field, value in changes.items():
        saved = json.dumps(config_to_json(getattr(CFG, field)))
        mine = json.dumps(config_to_json(value))
        assert f"config {field}: saved {saved}, this model has {mine}" in message
    listed = [line for line in message.splitlines() if line.startswith("  config ")]
    assert len(listed) == len(changes)  # those fields only
    assert params(other) == before  # bit for bit
    other.load(path, check_config=False)  # on purpose: the tensors fit
    assert params(other) == {n: a.tobytes() for n, a in load_file(path).items()}


def test_load_lists_scaling_fields_and_shape_mismatches_together(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    built(dataclasses.replace(CFG, rope_scaling={"rope_type": "linear", "factor": 2.0})).save(path)
    other = built(
        dataclasses.replace(CFG, hidden_dim=40, rope_scaling={"rope_type": "linear", "factor": 8})
    )
    with pytest.raises(ValueError) as info:
        other.load(path)
    message = str(info.value)
    assert "config hidden_dim: saved 48, this model has 40" in message
    assert "config rope_scaling.factor: saved 2.0, this model has 8" in message
    assert "shape of layer0.mlp.gate_proj.weight: got (48, 32), expected (40, 32)" in message


def test_a_file_without_a_recorded_config_loads_with_a_warning(tmp_path: Path) -> None:
    source = built(shift=2.0)
    save_file({n: p.copy() for n, p in source.named_parameters()}, tmp_path / "plain.safetensors")
    model = built()
    with pytest.warns(UserWarning, match="config could not be checked"):
        model.load(tmp_path / "plain.safetensors")
    assert params(model) == params(source)
    source.save(tmp_path / "own.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file with its config loads silently
        model.load(tmp_path / "own.safetensors")
