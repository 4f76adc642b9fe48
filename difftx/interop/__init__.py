"""Interoperability with other toolkits. :mod:`difftx.interop.hf`: Hugging Face ``transformers``
(DiffLlama for ``diff`` models, Llama for ``standard`` ones), in both directions; every other built-in kind
exports with difftx's own modeling code (:mod:`difftx.interop.remote`, loaded with ``trust_remote_code=True``).
:mod:`difftx.interop.convert`: a ``standard`` or Llama model made differential (``converted``), same function.

Nothing here imports ``transformers``: the converters read and write the folder format
(``config.json`` + safetensors) directly, so the core package keeps no dependency on it.
"""

from .convert import convert_model
from .hf import ConversionError, export_hf, hf_config, import_hf, to_difftx_state, to_hf_state

__all__ = ["ConversionError", "convert_model", "export_hf", "import_hf", "hf_config", "to_hf_state",
           "to_difftx_state"]
