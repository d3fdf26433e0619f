"""Weight files that are missing, malformed or not what they claim: clear errors, in the order
a user can act on them, before anything is read or loaded (no transformers needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mila_py import BuildContext, RuntimeMode
from mila_py.interop import hf as hf_module
from mila_py.interop.hf import read_hf_checkpoint, save_hf_checkpoint
from mila_py.models import Llama, LlamaConfig

CFG = LlamaConfig(
    vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=24, max_seq_len=2048
)


def built(mode: RuntimeMode = RuntimeMode.TRAINING) -> Llama:
    model = Llama("llama", CFG, device="CPU")
    model.build(BuildContext((1, 8), mode))
    return model


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_hf_checkpoint(built(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def shard(path: Path) -> tuple[dict[str, str], list[str]]:
    """Split ``path``'s model.safetensors into two shards and an index; returns the weight map
    and the names in the second shard."""
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-1.safetensors": names[::2], "model-2.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map, halves["model-2.safetensors"]


def test_save_and_load_name_the_component_and_refuse_what_is_not_safetensors(
    tmp_path: Path,
) -> None:
    with pytest.raises(RuntimeError, match="build it before save"):
        Llama("llama", CFG, device="CPU").save(tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()
    model = built()
    before = [p.copy() for p in model.get_parameters()]
    (tmp_path / "junk").write_bytes(b"\x00" * 64)
    (tmp_path / "empty").write_bytes(b"")
    for path in (tmp_path / "junk", tmp_path / "empty"):
        with pytest.raises(ValueError, match=r"Llama 'llama'.*not a safetensors file"):
            model.load(path)
    with pytest.raises(FileNotFoundError, match=r"Llama 'llama'.*not a file"):
        model.load(tmp_path)  # a folder
    with pytest.raises(FileNotFoundError, match="not a file"):
        model.load(tmp_path / "nowhere.safetensors")
    for p, q in zip(model.get_parameters(), before, strict=True):
        np.testing.assert_array_equal(p, q)


def test_save_to_a_path_it_cannot_write_is_an_os_error(tmp_path: Path) -> None:
    model = built()
    with pytest.raises(OSError, match=r"Llama 'llama': cannot write"):
        model.save(tmp_path / "no-such-folder" / "w.safetensors")
    with pytest.raises(OSError, match="cannot write"):
        model.save(tmp_path)  # a folder


def test_load_reports_float8_and_unexpected_tensors_with_the_rest(tmp_path: Path) -> None:
    """A file holding a dtype NumPy has not (float8 scales of a quantized checkpoint) is
    reported with every other mismatch, from the header: nothing is loaded."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    model = built()
    before = {name: p.copy() for name, p in model.named_parameters()}
    tensors = {name: torch.from_numpy(p.copy()) for name, p in before.items()}
    first, second = list(tensors)[:2]
    tensors[first] = tensors[first].to(torch.float8_e4m3fn)  # expected, of an unreadable type
    tensors["weight_scale"] = torch.zeros(3, dtype=torch.float8_e4m3fn)  # unexpected
    del tensors[second]
    save_torch(tensors, str(tmp_path / "f8.safetensors"))
    with pytest.raises(ValueError, match="nothing was loaded") as info:
        model.load(tmp_path / "f8.safetensors")
    message = str(info.value)
    assert f"dtype of {first}: F8_E4M3 is not a float type" in message
    assert "unexpected: weight_scale" in message and f"missing: {second}" in message
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p, before[name])


def test_assign_parameters_reports_values_that_are_not_arrays() -> None:
    torch = pytest.importorskip("torch")
    from mila_py.serialization import assign_parameters

    model = built()
    values = {name: p.copy() for name, p in model.named_parameters()}
    first, second = list(values)[:2]
    values[first] = values[first].tolist()
    values[second] = torch.from_numpy(values[second])
    with pytest.raises(ValueError, match="nothing was loaded") as info:
        assign_parameters(model, values, "test")
    assert f"type of {first}: list is not an array" in str(info.value)
    assert f"type of {second}: a torch tensor" in str(info.value)


def test_from_pretrained_checks_config_and_arguments_before_reading_weights(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[object] = []
    real = hf_module.load_hf_files
    monkeypatch.setattr(
        hf_module, "load_hf_files", lambda model, files: read.append(1) or real(model, files)
    )
    config = json.loads((checkpoint / "config.json").read_text())
    bad_args = [
        {"batch_size": 0},
        {"seq_len": 0},  # not "the default"
        {"prefill_size": -3},
        {"seq_len": 10**6},
        {"device": "TPU"},
    ]
    for kwargs in bad_args:
        with pytest.raises(ValueError):
            Llama.from_pretrained(checkpoint, **kwargs)  # type: ignore[arg-type]
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(ValueError, match="gemma"):
        Llama.from_pretrained(checkpoint)
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        Llama.from_pretrained(checkpoint)
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a safetensors file"):
        Llama.from_pretrained(checkpoint)
    assert not read  # every refusal came before a tensor was read


def test_from_pretrained_chunks_long_contexts_by_default(checkpoint: Path) -> None:
    model = Llama.from_pretrained(checkpoint)
    assert model.context_length == 2048 and model.chunk_size == 512
    short = Llama.from_pretrained(checkpoint, seq_len=100)
    assert short.chunk_size == 100
    whole = Llama.from_pretrained(checkpoint, prefill_size=0)
    assert whole.chunk_size == 2048
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(1, 700))
    np.testing.assert_allclose(model.prefill(tokens), whole.prefill(tokens), rtol=1e-5, atol=1e-6)


def test_every_shard_problem_is_reported_at_once(checkpoint: Path) -> None:
    weight_map, second = shard(checkpoint)
    _, tensors = read_hf_checkpoint(checkpoint)
    assert set(tensors) == set(weight_map)
    # each shard loses one tensor its index maps to it
    for file in ("model-1.safetensors", "model-2.safetensors"):
        kept = load_file(checkpoint / file)
        lost = sorted(kept)[0]
        del kept[lost]
        save_file(kept, checkpoint / file)
    with pytest.raises(ValueError) as error:
        read_hf_checkpoint(checkpoint)
    message = str(error.value)
    assert "model-1.safetensors lacks" in message and "model-2.safetensors lacks" in message
    (checkpoint / "model-2.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"model-2\.safetensors is not a safetensors file"):
        read_hf_checkpoint(checkpoint)
    index = checkpoint / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": [second]}))
    with pytest.raises(ValueError, match=re.escape("no weight_map")):
        read_hf_checkpoint(checkpoint)
