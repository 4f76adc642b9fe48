"""File helpers every layer uses, at the bottom of the package (it imports nothing from difftx):

- :func:`atomic_write`: a file is written whole or not at all;
- :func:`atomic_folder`: a folder is written whole or not at all, staged beside its place;
- :func:`write_json`: a JSON file written with :func:`atomic_write`;
- :func:`pid_alive`: whether a process of this host still runs;
- :func:`dumps_strict`: strict JSON out (no NaN or Infinity);
- :func:`read_json`: JSON in, with one error wording for a missing or corrupt file;
- :func:`read_record` / :func:`check_record`: a run file (a JSON object) whose fields are checked
  against a declared type, the file and the field named on a mismatch;
- :func:`seal` / :func:`unsealed`: a JSON object carrying the SHA-256 of its own content, checked on read;
- :func:`eval_mode`: a model in eval mode for the length of a block, then back in its mode;
- :func:`open_lock_file`: a lock file opened (or created) without following a symbolic link;
- :func:`own_folder`: a folder difftx names inside an output folder, made real (a symbolic link there
  is replaced, never written through).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

PathLike = Union[str, os.PathLike]

# what marks difftx's work in a folder (a file or folder of this name), and what it marks
RUN_MARKERS = {"train_config.json": "a training run", "checkpoints": "a training run",
               "metrics.jsonl": "a training run"}
WORK_MARKERS = {**RUN_MARKERS, "compare.json": "a comparison", "results.json": "a comparison",
                "train.json": "a comparison's model", "scale.json": "a scale study", "map.json": "a regime map"}
MODEL_MARKERS = {"config.json": "a model", "model.safetensors": "a model"}


def work_marker(folder: PathLike, markers: dict = WORK_MARKERS, below: bool = True) -> Optional[tuple[str, str]]:
    """The first of ``markers`` in ``folder`` (and, with ``below``, at any depth under it): its path relative to
    ``folder`` and what it marks; None where there is none (or no folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs) + sorted(files):
            if name in markers:
                return str((Path(root) / name).relative_to(folder)), markers[name]
        if not below:
            break
    return None


def umask_mode(folder: bool = False) -> int:
    """The mode a plain ``open`` / ``mkdir`` would give under the process's umask (``0o666`` /
    ``0o777`` less the umask). ``tempfile`` creates owner-only files and folders; the atomic
    writers chmod their results to this so colleagues can read checkpoints as the umask allows."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (one that exists but is not ours counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


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


def own_folder(path: PathLike, *, below: Optional[PathLike] = None) -> Path:
    """``path``, a folder difftx names inside an output folder (``plots``, ``evals``, ``checkpoints``,
    ``tune/...``, ``seed0/diff`` ...), created where missing and never a symbolic link: a link there
    (to anyone's folder) is removed and a real folder made in its place, with a one-line notice on
    stderr; the link's target is left as it was. Every folder from ``below`` (exclusive; the output
    folder the user gave, which may itself be a link) down to ``path`` is owned this way; without
    ``below`` only ``path`` itself is. Files are safe already: :func:`atomic_write` renames over a
    link at a file's name, replacing the link, not its target."""
    import sys

    path = Path(path)
    top = path.parent if below is None else Path(below)
    try:
        parts = path.relative_to(top).parts
    except ValueError:
        raise ValueError(f"own_folder: {path} is not inside {top}") from None
    top.mkdir(parents=True, exist_ok=True)
    here = top
    for part in parts:
        here = here / part
        if here.is_symlink():
            try:
                target = os.readlink(here)
                os.unlink(here)
            except FileNotFoundError:  # another writer (a shard) replaced it first
                target = None
            if target is not None:
                print(f"{here}: was a symbolic link (to {target}); replaced by a folder of its own, the link's "
                      "target left as it was (difftx never writes through a link in its output folders)",
                      file=sys.stderr, flush=True)
        try:
            here.mkdir(exist_ok=True)
        except FileExistsError:  # a file at a folder's name
            raise FileExistsError(f"{here}: a file where difftx writes a folder; move it away") from None
    return path


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


def write_json(path: PathLike, data: Any, *, indent: int = 1, sort_keys: bool = True) -> Path:
    """Write ``data`` as JSON (``indent``, keys sorted unless ``sort_keys=False``, a final
    newline) to ``path`` with :func:`atomic_write`; returns ``path``."""
    path = Path(path)
    text = json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n"
    atomic_write(path, lambda p: Path(p).write_text(text))
    return path


def _fsync_dir(path: PathLike) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the platform allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


STALE_SECONDS = 24 * 3600  # a staging folder of another host's writer is stale after a day
_STAGING_WRITER = re.compile(r"\.(?:tmp|old)-(\d+)@([^@]+)@[^@]*$")


def _staging(out: Path, kind: str) -> Path:
    """A new, empty staging folder ``.<out name>.<kind>-<pid>@<host>@<random>`` beside ``out``:
    its name says which process writes it (see :func:`staging_is_stale`)."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-{os.getpid()}@{socket.gethostname()}@",
                                 dir=out.parent))


def staging_is_stale(folder: PathLike) -> bool:
    """Whether the staging folder ``folder`` (made by :func:`atomic_folder`) was left by a writer
    that is gone: its name names a process of this host that no longer runs, or a process of
    another host and the folder is older than :data:`STALE_SECONDS`, or no process at all."""
    folder = Path(folder)
    found = _STAGING_WRITER.search(folder.name)
    if found is None:
        return True
    pid, host = int(found.group(1)), found.group(2)
    if host == socket.gethostname():
        return not pid_alive(pid)
    try:
        return time.time() - folder.stat().st_mtime > STALE_SECONDS
    except OSError:
        return False


def remove_stale_staging(parent: PathLike, name: str = "*") -> None:
    """Remove the staging folders of ``name`` (every name by default) in ``parent`` that
    :func:`staging_is_stale` finds stale."""
    for kind in ("tmp", "old"):
        for folder in Path(parent).glob(f".{name}.{kind}-*"):
            if folder.is_dir() and staging_is_stale(folder):
                shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def atomic_folder(out: PathLike, *, replace: bool = False,
                  kept: Optional[Callable[[Path], bool]] = None) -> Iterator[Path]:
    """A new folder beside ``out`` to write into, renamed to ``out`` when the block ends without
    error: ``out`` is complete or absent, never half-written. On an error (or Ctrl-C) the staging
    folder is removed and the error raised. The folder gets the mode the umask allows
    (:func:`umask_mode`), not ``tempfile``'s owner-only one; it and ``out``'s parent are synced
    after the rename. Stale staging folders of ``out`` (:func:`staging_is_stale`) are removed first.

    replace  an existing ``out`` is moved aside into a staging folder, replaced, then removed (put
             back if the rename fails); without it, renaming onto a non-empty ``out`` fails.
    kept     when the rename fails and ``kept(out)`` holds (another writer finished ``out`` first),
             that ``out`` is kept and this block's folder dropped.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out.parent, out.name)
    tmp = _staging(out, "tmp")
    old = None
    try:
        os.chmod(tmp, umask_mode(folder=True))
        yield tmp
        _fsync_dir(tmp)
        if replace and out.exists():
            old = _staging(out, "old")
            os.rename(out, old / out.name)
        try:
            os.rename(tmp, out)
        except BaseException as e:
            if old is not None:
                os.rename(old / out.name, out)
            if not (isinstance(e, OSError) and kept is not None and kept(out)):
                raise
        _fsync_dir(out.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


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
    if path.is_dir():
        raise error(f"{path}: a folder; expected a file with {what}")
    if not path.is_file():
        raise error(f"{path}: not found; expected {what} here")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}); expected {what}") from None


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative integer"),
    "posint": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "text"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_one(value: Any, kind: str, name: str, where: str) -> None:
    optional = kind.endswith("?")
    kind = kind.rstrip("?~")
    if value is None and optional:
        return
    ok, desc = _KINDS[kind]
    if not ok(value):
        raise ValueError(f"{where}: field {name!r} is {_shown(value)}, expected {desc}"
                         f"{' or null' if optional else ''}")


def check_record(data: Any, fields: dict[str, str], where: str, what: str = "a record") -> dict:
    """``data`` itself, after checking it is a JSON object whose fields have the declared kinds;
    else a ``ValueError`` naming ``where`` (the file) and the field. ``fields`` maps a name to a kind:
    ``int`` (non-negative), ``posint``, ``number``, ``str``, ``bool``, ``list``, ``dict``; a final
    ``?`` allows null or a missing field, a final ``~`` a missing field only. A name ``a.b`` is field
    ``b`` of the object at ``a``; ``a[].b`` is field ``b`` of every object in the list ``a`` (each
    element must be an object)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: not {what} (not a JSON object)")
    for name, kind in fields.items():
        _check_path(data, name.split("."), kind, "", where)
    return data


def _check_path(obj: dict, parts: list[str], kind: str, prefix: str, where: str) -> None:
    """Check the field ``parts`` of ``obj`` (found at ``prefix`` in the record) against ``kind``."""
    head, rest = parts[0], parts[1:]
    each = head.endswith("[]")
    key = head[:-2] if each else head
    name = f"{prefix}.{key}" if prefix else key
    if key not in obj:
        if kind[-1] in "?~" or rest:  # a missing parent: its own entry says whether it may be missing
            return
        raise ValueError(f"{where}: field {name!r} is missing")
    value = obj[key]
    if not rest:
        _check_one(value, kind, name, where)
        return
    if value is None:
        return
    if each and not isinstance(value, list):
        raise ValueError(f"{where}: field {name!r} is {_shown(value)}, expected a list")
    for i, item in enumerate(value if each else [value]):
        at = f"{name}[{i}]" if each else name
        if not isinstance(item, dict):
            raise ValueError(f"{where}: field {at!r} is {_shown(item)}, expected an object")
        _check_path(item, rest, kind, at, where)


def read_record(path: PathLike, what: str, fields: dict[str, str], *, error: type[Exception] = ValueError) -> dict:
    """The JSON object in ``path`` (``what`` it should hold), its fields checked by
    :func:`check_record`; a missing file, one that is not JSON, not an object, or a field of another
    kind raises ``error`` naming the file (and the field)."""
    data = read_json(path, what, error=error)
    try:
        return check_record(data, fields, str(path), what)
    except ValueError as e:
        raise error(str(e)) from None


SEAL_KEY = "difftx_sha256"  # a sealed JSON object's digest of its other fields


def _digest_of(data: dict) -> str:
    import hashlib

    body = {k: v for k, v in data.items() if k != SEAL_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal(data: dict) -> dict:
    """``data`` with :data:`SEAL_KEY` set to the SHA-256 of its other fields (canonical JSON): a
    reader (:func:`unsealed`) can tell the file was not changed since difftx wrote it."""
    return {**{k: v for k, v in data.items() if k != SEAL_KEY}, SEAL_KEY: _digest_of(data)}


def unsealed(data: Any, where: str) -> Any:
    """``data`` without its seal, after checking it (a ``ValueError`` naming ``where`` when the content
    differs from what was sealed). An object without a seal (written by an older difftx) is returned
    as it is."""
    if not isinstance(data, dict) or SEAL_KEY not in data:
        return data
    if data[SEAL_KEY] != _digest_of(data):
        raise ValueError(f"{where}: changed since difftx wrote it (its content does not match its "
                         f"{SEAL_KEY} {str(data[SEAL_KEY])[:12]}...)")
    return {k: v for k, v in data.items() if k != SEAL_KEY}


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
