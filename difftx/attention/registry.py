"""The attention kinds by name: :data:`ATTENTIONS`, :func:`register_attention`, and :func:`load_kinds` (the files that
register your own kinds, for ``difftx --kinds`` and worker processes)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .modules import (AttentionKind, ConvertedAttention, DexAttention, DiffAttention, DiffAttentionV2,
                      GatedAttention, StandardAttention, TemperatureAttention)

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


def load_kinds(spec: Optional[str] = None) -> list[str]:
    """Import the modules that register your attention kinds: ``spec`` (default the ``DIFFTX_KINDS`` environment
    variable) is a comma-separated list of Python files or importable module names. ``difftx --kinds FILE``
    sets the variable, so that worker processes import them too. Returns the names it imported."""
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
        try:
            if item.endswith(".py") or os.sep in item:
                path = Path(item).expanduser().resolve()
                if not path.is_file():
                    raise FileNotFoundError(f"no such file: {path}")
                name = f"difftx_kinds_{path.stem}"
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
        except Exception as e:  # noqa: BLE001 - one line naming the module, then the original error
            raise ImportError(f"{KINDS_ENV} / --kinds: cannot import {item!r}: {type(e).__name__}: {e}") from e
        done.append(item)
    return done


for _name, _cls in (("diff", DiffAttention), ("diff_v2", DiffAttentionV2), ("standard", StandardAttention),
                    ("gated", GatedAttention), ("temperature", TemperatureAttention),
                    ("converted", ConvertedAttention), ("dex", DexAttention)):
    register_attention(_name, _cls)
