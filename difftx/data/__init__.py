"""Data: the bundled corpus, tokenizers, cached token stores and the packed loader.

    from difftx.data import prepare_data, PackedLoader, load_tokenizer
    data = prepare_data()                                   # bundled corpus, byte tokenizer
    loader = PackedLoader(data.train, batch_size=8, seq_len=256, seed=0)
    tokens, doc_ids = loader.next_batch()                   # (8, 257) int64 each

See docs/data.md for formats, caching, the split rules and the corpus's provenance.
"""

from .loader import PackedLoader
from .sources import BUNDLED_CORPUS, BUNDLED_PROVENANCE, DataError, bundled_manifest
from .store import PreparedData, TokenStore, default_cache_dir, prepare_data, token_dtype
from .tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer", "BUNDLED_CORPUS", "BUNDLED_PROVENANCE", "ByteTokenizer", "DataError", "PackedLoader",
    "PreparedData", "TokenStore", "Tokenizer", "bundled_manifest", "default_cache_dir", "load_tokenizer",
    "prepare_data", "token_dtype", "train_bpe",
]
