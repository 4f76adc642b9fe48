"""difftx: the Differential Transformer (Ye et al., ICLR 2025, and V2), complete and tested."""

__version__ = "0.1.0"

# The public names are imported on first use (PEP 562), so that ``import difftx.cli`` (the
# ``difftx`` command) does not import torch before its error boundary is in place: a Ctrl-C
# during start-up is then one line and exit code 130, not a traceback.
_EXPORTS = {
    "AttentionMask": "attention", "DiffAttention": "attention", "DiffAttentionV2": "attention",
    "StandardAttention": "attention", "GatedAttention": "attention", "AttentionKind": "attention",
    "register_attention": "attention",
    "PRESETS": "config", "ModelConfig": "config", "baseline_config": "config", "preset": "config",
    "ARMS": "config", "ARM_SETS": "config", "arm_config": "config",
    "KVCache": "model", "Transformer": "model", "lm_loss": "model",
}

__all__ = [
    "ARMS", "ARM_SETS", "AttentionKind", "AttentionMask", "DiffAttention", "DiffAttentionV2", "GatedAttention", "KVCache",
    "ModelConfig", "PRESETS", "StandardAttention", "Transformer", "arm_config", "baseline_config", "lm_loss",
    "preset", "register_attention", "__version__",
]


def __getattr__(name: str):
    import importlib

    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):  # a submodule (``difftx.model`` after ``import difftx``)
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
