"""Files written atomically: a reader of a path sees its old content or the new one, whole.

Each file is written to a temporary file beside it (same folder, so the rename cannot cross
file systems), flushed to disk, then renamed over the target with ``os.replace``, and the
folder is flushed so the rename survives a power cut. A failure at any point removes the
temporary file and leaves the target as it was; a process killed mid-write leaves at most a
hidden ``.<name>.<random>.tmp`` beside an intact target.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_all", "atomic_write_bytes", "atomic_write_text"]

#: writes a whole file at the path it is given (the temporary file, which exists, empty);
#: what it returns is ignored
Writer = Callable[[Path], object]

# errors a file system gives for fsync on a folder it cannot flush that way
_NO_FOLDER_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES}


def atomic_write(path: str | os.PathLike[str], write: Writer, *, who: str) -> None:
    """Write ``path`` through ``write(temporary path)``, then put it in place whole.

    Args:
        path: the file to create or replace.
        write: writes the whole content to the path it receives (a new, empty file in
            ``path``'s folder), e.g. ``lambda p: save_file(tensors, p)``.
        who: the function or component, for the error message.

    Raises:
        OSError: ``"<who>: cannot write <path> (...)"`` for any failure (the original
            exception chained); ``path`` is then unchanged and no temporary file is left.
    """
    atomic_write_all([(path, write)], who=who)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, who: str) -> None:
    """:func:`atomic_write` of ``data``."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data), who=who)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, who: str) -> None:
    """:func:`atomic_write` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"), who=who)


def atomic_write_all(files: Sequence[tuple[str | os.PathLike[str], Writer]], *, who: str) -> None:
    """Write several files, all or nothing: every one is written and flushed to a temporary
    file first, and only then are they renamed into place, in the order given (so a reader
    that checks the last one, e.g. a ``config.json``, finds the others already new).

    A failure while writing changes no target. A failure while renaming puts back the targets
    already replaced (each old file is kept through a hard link until the end; on a file
    system without hard links a replaced file cannot be put back, and the error says so).

    Args:
        files: ``(path, write)`` pairs, as for :func:`atomic_write`; distinct paths.
        who: the function or component, for the error messages.

    Raises:
        OSError: ``"<who>: cannot write <path> (...)"`` naming the file that failed.
        ValueError: one path given twice (nothing is written).
    """
    targets = [Path(path) for path, _ in files]
    if len({os.path.abspath(t) for t in targets}) != len(targets):
        raise ValueError(f"{who}: atomic_write_all got one path twice: {targets}")
    for target in targets:
        if target.is_dir():
            raise OSError(f"{who}: cannot write {target}: it is a folder")
    staged: list[tuple[Path, Path]] = []  # (temporary, target)
    try:
        for target, (_, write) in zip(targets, files, strict=True):
            try:
                temporary, new_mode = _temporary(target)
                staged.append((temporary, target))
                write(temporary)
                _sync_file(temporary, target, new_mode)
            except Exception as exc:
                raise _error(who, target, exc) from exc
        _commit(staged, who)
    except BaseException:
        for temporary, _ in staged:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
        raise
    for folder in dict.fromkeys(t.parent for t in targets):
        _sync_folder(folder, who)


def _error(who: str, target: Path, exc: BaseException) -> OSError:
    return OSError(f"{who}: cannot write {target} ({type(exc).__name__}: {exc})")


def _temporary(target: Path) -> tuple[Path, int]:
    """A new empty file beside ``target``, and the mode it was created with: the one a new
    file gets here (0o666 less the umask)."""
    while True:
        temporary = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            return temporary, stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)


def _sync_file(temporary: Path, target: Path, new_mode: int) -> None:
    """Flush ``temporary`` to disk and give it ``target``'s mode, or ``new_mode`` where there
    is no ``target`` yet (after the write: a writer may have replaced the file with one of
    its own mode, and the mode may forbid writing)."""
    fd = os.open(temporary, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = new_mode
    os.chmod(temporary, mode)


def _commit(staged: list[tuple[Path, Path]], who: str) -> None:
    """Rename each temporary over its target; on a failure put back those already done."""
    done: list[tuple[Path, Path | None, bool]] = []  # (target, old kept as, target existed)
    try:
        for temporary, target in staged:
            existed = target.exists()
            kept = _keep(target) if existed and len(staged) > 1 else None
            try:
                os.replace(temporary, target)
            except Exception as exc:
                if kept is not None:
                    kept.unlink()
                raise _error(who, target, exc) from exc
            done.append((target, kept, existed))
    except BaseException as error:  # an interrupt too: put back what was replaced
        lost = _put_back(done)
        if lost:
            raise OSError(
                f"{error}; already replaced and not restorable (no hard links on this file "
                f"system): {', '.join(str(t) for t in lost)}"
            ) from (error.__cause__ or error)
        raise
    finally:
        for _, kept, _ in done:
            if kept is not None:
                with contextlib.suppress(FileNotFoundError):
                    kept.unlink()


def _keep(target: Path) -> Path | None:
    """A hard link to ``target``'s current file (None where the file system has none)."""
    while True:
        kept = target.with_name(f".{target.name}.{secrets.token_hex(6)}.old")
        try:
            os.link(target, kept)
        except FileExistsError:
            continue
        except OSError:
            return None
        return kept


def _put_back(done: list[tuple[Path, Path | None, bool]]) -> list[Path]:
    """Undo the renames of ``done`` (latest first); the targets that could not be restored."""
    lost = []
    for target, kept, existed in reversed(done):
        try:
            if kept is not None:
                os.replace(kept, target)
            elif not existed:
                target.unlink()
            else:
                lost.append(target)
        except OSError:
            lost.append(target)
    return lost


def _sync_folder(folder: Path, who: str) -> None:
    """Flush ``folder``'s entries (the renames) to disk where the platform allows it."""
    if os.name != "posix":
        return
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        if exc.errno in _NO_FOLDER_SYNC:
            return
        raise OSError(f"{who}: cannot flush folder {folder} ({exc})") from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_FOLDER_SYNC:
            raise OSError(f"{who}: cannot flush folder {folder} ({exc})") from exc
    finally:
        os.close(fd)
