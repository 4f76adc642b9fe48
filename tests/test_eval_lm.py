"""Language-modelling metrics (difftx.eval.lm) on hand-made models and tokens."""

import math

import pytest
import torch
import torch.nn as nn

from difftx import ModelConfig, Transformer, preset
from difftx.eval.lm import (
    ar_hit_mask,
    binned,
    bits_per_byte,
    bytes_per_token,
    distinct_predictions,
    evaluate_lm,
    length_extrapolation,
    spread_windows,
    summarize_nll,
    token_nll,
    window_starts,
    windows_from_stream,
)


class Uniform(nn.Module):
    """Logits all zero: every token has NLL ln V."""

    def __init__(self, vocab: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.vocab = vocab

    def forward(self, tokens, backend=None):
        return torch.zeros(*tokens.shape, self.vocab)


class NextIsPlusOne(nn.Module):
    """Puts almost all mass on ``token + 1``: NLL ~0 on counting sequences, large otherwise."""

    def __init__(self, vocab: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.vocab = vocab

    def forward(self, tokens, backend=None):
        return 50.0 * nn.functional.one_hot((tokens + 1) % self.vocab, self.vocab).float()


def test_uniform_model_nll_and_bpb():
    w = torch.randint(0, 256, (3, 9))
    nll = token_nll(Uniform(256), w)
    assert nll.shape == (3, 8)
    torch.testing.assert_close(nll, torch.full((3, 8), math.log(256)))
    res = evaluate_lm(Uniform(256), w, bytes_per_token=1.0)
    assert res.bpb == pytest.approx(8.0)  # a uniform byte model costs exactly 8 bits per byte
    assert res.perplexity == pytest.approx(256.0)
    assert bits_per_byte(math.log(256), 2.0) == pytest.approx(4.0)
    assert bytes_per_token("héllo", 3) == pytest.approx(6 / 3)
    with pytest.raises(ValueError, match="bytes_per_token"):
        bits_per_byte(1.0, 0.0)


def test_nll_alignment_predicts_the_next_token():
    count = torch.arange(10)[None]  # 0 1 2 ... 9
    assert float(token_nll(NextIsPlusOne(16), count).max()) < 1e-6
    rev = torch.arange(9, -1, -1)[None]
    assert float(token_nll(NextIsPlusOne(16), rev).min()) > 40


def test_ar_hit_mask_hand_made():
    # tokens:            a b c a b d a b
    w = torch.tensor([[1, 2, 3, 1, 2, 4, 1, 2]])
    # predictions t=0..6 are tokens 1..7: b c a b d a b; bigrams (a,b)@1 (b,c) (c,a) (a,b)@4 hit,
    # (b,d) (d,a) (a,b)@7 hit
    expect = [False, False, False, True, False, False, True]
    assert ar_hit_mask(w)[0].tolist() == expect
    # a repeated token alone is not a hit: the bigram must repeat
    assert ar_hit_mask(torch.tensor([[5, 5, 6, 5]]))[0].tolist() == [False, False, False]
    assert ar_hit_mask(torch.tensor([[5, 5, 5]]))[0].tolist() == [False, True]


def test_summarize_split_and_positions():
    nll = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])
    hits = torch.tensor([[False, True, False], [False, False, True]])
    r = summarize_nll(nll, hits)
    assert r.nll == pytest.approx(3.0)
    assert r.ar_hit_nll == pytest.approx((2 + 5) / 2)
    assert r.other_nll == pytest.approx((1 + 3 + 3 + 4) / 4)
    assert r.ar_hit_fraction == pytest.approx(2 / 6)
    assert r.nll_by_position == pytest.approx([2.0, 3.0, 4.0])
    none = summarize_nll(nll, torch.zeros_like(hits))
    assert none.ar_hit_nll is None and none.other_nll == pytest.approx(3.0)


def test_windows_from_stream():
    w = windows_from_stream(list(range(10)), 3)
    assert w.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert windows_from_stream(range(10), 3, max_windows=1).shape == (1, 4)
    with pytest.raises(ValueError, match="shorter than one window"):
        windows_from_stream(range(3), 4)


def test_length_extrapolation_on_tiny_model():
    torch.manual_seed(0)
    model = Transformer(preset("test", max_seq_len=8))
    stream = torch.randint(0, 64, (200,))
    out = length_extrapolation(model, stream, 8, factors=(1, 2, 4), max_windows=3)
    assert sorted(out) == [1, 2, 4]
    assert len(out[4].nll_by_position) == 32 and out[4].n_tokens == 3 * 32
    assert "nll_beyond_train_len" in out[2].extra and "nll_beyond_train_len" not in out[1].extra
    # every factor is scored on the same text: a prefix of the longest windows equals a short window
    short = evaluate_lm(model, spread_windows(stream, 32, 3)[0][:, :17])  # windows spread over the whole stream
    assert out[2].nll_by_position == pytest.approx(short.nll_by_position, abs=1e-5)
    assert out[1].extra["nll_within_train_len"] == out[4].extra["nll_within_train_len"]
    # an untrained model is near uniform at every length
    for r in out.values():
        assert abs(r.nll - math.log(64)) < 0.2
    assert binned([1, 2, 3, 4, 5, 6], 3) == pytest.approx([1.5, 3.5, 5.5])


def test_spread_windows_cover_the_whole_stream():
    s = torch.arange(101)
    w, tail = spread_windows(s, 10, 3)
    assert tail is None and w[:, 0].tolist() == [0, 45, 90] and w.shape == (3, 11)  # first, middle, last
    w, tail = spread_windows(s, 10, 0)  # every token once: 10 windows of 10 predictions, no tail
    assert w.shape == (10, 11) and tail is None and w[-1, -1] == 100
    w, tail = spread_windows(torch.arange(25), 10, 0)
    assert w.shape == (2, 11) and tail.tolist() == [[20, 21, 22, 23, 24]]  # 4 more predictions
    with pytest.raises(ValueError, match="shorter than one window"):
        spread_windows(torch.arange(5), 10, 2)


def test_spread_windows_never_score_a_token_twice_unless_asked():
    """512 windows of 64 asked of a 3,673-token split: only 57 fit side by side (the old spread
    overlapped about 9x and counted 32,768 'tokens'); with overlap allowed, the distinct count says
    how much text was really scored."""
    s = torch.arange(3673)
    w, _ = spread_windows(s, 64, 512)
    assert w.shape == (57, 65)
    predicted = w[:, 1:].flatten()
    assert predicted.unique().numel() == predicted.numel() == 57 * 64  # disjoint predictions
    assert w[0, 0] == 0 and w[-1, -1] == 3672  # still spread over the whole stream
    starts = window_starts(3673, 64, 512, overlap=True)
    assert len(starts) == 512 and distinct_predictions(starts, 64) == 3672
    assert distinct_predictions([0, 10, 100], 20) == 20 + 10 + 20


def test_lm_task_counts_distinct_tokens(tmp_path):
    """The LM task on a short held-out stream: the windows it scores are disjoint, and the token
    count it reports is the number of distinct tokens scored."""
    from difftx.tasks.lm import TASK, LMSettings

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, dim=16, n_layers=1, n_heads=1, max_seq_len=64))

    class Held:
        tokens = torch.randint(0, 50, (300,))
        source, bytes_per_token, train_len = "a short stream", 1.0, 16

    class Subject:
        data = None

        def heldout(self):
            return Held()

    Subject.model = model
    res = TASK.run(Subject(), LMSettings(windows=512, extrapolation_factors=(1,)))
    assert res["windows"] == 299 // 16 and res["tokens"] == res["distinct_tokens"] == 18 * 16
    over = TASK.run(Subject(), LMSettings(windows=40, overlap=True, extrapolation_factors=(1,)))
    assert over["windows"] == 40 and over["tokens"] == 40 * 16 and over["distinct_tokens"] == 299


def test_lm_task_records_blocks_of_consecutive_windows():
    """Every token of a 40,000-token stream in consecutive windows: the LM task records that they
    are consecutive, cuts them into blocks (whole documents where the stream's documents are known),
    and ``lm_nll``'s per-example values for ``difftx compare`` are the blocks' token-weighted means;
    64 windows spread over a long stream make blocks by their place in it."""
    import numpy as np

    from difftx.tasks.lm import TASK, LMSettings, _examples_sentence

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, dim=16, n_layers=1, n_heads=1, max_seq_len=64))

    def subject(n_tokens, offsets=None):
        class Held:
            tokens = torch.randint(0, 50, (n_tokens,))
            source, bytes_per_token, train_len, doc_offsets = "a stream", 1.0, 64, offsets

        class Subject:
            data = "a file"

            def heldout(self):
                return Held()

        Subject.model = model
        return Subject()

    settings = LMSettings(extrapolation_factors=(1,), batch_size=64)
    res = TASK.run(subject(40_001), settings)
    dep, ci = res["dependence"], res["heldout"]["nll_interval"]
    assert dep["consecutive"] and dep["by"] == "position" and dep["bounds"][-1] == res["windows"] == 625
    assert dep["span"] == 40_000 and dep["min_block_tokens"] == 8192
    assert ci["blocks"] == 4 and ci["low"] < res["heldout"]["nll"] < ci["high"]
    lm_nll = next(m for m in TASK.metrics(settings) if m.key == "lm_nll")
    examples = lm_nll.per_example(res)
    w = np.asarray(res["records"]["window_nll"])
    assert examples == pytest.approx([w[a:b].mean() for a, b in zip(dep["bounds"], dep["bounds"][1:])])
    assert np.mean(examples) == pytest.approx(res["heldout"]["nll"], abs=1e-5)
    assert dep["estimand"] == "windows" and dep["documents"] is None and "note" not in dep
    assert ("The interval's examples are 4 blocks of windows spanning at least 8,192 tokens of text each: it is over "
            "windows of this one text.") == _examples_sentence(res)
    # three documents known: too few for an interval across documents, so blocks by position, and it says so
    docs = TASK.run(subject(40_001, offsets=np.array([0, 10_000, 30_000, 40_001])), settings)
    dep3 = docs["dependence"]
    assert (dep3["by"], dep3["estimand"], dep3["documents"]) == ("position", "windows", 3)
    assert dep3["bounds"] == dep["bounds"] and docs["heldout"]["nll_interval"]["low"] is not None
    assert "3 documents, too few for an interval over documents like these, which needs 4" in _examples_sentence(docs)
    # five documents: blocks of whole documents, one each, over documents like these
    five = TASK.run(subject(40_001, offsets=np.array([0, 6_000, 10_000, 22_000, 30_000, 40_001])), settings)
    dep5 = five["dependence"]
    assert (dep5["by"], dep5["estimand"], dep5["documents"]) == ("document", "documents", 5)
    assert dep5["bounds"] == [0, 94, 157, 344, 469, 625] and five["heldout"]["nll_interval"]["blocks"] == 5
    assert _examples_sentence(five).endswith("5 blocks of whole documents (5 documents): it is over documents like "
                                             "these.")
    # windows spread over a long stream: 16 blocks of 4 windows by their place in it
    spread = TASK.run(subject(200_000), LMSettings(windows=64, extrapolation_factors=(1,), batch_size=64))
    assert not spread["dependence"]["consecutive"] and spread["dependence"]["bounds"] == list(range(0, 65, 4))
    w = np.asarray(spread["records"]["window_nll"])
    assert lm_nll.per_example(spread) == pytest.approx(w.reshape(16, 4).mean(1).tolist())
    # a result recorded before blocks were: every window its own example
    old = {k: v for k, v in spread.items() if k != "dependence"}
    assert lm_nll.per_example(old) == pytest.approx(w.tolist())
    assert _examples_sentence(old) == "The windows are the examples of the interval."


def test_runs_pairs_windows_only_on_the_same_text():
    """``difftx runs --nll``'s paired column: per window on the same text (a result without blocks:
    a t interval over windows; else over blocks of them), no per-window sign-flip matrix: 50,000
    windows take no memory to speak of; runs scored on other text are not paired."""
    from difftx.cli.runs import paired_nll
    from difftx.eval.blocks import block_bounds

    rng = torch.Generator().manual_seed(0)
    base = (3 + torch.randn(50_000, generator=rng)).tolist()
    other = [b + 0.01 + 0.05 * float(e) for b, e in zip(base, torch.randn(50_000, generator=rng))]
    ref = {"text_id": "a", "records": {"window_nll": base, "window_tokens": [64] * 50_000}}
    res = {"text_id": "a", "records": {"window_nll": other, "window_tokens": [64] * 50_000}}
    mean, lo, hi = paired_nll(res, ref)
    assert mean == pytest.approx(0.01, abs=1e-3) and lo < 0 < hi and hi - lo < 2e-3
    assert paired_nll({**res, "text_id": "b"}, ref).startswith("not paired")
    blocks = {"consecutive": True, "bounds": block_bounds([64] * 50_000), "min_block_tokens": 8192, "by": "position"}
    b_mean, b_lo, b_hi = paired_nll({**res, "dependence": blocks}, {**ref, "dependence": blocks})
    assert b_mean == pytest.approx(mean) and b_lo < 0 < b_hi and b_hi - b_lo < 4e-3


def _blocks_by_hand(values, tokens, count):
    """The 95% batch-means interval written out: ``count`` contiguous groups of (nearly) equal
    windows, their token-weighted means, sd / sqrt(count), the t quantile on count - 1 df."""
    import numpy as np

    from difftx.eval.stats import t_quantile

    v, w = np.asarray(values), np.asarray(tokens, dtype=float)
    groups = np.array_split(np.arange(v.size), count)
    means = np.array([(v[g] * w[g]).sum() / w[g].sum() for g in groups])
    mean = (v * w).sum() / w.sum()
    h = t_quantile(0.975, count - 1) * means.std(ddof=1) / np.sqrt(count)
    return mean - h, mean + h


def test_eval_lm_and_runs_nll_print_intervals_over_blocks(tmp_path, capsys, monkeypatch):
    """Every token of a 42 KB file (byte tokens) is scored in consecutive windows of 32: the
    NLL intervals of ``eval lm`` and ``runs --nll`` (one run, and the paired difference) are over 5
    blocks of about 8.4k tokens, say so, and agree with batch means written out by hand; 40 windows
    spread over the text make 5 blocks of 8 windows."""
    import json
    import random
    import re

    from difftx.cli import main

    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    r = random.Random(0)
    words = ["river", "lantern", "apple", "the", "a", "weaver", "boat", "sleeps", "turns", "of", "and"]
    Path = __import__("pathlib").Path
    Path("text.txt").write_text("\n".join(" ".join(r.choice(words) for _ in range(12)) for _ in range(600)) + "\n")
    Path("held.txt").write_text("\n".join(" ".join(r.choice(words) for _ in range(10)) for _ in range(800)) + "\n")
    for out, extra in (("a", []), ("b", ["--baseline"])):
        assert main(["train", "--preset", "test", "--set", "steps=3", "--set", "eval_interval=0", "--data", "text.txt",
                     "--out", out, "--no-progress", *extra]) == 0
    capsys.readouterr()

    assert main(["eval", "lm", "a", "--data", "held.txt", "--no-progress", "--json", "a.json"]) == 0
    printed = capsys.readouterr().out
    res = json.loads(Path("a.json").read_text())
    dep, ci = res["dependence"], res["heldout"]["nll_interval"]
    assert dep["consecutive"] and dep["by"] == "position" and len(dep["bounds"]) - 1 == ci["blocks"] == 5
    assert res["tokens"] == res["stream_tokens"] - 1 == Path("held.txt").stat().st_size  # byte tokens, a separator
    assert res["tokens"] // 8192 == 5 and ci["df"] == pytest.approx(4, abs=0.01)
    lo, hi = _blocks_by_hand(res["records"]["window_nll"], res["records"]["window_tokens"], 5)
    assert (ci["low"], ci["high"]) == pytest.approx((lo, hi), abs=2e-3)  # array_split's groups differ by a window
    assert f"NLL {res['heldout']['nll']:.4f} nats [95% CI {ci['low']:.4f}, {ci['high']:.4f}]" in printed
    flat = " ".join(printed.split())
    assert ("(NLL interval: over windows of this one text (every token is scored once, so the text's own mean has "
            f"no sampling error): its units are 5 blocks of about {res['windows'] / 5:,.0f} consecutive windows "
            f"spanning about {res['tokens'] / 5:,.0f} tokens of text each (t, 4.0 df))") in flat, printed
    mine = printed[printed.index("NLL "):printed.index("length extrapolation")].splitlines()
    assert len(mine) == 5 and max(len(line) for line in mine) <= 100, mine

    # windows spread over the text: blocks by their place in it
    assert main(["eval", "lm", "a", "--data", "held.txt", "--windows", "40", "--no-progress", "--json",
                 "spread.json"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    spread = json.loads(Path("spread.json").read_text())
    assert not spread["dependence"]["consecutive"] and spread["heldout"]["nll_interval"]["blocks"] == 5
    assert "over windows of this one text: its units are 5 blocks of about 8 windows spanning about" in flat, flat

    # the same text as 6 JSONL records: its documents are known, and each block is one of them
    lines = Path("held.txt").read_text().splitlines()
    Path("held.jsonl").write_text("".join(json.dumps({"text": "\n".join(lines[i:i + 134])}) + "\n"
                                          for i in range(0, 800, 134)))
    assert main(["eval", "lm", "a", "--data", "held.jsonl", "--no-progress", "--json", "docs.json"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    docs = json.loads(Path("docs.json").read_text())
    assert docs["dependence"]["by"] == "document" and docs["heldout"]["nll_interval"]["blocks"] == 6
    assert docs["dependence"]["estimand"] == "documents" and docs["dependence"]["documents"] == 6
    assert "(NLL interval: over documents like these (every token is scored once, so the text's own mean has no " \
           "sampling error): its units are 6 blocks of one document each (about" in flat, flat

    assert main(["runs", "a", "b", "--nll", "--data", "held.txt"]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    at = next(i for i, line in enumerate(lines) if "held-out NLL [95% CI]" in line)
    a_row, b_row = lines[at + 2:at + 4]
    nll_a, lo_a, hi_a = (float(x) for x in re.findall(r"\d+\.\d{4}", a_row)[-3:])
    assert (lo_a, hi_a) == pytest.approx((ci["low"], ci["high"]), abs=1e-4)
    assert main(["eval", "lm", "b", "--data", "held.txt", "--no-progress", "--json", "b.json"]) == 0
    ref = json.loads(Path("b.json").read_text())
    d = [x - y for x, y in zip(ref["records"]["window_nll"], res["records"]["window_nll"])]
    lo, hi = _blocks_by_hand(d, res["records"]["window_tokens"], 5)
    paired, p_lo, p_hi = (float(x) for x in re.findall(r"[-+]?\d+\.\d{4}", b_row)[-3:])
    assert paired == pytest.approx(ref["heldout"]["nll"] - res["heldout"]["nll"], abs=2e-4)
    assert (p_lo, p_hi) == pytest.approx((lo, hi), abs=2e-3)
    assert "- the NLL interval: over windows of this one text (every token is scored once, so the text's own" \
        in table
    assert "(t, 4.0 df)" in table
    assert "with the same\n  units (text noise only" in table


_RESIDENT_SCRIPT = """
import torch
from difftx import ModelConfig, Transformer
from difftx.eval.lm import batched_token_nll

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20

torch.manual_seed(0)
model = Transformer(ModelConfig(vocab_size=259, dim=64, n_layers=2, n_heads=2, max_seq_len=128))
windows = torch.randint(0, 259, (3200, 129))
batched_token_nll(model, windows[:80])
before = resident_mb()
nll = batched_token_nll(model, windows)
print(resident_mb() - before, tuple(nll.shape))
"""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_scoring_many_windows_keeps_resident_memory_flat():
    # 400 batches of 8 windows of 128 tokens: keeping each batch's small result pinned ~1 MB of freed heap per
    # batch (331 MB here); the results now go into one tensor allocated up front (13 MB)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RESIDENT_SCRIPT], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}).stdout.split()
    growth, shape = float(out[0]), " ".join(out[1:])
    assert shape == "(3200, 128)"
    assert growth < 80, f"resident memory grew by {growth:.0f} MB while scoring 3,200 windows"


def test_a_compare_models_documents_are_found_by_their_separator():
    """A compare model's held-out stream records no document offsets; every packed document opens
    with the tokenizer's end-of-text (shifted into the model's ids), so the LM task finds them there:
    the bundled Shakespeare's validation split is its 4 works. A stream that does not open with the
    separator is not packed (documents not known); recorded offsets win."""
    import numpy as np

    from difftx.data import prepare_data
    from difftx.tasks.lm import document_offsets

    class Held:
        doc_offsets = None
        tokens = torch.tensor([266, 1, 2, 3, 266, 4, 5, 266, 6])

    class Compare:
        compare, lm_offset, text = object(), 10, None  # the bundled text: bytes, end-of-text 256

    assert document_offsets(Compare(), Held()) == [0, 4, 7, 9]
    Held.tokens = torch.tensor([1, 266, 2])
    assert document_offsets(Compare(), Held()) is None  # not a packed stream
    Held.doc_offsets = np.array([0, 2, 3])
    assert document_offsets(Compare(), Held()) == [0, 2, 3]
    Held.doc_offsets, Held.tokens = None, torch.tensor([266, 1, 266])
    assert document_offsets(type("TextModel", (), {})(), Held()) is None  # not a compare model: nothing to find

    val = prepare_data(None, "byte", progress=False).val
    Held.tokens = torch.from_numpy(val.tokens[:].astype("int64")) + 10
    assert document_offsets(Compare(), Held()) == val.doc_offsets.tolist() and len(val.doc_offsets) == 5
