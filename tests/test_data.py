"""Token datasets: prepare_data's token file and sidecar, TokenDataset's epochs, sharding and
resume, and the ``mila-py prepare-data`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from mila_py.cli import build_parser, main
from mila_py.data import META_FILE, TOKENS_FILE, TokenDataset, prepare_data, read_meta

ROOT = Path(__file__).resolve().parents[1]


def write_tokenizer(folder: Path, words: list[str], eos: str | None = "</s>") -> Path:
    """A word-level tokenizer.json (ids in the order given, after [UNK] and </s>) and, with
    ``eos``, a tokenizer_config.json naming it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if eos is not None:
        config = {"eos_token": {"content": eos, "special": True}}
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def texts(tmp_path: Path, *contents: bytes) -> list[Path]:
    paths = []
    for i, content in enumerate(contents):
        path = tmp_path / f"doc{i}.txt"
        path.write_bytes(content)
        paths.append(path)
    return paths


def test_byte_level_ids_are_the_bytes_in_uint16(tmp_path: Path) -> None:
    files = texts(tmp_path, "héllo\n".encode(), b"\x00\xff world")
    out = prepare_data(None, tmp_path / "out", files)
    meta = json.loads((out / META_FILE).read_text(encoding="utf-8"))
    tokens = np.fromfile(out / TOKENS_FILE, dtype=np.uint16)
    expected = b"".join(f.read_bytes() for f in files)
    np.testing.assert_array_equal(tokens, np.frombuffer(expected, np.uint8))
    assert meta["dtype"] == "uint16" and meta["count"] == len(expected)
    assert meta["vocab_size"] == 256 and meta["eos_token_id"] is None
    assert meta["documents"] == [[0, 7], [7, len(expected)]]  # no separator without an eos
    assert read_meta(out / TOKENS_FILE) == meta


def test_a_tokenizer_encodes_each_document_and_puts_its_eos_between(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    folder = write_tokenizer(tmp_path / "tok", ["the", "cat", "sat", "dog"])
    files = texts(tmp_path, b"the cat sat", b"the dog", b"cat cat unknown")
    out = prepare_data(folder, tmp_path / "out", files)
    meta = read_meta(out)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    expected: list[int] = []
    for i, f in enumerate(files):
        if i:
            expected.append(eos)
        expected += tok.encode(f.read_text(), add_special_tokens=False).ids
    tokens = np.memmap(out / TOKENS_FILE, dtype=meta["dtype"], mode="r")
    assert tokens.tolist() == expected
    assert meta["eos_token_id"] == eos and meta["vocab_size"] == 6
    assert meta["documents"] == [[0, 3], [4, 6], [7, 10]]
    # an eos given explicitly wins over tokenizer_config.json; none without one
    out = prepare_data(folder, tmp_path / "explicit", files, eos_token="[UNK]")
    assert read_meta(out)["eos_token_id"] == 0
    bare = write_tokenizer(tmp_path / "bare", ["the", "cat", "sat", "dog"], eos=None)
    assert read_meta(prepare_data(bare, tmp_path / "bare_out", files))["count"] == 8


def test_a_vocabulary_over_65536_ids_is_stored_as_uint32(tmp_path: Path) -> None:
    words = [f"w{i}" for i in range(70_000)]
    folder = write_tokenizer(tmp_path / "big", words)
    files = texts(tmp_path, b"w0 w69999 w65535", b"w1")
    meta = read_meta(prepare_data(folder, tmp_path / "out", files))
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    tokens = np.fromfile(tmp_path / "out" / TOKENS_FILE, dtype=np.uint32)
    assert tokens.tolist() == [2, 70_001, 65_537, 1, 3]  # ids above 65535 kept whole
    small = write_tokenizer(tmp_path / "small", words[: 65_536 - 2])  # 65536 ids: uint16
    assert read_meta(prepare_data(small, tmp_path / "small_out", files[1:]))["dtype"] == "uint16"


def test_a_failed_prepare_leaves_the_old_output_whole(tmp_path: Path) -> None:
    folder = write_tokenizer(tmp_path / "tok", ["a", "b"])
    good = texts(tmp_path, b"a b a")
    out = prepare_data(folder, tmp_path / "out", good)
    before = {name: (out / name).read_bytes() for name in (TOKENS_FILE, META_FILE)}
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a \xff\xfe b")  # not UTF-8: fails after the first file was written
    with pytest.raises(ValueError, match=r"bad\.txt is not UTF-8 text"):
        prepare_data(folder, out, [*good, bad])
    assert {name: (out / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(out)) == sorted(before)  # no temporary file left
    with pytest.raises(FileNotFoundError, match=r"missing\.txt is not a file"):
        prepare_data(None, out, [tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match="no input files"):
        prepare_data(None, out, [])
    with pytest.raises(ValueError, match="has no token"):
        prepare_data(folder, out, good, eos_token="<|end|>")


def dataset_folder(tmp_path: Path, n_tokens: int) -> Path:
    """A byte-level token folder of ``n_tokens`` pseudo-random bytes."""
    data = np.random.default_rng(7).integers(0, 256, n_tokens, dtype=np.uint8).tobytes()
    (tmp_path / "corpus.bin").write_bytes(data)
    return prepare_data(None, tmp_path / "tokens", [tmp_path / "corpus.bin"])


def test_batches_are_windows_of_the_file_and_their_next_tokens(tmp_path: Path) -> None:
    folder = dataset_folder(tmp_path, 1000)
    ds = TokenDataset(folder, seq_len=9, batch_size=3, seed=5)
    tokens = np.fromfile(folder / TOKENS_FILE, dtype=np.uint16).astype(np.int32)
    assert ds.windows == 100
    for _ in range(4):
        windows = ds.window_indices()
        x, y = ds.next_batch()
        assert x.shape == y.shape == (3, 9) and x.dtype == y.dtype == np.int32
        for row, w in enumerate(windows):
            np.testing.assert_array_equal(x[row], tokens[w * 10 : w * 10 + 9])
            np.testing.assert_array_equal(y[row], tokens[w * 10 + 1 : w * 10 + 10])


@pytest.mark.parametrize(("windows", "batch", "world"), [(60, 2, 3), (50, 3, 4), (7, 2, 2)])
def test_the_ranks_cover_every_window_once_per_epoch(
    tmp_path: Path, windows: int, batch: int, world: int
) -> None:
    """Rank r takes rows [r B, (r + 1) B) of each global batch; over the steps that take
    ``k`` epochs' worth of windows, each window comes exactly ``k`` times, and within one
    epoch's part of the stream exactly once."""
    seq = 4
    folder = dataset_folder(tmp_path, windows * (seq + 1) + 3)  # 3 tokens too few for another
    ranks = [
        TokenDataset(folder, seq, batch, seed=11, rank=r, world_size=world) for r in range(world)
    ]
    steps = np.lcm(windows, batch * world) // (batch * world)
    stream: list[int] = []
    for _ in range(steps):
        for ds in ranks:
            stream += ds.window_indices().tolist()
            ds.next_batch()
    epochs = len(stream) // windows
    for e in range(epochs):
        assert sorted(stream[e * windows : (e + 1) * windows]) == list(range(windows))
    assert all(ds.epoch == epochs and ds.position == 0 for ds in ranks)
    # the same stream as one rank with the global batch: sharding changes no order
    whole = TokenDataset(folder, seq, batch * world, seed=11)
    alone = []
    for _ in range(steps):
        alone += whole.window_indices().tolist()
        whole.next_batch()
    assert alone == stream


def test_the_order_depends_on_the_seed_and_the_epoch(tmp_path: Path) -> None:
    folder = dataset_folder(tmp_path, 2000)
    order: dict[int, list[list[int]]] = {0: [], 1: []}
    for seed in order:
        ds = TokenDataset(folder, 19, 100, seed=seed)  # one batch per epoch
        for _ in range(2):
            order[seed].append(ds.window_indices().tolist())
            ds.next_batch()
    again = TokenDataset(folder, 19, 100, seed=0)
    assert again.window_indices().tolist() == order[0][0]
    assert order[0][0] != order[1][0] and order[0][0] != order[0][1]
    assert sorted(order[0][0]) == list(range(100))


def test_a_loaded_state_continues_exactly_across_an_epoch(tmp_path: Path) -> None:
    folder = dataset_folder(tmp_path, 700)
    ds = TokenDataset(folder, 9, 4, seed=3)  # 70 windows: the 18th batch straddles epochs
    for _ in range(15):
        ds.next_batch()
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["epoch"] == 0 and state["position"] == 60
    expected = [ds.next_batch() for _ in range(10)]
    resumed = TokenDataset(folder, 9, 4, seed=3)
    resumed.load_state_dict(state)
    for x, y in expected:
        u, v = resumed.next_batch()
        np.testing.assert_array_equal(u, x)
        np.testing.assert_array_equal(v, y)
    assert resumed.epoch == ds.epoch == 1
    # another batch size and rank count go on from the same global position
    wider = TokenDataset(folder, 9, 2, seed=3, rank=1, world_size=2)
    wider.load_state_dict(state)
    first = TokenDataset(folder, 9, 4, seed=3)
    first.load_state_dict(state)
    np.testing.assert_array_equal(wider.next_batch()[0], first.next_batch()[0][2:])


def test_a_state_of_other_data_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    folder = dataset_folder(tmp_path, 700)
    ds = TokenDataset(folder, 9, 4, seed=3)
    ds.next_batch()
    for other, field in (
        (TokenDataset(folder, 9, 4, seed=4), "seed: saved 4"),
        (TokenDataset(folder, 6, 4, seed=3), "seq_len: saved 6"),
    ):
        with pytest.raises(ValueError, match="nothing was loaded") as error:
            ds.load_state_dict(other.state_dict())
        assert field in str(error.value)
    bad = ds.state_dict()
    bad["position"] = 70
    with pytest.raises(ValueError, match=r"position: expected an int in \[0, 70\)"):
        ds.load_state_dict(bad)
    assert ds.position == 4


def test_a_token_file_must_agree_with_its_sidecar(tmp_path: Path) -> None:
    folder = dataset_folder(tmp_path, 100)
    with pytest.raises(ValueError, match="fewer than one window"):
        TokenDataset(folder, 100, 1)
    with open(folder / TOKENS_FILE, "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match="the pair was not written together"):
        TokenDataset(folder, 9, 1)
    with pytest.raises(FileNotFoundError, match=r"no tokens\.json"):
        TokenDataset(tmp_path, 9, 1)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        TokenDataset(folder, 9, 1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        TokenDataset(folder, 9, 0)


def test_the_command_line_prepares_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = texts(tmp_path, b"one two", b"three")
    assert main(["prepare-data", "--out", str(tmp_path / "out"), *map(str, files)]) == 0
    assert "12 tokens (uint16, vocabulary 256)" in capsys.readouterr().out
    assert read_meta(tmp_path / "out")["count"] == 12
    assert main(["prepare-data", "--out", str(tmp_path / "x"), str(tmp_path / "nope")]) == 1
    assert "mila-py prepare-data: " in capsys.readouterr().err
    folder = write_tokenizer(tmp_path / "tok", ["one", "two", "three"])
    args = build_parser().parse_args(
        ["prepare-data", "--tokenizer", str(folder), "--out", "o", "f"]
    )
    assert args.tokenizer == str(folder) and args.files == ["f"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mila_py", "prepare-data", "--tokenizer", str(folder), "--out",
         str(tmp_path / "module"), *map(str, files)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert read_meta(tmp_path / "module")["count"] == 4  # one two </s> three
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mila-py"] == "mila_py.cli:main"
