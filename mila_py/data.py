"""Token datasets: text tokenized once into a memory-mapped token file, read as batches.

:func:`prepare_data` tokenizes text files (with a Hugging Face ``tokenizer.json`` through the
``tokenizers`` library, or byte by byte) into ``tokens.bin`` (the ids, ``uint16`` where the
vocabulary has at most 65536 entries, else ``uint32``) and ``tokens.json`` (what the file
holds). :class:`TokenDataset` memory-maps the ids and serves ``[B, T]`` batches of
non-overlapping windows of ``T + 1`` tokens in a shuffled order that depends on the seed and
the epoch only, split between data-parallel ranks, with a state that resumes it exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mila_py.files import atomic_write_all

__all__ = ["META_FILE", "TOKENS_FILE", "TokenDataset", "prepare_data", "read_meta", "token_dtype"]

#: the ids, one after another, in the dtype the sidecar names
TOKENS_FILE = "tokens.bin"
#: the sidecar: ``format``, ``version``, ``dtype``, ``count``, ``vocab_size``,
#: ``eos_token_id``, ``tokenizer``, ``documents`` (``[start, stop)`` per input file), ``files``
META_FILE = "tokens.json"
_FORMAT = "mila_py.tokens"
_BYTE_LEVEL = "byte-level"
#: bytes read at once from a file tokenized byte by byte
_CHUNK = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` for a vocabulary of at most 65536 ids, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def prepare_data(
    tokenizer: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    files: Iterable[str | os.PathLike[str]],
    *,
    eos_token: str | None = None,
) -> Path:
    """Tokenize ``files`` into ``out_dir/tokens.bin`` and ``out_dir/tokens.json``.

    Each file is one document, read as UTF-8 text and encoded without special tokens; where
    the tokenizer has an end-of-sequence token (``eos_token``, else the ``eos_token`` of the
    tokenizer folder's ``tokenizer_config.json``), its id is put between documents. Without a
    tokenizer the ids are the files' bytes (0..255, no end-of-sequence id). Both files are
    written atomically, the sidecar last: a reader sees the old pair or the new one.

    Args:
        tokenizer: a folder holding ``tokenizer.json`` (or that file itself), or None for
            byte-level ids.
        out_dir: the output folder (created if missing).
        files: the text files, in order.
        eos_token: the end-of-sequence token's text, overriding ``tokenizer_config.json``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: no files, a file that is not UTF-8 text (with a tokenizer), an
            ``eos_token`` the tokenizer does not know, or an ``eos_token`` without a tokenizer.
        FileNotFoundError: a file, the tokenizer folder or its ``tokenizer.json`` is missing.
        OSError: the output cannot be written (then nothing in ``out_dir`` has changed).
    """
    paths = [Path(f) for f in files]
    if not paths:
        raise ValueError("prepare_data: no input files given")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"prepare_data: input {path} is not a file")
    encode, vocab_size, eos_id, name = _encoder(tokenizer, eos_token)
    dtype = token_dtype(vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    documents: list[list[int]] = []

    def write_tokens(temporary: Path) -> None:
        count = 0
        with open(temporary, "wb") as sink:
            for i, path in enumerate(paths):
                if i and eos_id is not None:
                    sink.write(np.array([eos_id], dtype).tobytes())
                    count += 1
                start = count
                for ids in encode(path):
                    sink.write(np.asarray(ids, dtype=dtype).tobytes())
                    count += len(ids)
                documents.append([start, count])

    def write_meta(temporary: Path) -> None:
        meta = {
            "format": _FORMAT,
            "version": 1,
            "dtype": dtype.name,
            "count": documents[-1][1] if documents else 0,
            "vocab_size": vocab_size,
            "eos_token_id": eos_id,
            "tokenizer": name,
            "documents": documents,
            "files": [str(p) for p in paths],
        }
        # one key a line, each value on its line (the document list can be long)
        lines = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items())
        temporary.write_text("{\n" + lines + "\n}\n", encoding="utf-8")

    try:
        atomic_write_all(
            [(out / TOKENS_FILE, write_tokens), (out / META_FILE, write_meta)], who="prepare_data"
        )
    except OSError as exc:
        if isinstance(exc.__cause__, ValueError):  # a bad input, not a failed write
            raise exc.__cause__ from None
        raise
    return out


def _encoder(tokenizer: Any, eos_token: str | None) -> tuple[Any, int, int | None, str]:
    """``(encode(path) -> iterable of id lists, vocab size, eos id or None, name)``."""
    if tokenizer is None:
        if eos_token is not None:
            raise ValueError(
                f"prepare_data: eos_token {eos_token!r} needs a tokenizer (byte-level ids have "
                "no end-of-sequence token)"
            )

        def encode_bytes(path: Path) -> Iterable[np.ndarray]:
            with open(path, "rb") as source:
                while chunk := source.read(_CHUNK):
                    yield np.frombuffer(chunk, dtype=np.uint8)

        return encode_bytes, 256, None, _BYTE_LEVEL
    from tokenizers import Tokenizer

    folder = Path(tokenizer)
    file = folder if folder.is_file() else folder / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"prepare_data: no tokenizer.json at {folder}")
    tok = Tokenizer.from_file(str(file))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if eos_token is None:
        eos_token = _configured_eos(file.parent)
    eos_id = None
    if eos_token is not None:
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"prepare_data: the tokenizer at {file} has no token {eos_token!r}")
        vocab_size = max(vocab_size, eos_id + 1)

    def encode_text(path: Path) -> Iterable[list[int]]:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"prepare_data: {path} is not UTF-8 text ({exc})") from None
        ids = tok.encode(text, add_special_tokens=False).ids
        if ids and max(ids) >= vocab_size:  # an id the sidecar's vocab_size would not hold
            raise ValueError(f"prepare_data: {path}: token id {max(ids)} >= vocab {vocab_size}")
        yield ids

    return encode_text, vocab_size, eos_id, str(folder)


def _configured_eos(folder: Path) -> str | None:
    """The ``eos_token`` of ``folder/tokenizer_config.json`` (a string or ``{"content": ...}``),
    or None."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"prepare_data: {config} is not a JSON object ({exc})") from None
    if isinstance(eos, Mapping):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The sidecar of a :func:`prepare_data` folder (or of its ``tokens.bin`` or
    ``tokens.json``), checked against the token file's size.

    Raises:
        FileNotFoundError: a file of the pair is missing.
        ValueError: the sidecar is not one of :func:`prepare_data`, or disagrees with the size.
    """
    return _read_meta(*_locate(path))


def _locate(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(tokens.bin, tokens.json)`` of a folder, or of either file of the pair."""
    path = Path(path)
    if path.is_dir():
        return path / TOKENS_FILE, path / META_FILE
    if path.suffix == ".json":
        return path.with_suffix(".bin"), path
    return path, path.with_suffix(".json")


class TokenDataset:
    """Batches of token windows from a :func:`prepare_data` folder, memory-mapped.

    The ids are cut into ``W = count // (seq_len + 1)`` non-overlapping windows of
    ``seq_len + 1`` tokens (inputs and their next-token targets). Epoch ``e`` visits every
    window once, in the order ``default_rng([seed, e]).permutation(W)``, so the order depends
    on the seed and the epoch only. The epochs follow one another as one stream of windows;
    each step takes the next ``batch_size * world_size`` of them (the global batch), and rank
    ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)`` of it. So every window is
    used exactly once per epoch across the ranks, a batch may straddle two epochs, and no
    window is dropped.

    The state (:meth:`state_dict`) is the global position in that stream, the same on every
    rank: a run resumed from it continues exactly, with the same or another batch size and
    number of ranks.

    Args:
        path: a :func:`prepare_data` folder, or its ``tokens.bin`` or ``tokens.json``.
        seq_len: ``T``, tokens per input row.
        batch_size: ``B``, rows per rank and step.
        seed: the shuffling seed (int >= 0).
        rank, world_size: this process's rank among ``world_size`` data-parallel ranks.

    Raises:
        FileNotFoundError: the token file or its sidecar is missing.
        ValueError: a bad argument, a sidecar that is not one of :func:`prepare_data`, a token
            file whose size disagrees with it, or fewer than ``seq_len + 1`` tokens.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        for name, value, least in (
            ("seq_len", seq_len, 1),
            ("batch_size", batch_size, 1),
            ("seed", seed, 0),
            ("world_size", world_size, 1),
            ("rank", rank, 0),
        ):
            if not _is_int(value) or value < least:
                raise ValueError(f"TokenDataset: {name} must be an int >= {least}, got {value!r}")
        if rank >= world_size:
            raise ValueError(f"TokenDataset: rank must be < world_size ({world_size}), got {rank}")
        tokens_path, meta_path = _locate(path)
        self.meta = _read_meta(tokens_path, meta_path)
        self.path = tokens_path
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        count = self.meta["count"]
        self.windows = count // (self.seq_len + 1)
        if self.windows == 0:
            raise ValueError(
                f"TokenDataset: {tokens_path} holds {count} tokens, fewer than one window of "
                f"seq_len + 1 = {self.seq_len + 1}"
            )
        tokens = np.memmap(
            tokens_path, dtype=np.dtype(self.meta["dtype"]), mode="r", shape=(count,)
        )
        # [W, T + 1]: window i is tokens[i * (T + 1) : (i + 1) * (T + 1)]
        self._rows = tokens[: self.windows * (self.seq_len + 1)].reshape(self.windows, -1)
        self._consumed = 0  # windows of the global stream taken so far, by all ranks
        self._orders: dict[int, np.ndarray] = {}

    @property
    def vocab_size(self) -> int:
        """The vocabulary size the sidecar records (ids are below it)."""
        return int(self.meta["vocab_size"])

    @property
    def eos_token_id(self) -> int | None:
        return self.meta["eos_token_id"]

    @property
    def epoch(self) -> int:
        """The epoch the next window comes from (0 first)."""
        return self._consumed // self.windows

    @property
    def position(self) -> int:
        """Windows of the current epoch already taken (by all ranks)."""
        return self._consumed % self.windows

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens of one :meth:`next_batch` (this rank's ``B * T``)."""
        return self.batch_size * self.seq_len

    def _order(self, epoch: int) -> np.ndarray:
        """``[W]`` the windows of ``epoch`` in visiting order (the last two epochs kept)."""
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return order

    def window_indices(self) -> np.ndarray:
        """``[B]`` the windows :meth:`next_batch` returns next on this rank (nothing moves)."""
        first = self._consumed + self.rank * self.batch_size
        stream = np.arange(first, first + self.batch_size)
        epochs, offsets = np.divmod(stream, self.windows)
        return np.array(
            [self._order(int(e))[int(k)] for e, k in zip(epochs, offsets, strict=True)],
            dtype=np.int64,
        )

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next batch of this rank, and one global step forward.

        Returns:
            ``(inputs [B, T] int32, targets [B, T] int32)``: ``targets[b, t]`` is the token
            after ``inputs[b, t]``.
        """
        rows = self._rows[self.window_indices()].astype(np.int32)  # [B, T + 1]
        self._consumed += self.batch_size * self.world_size
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "seed", "seq_len", "windows", "count", "batch_size",
        "world_size"}`` (JSON-able; the last two are informative: a resume may change them)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "windows": self.windows,
            "count": int(self.meta["count"]),
            "batch_size": self.batch_size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: it was saved from other data (another token count, ``seq_len`` or
                seed: its position would mean other windows), or a value is out of range;
                nothing has changed then.
        """
        self._consumed = self._parse_state(state)

    def _parse_state(self, state: Any) -> int:
        """The stream position ``state`` holds, checked against this dataset."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"TokenDataset: load_state_dict expects a mapping, got {type(state).__name__}"
            )
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ValueError(f"TokenDataset: cannot load the state: missing {missing}")
        mine = self.state_dict()
        problems = [
            f"{key}: saved {state[key]!r}, this dataset has {mine[key]!r}"
            for key in ("count", "seq_len", "windows", "seed")
            if state[key] != mine[key] or not _is_int(state[key])
        ]
        epoch, position = state["epoch"], state["position"]
        if not _is_int(epoch) or epoch < 0:
            problems.append(f"epoch: expected an int >= 0, got {epoch!r}")
        if not _is_int(position) or not 0 <= position < self.windows:
            problems.append(f"position: expected an int in [0, {self.windows}), got {position!r}")
        if problems:
            raise ValueError(
                f"TokenDataset {self.path}: cannot load the state (saved from other data or "
                "settings); nothing was loaded:\n  " + "\n  ".join(problems)
            )
        return int(epoch) * self.windows + int(position)

    def __repr__(self) -> str:
        return (
            f"TokenDataset({os.fspath(self.path)!r}, seq_len={self.seq_len}, batch_size="
            f"{self.batch_size}, seed={self.seed}, rank={self.rank}, world_size="
            f"{self.world_size}; {self.meta['count']} tokens, {self.windows} windows, epoch "
            f"{self.epoch}, position {self.position})"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _read_meta(tokens_path: Path, meta_path: Path) -> dict[str, Any]:
    """The sidecar, checked against the token file's size."""
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"TokenDataset: no {meta_path.name} beside {tokens_path} (write both with "
            "prepare_data or `mila-py prepare-data`)"
        )
    if not tokens_path.is_file():
        raise FileNotFoundError(f"TokenDataset: no token file {tokens_path}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"TokenDataset: {meta_path} is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(f"TokenDataset: {meta_path} is not a {_FORMAT} sidecar")
    dtype: Any = meta.get("dtype")
    count: Any = meta.get("count")
    vocab: Any = meta.get("vocab_size")
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"TokenDataset: {meta_path}: dtype {dtype!r}, expected uint16 or uint32")
    if not _is_int(count) or count < 0 or not _is_int(vocab) or vocab < 1:
        raise ValueError(
            f"TokenDataset: {meta_path}: count {count!r} and vocab_size {vocab!r} must be ints"
        )
    size = tokens_path.stat().st_size
    if size != count * np.dtype(dtype).itemsize:
        raise ValueError(
            f"TokenDataset: {tokens_path} has {size} bytes, but {meta_path.name} records "
            f"{count} {dtype} tokens ({count * np.dtype(dtype).itemsize} bytes): the pair was "
            "not written together"
        )
    meta.setdefault("eos_token_id", None)
    return meta
