"""The attention kinds by name: :data:`ATTENTIONS`, :func:`register_attention`, :data:`BUILTIN_KINDS` (difftx's own),
and :func:`load_kinds` (the files that register your own kinds, for ``difftx --kinds`` and worker processes)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .converted import ConvertedAttention
from .dex import DexAttention
from .modules import (BUILTIN_KINDS, AttentionKind, DiffAttention, DiffAttentionV2, GatedAttention,
                      StandardAttention, TemperatureAttention)

ATTENTIONS: dict[str, type[AttentionKind]] = {}
"""The attention kinds a :class:`~difftx.config.ModelConfig` can name (``attention``), by name:
:func:`register_attention` adds one."""


def register_attention(name: str, cls: Optional[type] = None, *, replace: bool = False):
    """Name an attention kind (a subclass of :class:`AttentionKind`) for ``ModelConfig.attention``; as a function
    (``register_attention("qknorm", QKNormAttention)``) or a decorator (``@register_attention("qknorm")``).
    ``replace``: allow taking a name already registered. Returns the class."""
    if cls is None:
        return lambda c: register_attention(name, c, replace=replace)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_attention: the name must be an identifier, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, AttentionKind)):
        raise TypeError(f"register_attention: {name!r} must be a subclass of difftx.AttentionKind (for example of "
                        f"StandardAttention), got {cls!r}")
    builtin = BUILTIN_KINDS.get(name)
    if builtin is not None and cls is not builtin:  # a built-in name stays the built-in kind, replace or not
        raise ValueError(f"register_attention: {name!r} is a built-in kind ({builtin.__name__}); registering another "
                         f"class under it would change every model and arm of that name: choose another name")
    if name in ATTENTIONS and ATTENTIONS[name] is not cls and not replace:
        raise ValueError(f"register_attention: {name!r} is already {ATTENTIONS[name].__name__}; pass replace=True "
                         f"or choose another name")
    if cls.Options is not None and not dataclasses.is_dataclass(cls.Options):
        raise TypeError(f"register_attention: {cls.__name__}.Options must be a dataclass, got {cls.Options!r}")
    if cls.components not in (1, 2) or (cls.extra_proj is not None and not isinstance(cls.extra_proj, str)):
        raise ValueError(f"register_attention: {cls.__name__}: components must be 1 or 2 and extra_proj a name")
    cls.kind = name
    ATTENTIONS[name] = cls
    return cls


KINDS_ENV = "DIFFTX_KINDS"


def kind_code(name: str) -> Optional[dict]:
    """The code behind attention kind ``name`` when it is not built into difftx (a kind registered from ``--kinds`` /
    ``DIFFTX_KINDS`` or by your code): ``{"file", "sha256"}`` of the file that defines its class, so that a model
    trained with it is not reused or resumed once the file is edited. None for a built-in kind (its code is
    difftx's, recorded by version); ``file`` and ``sha256`` None for a class defined interactively. A name that is
    not registered raises ``ValueError``."""
    if name not in ATTENTIONS:
        raise ValueError(f"attention kind {name!r} is not registered")
    cls = ATTENTIONS[name]
    if BUILTIN_KINDS.get(name) is cls:
        return None
    return code_digest(cls)


def code_digest(cls: type, bytecode: bool = False) -> dict:
    """``{"file", "sha256"}`` of the file that defines ``cls`` (a kind's, a training task's): what a model trained
    with that code records. A class without a file (defined interactively or exec'd) has ``file`` None and ``sha256``
    None, or with ``bytecode`` the SHA-256 of its methods' compiled code over its MRO (``marshal``; line numbers
    included, so moving the code changes it too)."""
    import hashlib
    import inspect
    import marshal
    from pathlib import Path

    try:
        path = Path(inspect.getsourcefile(cls) or "")
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    except (TypeError, OSError):
        digest = None
    if digest is not None:
        return {"file": str(path), "sha256": digest}
    if not bytecode:
        return {"file": None, "sha256": None}
    h = hashlib.sha256(cls.__qualname__.encode())
    for klass in cls.__mro__:
        for name, member in sorted(vars(klass).items()):
            code = getattr(member, "__code__", None)
            if code is not None:
                h.update(name.encode() + marshal.dumps(code))
    return {"file": None, "sha256": h.hexdigest()}


def code_change(name: str, recorded: Optional[dict]) -> Optional[str]:
    """How the code of attention kind ``name`` differs from ``recorded`` (what :func:`kind_code` gave when a model
    was trained with it), said as "FILE (SHA-256 OLD... then, NEW... now)"; None when it is the same, or nothing was
    recorded (a built-in kind, or an older difftx)."""
    if not isinstance(recorded, dict):
        return None
    now = kind_code(name) if name in ATTENTIONS else None
    if now == recorded:
        return None
    then = str(recorded.get("sha256"))[:12]
    current = "not registered" if name not in ATTENTIONS else "built in" if now is None else \
        f"{now['file']} with SHA-256 {str(now['sha256'])[:12]}..."
    return f"{recorded.get('file')} (SHA-256 {then}... then; now {current})"


class KindsError(ValueError):
    """A kinds file (``--kinds`` / ``DIFFTX_KINDS``) that is missing, does not import, or registers what it may not:
    bad input, said in one line naming the file and the line (the command line exits 2)."""


def error_site(e: BaseException, path) -> str:
    """``FILE:LINE`` of the error inside the file ``path`` (the innermost frame there; a kinds file, a kind's class
    file), or the file alone."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        return f"{e.filename}:{e.lineno}"
    line, tb = None, e.__traceback__
    while tb is not None:
        if path is not None and tb.tb_frame.f_code.co_filename == str(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{path}:{line}" if line is not None else str(path)


def load_kinds(spec: Optional[str] = None) -> list[str]:
    """Import the modules that register your attention kinds: ``spec`` (default the ``DIFFTX_KINDS`` environment
    variable) is a comma-separated list of Python files or importable module names. ``difftx --kinds FILE``
    sets the variable, so that worker processes import them too. Returns the names it imported."""
    import hashlib
    import importlib
    import importlib.util
    import os
    import sys
    from pathlib import Path

    spec = os.environ.get(KINDS_ENV, "") if spec is None else spec
    done = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        path = None
        try:
            if item.endswith(".py") or os.sep in item:
                path = Path(item).expanduser().resolve()
                if not path.is_file():
                    raise KindsError(f"{KINDS_ENV} / --kinds: no such file: {path} (give the Python file that "
                                     f"registers your attention kinds)")
                # the file's own module: two files of one name (a/kinds.py, b/kinds.py) are two modules
                name = f"difftx_kinds_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"
                if name not in sys.modules:
                    module_spec = importlib.util.spec_from_file_location(name, path)
                    module = importlib.util.module_from_spec(module_spec)
                    sys.modules[name] = module
                    try:
                        module_spec.loader.exec_module(module)
                    except BaseException:
                        del sys.modules[name]
                        raise
            else:
                importlib.import_module(item)
        except KindsError:
            raise
        except ModuleNotFoundError as e:
            if path is None and e.name == item:  # the module named is not there (not an import inside it)
                raise KindsError(f"{KINDS_ENV} / --kinds: cannot import {item!r}: no such module (give a Python "
                                 f"file, or a module on the path)") from e
            where = error_site(e, path) if path is not None else item
            raise KindsError(f"{KINDS_ENV} / --kinds: cannot import {where}: {type(e).__name__}: {e}") from e
        except (Exception, SystemExit) as e:  # noqa: BLE001 - one line naming the file and line, then the error
            where = error_site(e, path) if path is not None else item
            if isinstance(e, SystemExit):  # sys.exit() or a module-level argument parser: never the command's exit
                what = (f"it exits the program while being imported (exit code {e.code!r}); a kinds file must only "
                        f"define and register kinds")
            else:
                what = e.msg if isinstance(e, SyntaxError) else str(e)
            raise KindsError(f"{KINDS_ENV} / --kinds: cannot import {where}: {type(e).__name__}: {what}") from e
        done.append(item)
    return done


BUILTIN_KINDS.update({
    "diff": DiffAttention, "diff_v2": DiffAttentionV2, "standard": StandardAttention, "gated": GatedAttention,
    "temperature": TemperatureAttention, "converted": ConvertedAttention, "dex": DexAttention})
for _name, _cls in BUILTIN_KINDS.items():
    register_attention(_name, _cls)
