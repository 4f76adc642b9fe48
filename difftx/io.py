"""File helpers every layer uses, at the bottom of the package (it imports nothing from difftx):

- :func:`atomic_write`: a file is written whole or not at all;
- :func:`dumps_strict`: strict JSON out (no NaN or Infinity);
- :func:`read_json`: JSON in, with one error wording for a missing or corrupt file;
- :func:`eval_mode`: a model in eval mode for the length of a block, then back in its mode;
- :func:`open_lock_file`: a lock file opened (or created) without following a symbolic link.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

PathLike = Union[str, os.PathLike]


def umask_mode(folder: bool = False) -> int:
    """The mode a plain ``open`` / ``mkdir`` would give under the process's umask (``0o666`` /
    ``0o777`` less the umask). ``tempfile`` creates owner-only files and folders; the atomic
    writers chmod their results to this so colleagues can read checkpoints as the umask allows."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def open_lock_file(path: PathLike) -> int:
    """A file descriptor (read-write) on the lock file ``path``, created if missing. A symbolic link
    there is never followed (its target could be anyone's file, and lock files are truncated and
    rewritten): ``FileExistsError`` whose ``strerror`` says to remove the link."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise FileExistsError(e.errno, "a symbolic link, which is not followed; remove it", str(path)) from None
        raise


def _likely_write_errno(path: PathLike) -> Optional[int]:
    """Why a write under ``path`` failed when the error does not say: a (nearly) full disk, else a
    file-size limit on this process, else ``None``."""
    import errno

    folder = next((p for p in Path(path).parents if p.is_dir()), Path("."))
    try:
        fs = os.statvfs(folder)
        if fs.f_bavail * fs.f_frsize < 1 << 20:
            return errno.ENOSPC
    except (OSError, AttributeError):
        pass
    try:
        import resource

        if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
            return errno.EFBIG
    except (ImportError, OSError, ValueError):
        pass
    return None


def write_error(e: BaseException, path: PathLike) -> Optional[OSError]:
    """``e`` as an :class:`OSError` naming ``path`` and the cause (the errno text: "No space left on
    device", "File too large", ...), if it is a failed write: an ``OSError`` (full disk, file too
    large, read-only, no permission) or the ``RuntimeError`` that ``torch.save`` / safetensors wrap
    one in (``unexpected pos``, ``Os { code: N``); else ``None``."""
    if isinstance(e, OSError):
        return OSError(e.errno, e.strerror or str(e), str(path))
    if isinstance(e, RuntimeError) or type(e).__name__ == "SafetensorError":
        text = str(e)
        found = re.search(r"Os \{ code: (\d+)", text)
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code), str(path))
        if "unexpected pos" in text or "inline_container" in text:  # torch.save hides the errno: look for it
            code = _likely_write_errno(path)
            return OSError(code, (os.strerror(code) if code else "the write failed") + " (torch.save: unexpected pos)",
                           str(path))
    return None


def atomic_write(path: PathLike, write: Callable[[str], Any]) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``: readers never see a partial file, and
    when ``write`` raises, the file at ``path`` stays as it was. The file gets the permissions
    the umask allows (:func:`umask_mode`), not ``tempfile``'s 0600. A failed write (full disk, file
    too large, read-only, ...) is an :class:`OSError` naming ``path`` and the cause
    (:func:`write_error`)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(e.filename or path.parent)) from e
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, umask_mode())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        if isinstance(e, OSError) and e.filename is not None and os.fspath(e.filename) != tmp:
            raise  # another file's error (a source being copied): it names that file
        failed = write_error(e, path)
        if failed is None:
            raise
        raise failed from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _strict(obj: Any, reasons: dict, path: str = "") -> Any:
    """A copy of ``obj`` with every non-finite float replaced by ``None`` (its path and value
    added to ``reasons``) and tuples made lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        reasons[path or "."] = f"not a finite number ({obj})"
        return None
    if isinstance(obj, dict):
        return {str(k): _strict(v, reasons, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v, reasons, f"{path}[{i}]") for i, v in enumerate(obj)]
    return obj


def dumps_strict(obj: Any, **kwargs) -> str:
    """Strict JSON text of ``obj``: non-finite numbers become ``null``, with the reason under
    ``null_reasons`` when ``obj`` is a dict."""
    reasons: dict = {}
    clean = _strict(obj, reasons)
    if reasons and isinstance(clean, dict):
        clean["null_reasons"] = {**clean.get("null_reasons", {}), **reasons}
    return json.dumps(clean, allow_nan=False, **kwargs)


def read_json(path: PathLike, what: str, *, error: type[Exception] = ValueError) -> Any:
    """The parsed JSON of ``path``, which should hold ``what`` ("the model config of a difftx
    checkpoint"). A missing file or one that is not JSON raises ``error`` (``ValueError`` unless
    given) naming the path and ``what``."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: not found; expected {what} here")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}); expected {what}") from None


@contextmanager
def eval_mode(model: Any) -> Iterator[Any]:
    """``model`` in eval mode inside the block (dropout off), then back in the mode it had,
    whatever happens inside."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
