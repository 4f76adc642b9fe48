"""Configuration of a difftx model exported with its own modeling code (``difftx export``).

Written by difftx and copied beside the weights: it imports only ``transformers`` and the standard library, so the
folder loads with ``AutoConfig.from_pretrained(folder, trust_remote_code=True)`` where difftx is not installed.
The fields are difftx's ``ModelConfig`` fields under their own names (``tie_embeddings`` is transformers'
``tie_word_embeddings``); ``modeling_difftx.py`` reads them. Common transformers names are aliases
(``hidden_size`` is ``dim``, ``num_hidden_layers`` is ``n_layers``, ...).
"""

from transformers import PretrainedConfig


class DifftxConfig(PretrainedConfig):
    model_type = "difftx"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                     "max_position_embeddings": "max_seq_len", "rms_norm_eps": "norm_eps",
                     "initializer_range": "init_std", "tie_embeddings": "tie_word_embeddings"}

    def __init__(self, vocab_size=256, dim=256, n_layers=4, n_heads=4, n_kv_heads=None, attention="diff",
                 ffn_hidden=None, max_seq_len=256, rope_theta=10000.0, rope=True, norm_eps=1e-5, init_std=0.02,
                 init="normal", backend="auto", lambda_init=None, use_subln=True, gate=None, head_norm=None,
                 subtract=True, out_scale=None, options=None, qkv_bias=False, tie_word_embeddings=False, use_cache=True,
                 **kwargs):
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.vocab_size, self.dim, self.n_layers, self.n_heads = vocab_size, dim, n_layers, n_heads
        self.n_kv_heads, self.attention, self.ffn_hidden = n_kv_heads, attention, ffn_hidden
        self.max_seq_len = max_seq_len
        self.rope_theta, self.rope, self.norm_eps, self.init_std = rope_theta, rope, norm_eps, init_std
        self.init, self.backend, self.lambda_init, self.use_subln = init, backend, lambda_init, use_subln
        self.gate, self.head_norm, self.subtract, self.out_scale = gate, head_norm, subtract, out_scale
        self.options = options
        self.qkv_bias = bool(qkv_bias)  # biases on the q/k/v projections (absent from folders written before it)
        self.tie_word_embeddings = tie_word_embeddings
        self.use_cache = use_cache
