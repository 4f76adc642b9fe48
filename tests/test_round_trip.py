"""A differential model leaves difftx (issue 51, item 5): a tiny random transformers Llama folder is converted to
differential attention (`difftx convert`, methods mirror and dex), fine-tuned a few steps (`difftx train --init-from`,
λ moves), exported (`difftx export`: difftx's own modeling code) and loaded by transformers in a process where
difftx cannot be imported (tests/remote_check.py). Its logits match the fine-tuned model's in difftx (max |difference|
/ max |logit| <= 1e-5, float32), and so do greedy continuations with transformers' KV cache."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from safetensors.torch import save_file  # noqa: E402

from difftx.checkpoint import load_model  # noqa: E402
from difftx.cli import main  # noqa: E402
from difftx.data.tokenizer import byte_tokenizer_json  # noqa: E402
from difftx.generation import generate  # noqa: E402
from difftx.interop.hf import resolve_model_folder  # noqa: E402
from remote_check import run_checker  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
VOCAB, NEW, REL = 257, 6, 1e-5
TRAIN = ["--preset", "tiny", "--set", "steps=20", "--set", "batch_size=4", "--set", "seq_len=32", "--set", "lr=0.01",
         "--set", "warmup_steps=2", "--set", "eval_interval=10", "--set", "eval_batches=1", "--set", "log_interval=10",
         "--set", "ckpt_interval=10", "--set", "device=cpu", "--set", "tensorboard=false"]
METHODS = {"mirror": [], "dex": ["--dex-heads", "0.5"]}


@pytest.fixture(scope="module")
def trip(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trip")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp / "llama")
    (tmp / "llama" / "tokenizer.json").write_text(byte_tokenizer_json())
    (tmp / "text.txt").write_text("Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n"
                                  * 200)
    expect, cases, models = {}, {}, {}
    for i, (method, extra) in enumerate(METHODS.items()):
        conv, run, out = tmp / f"conv-{method}", tmp / f"run-{method}", tmp / f"hf-{method}"
        assert main(["convert", str(tmp / "llama"), str(conv), "--method", method, *extra]) == 0
        assert main(["train", "--init-from", str(conv), "--data", str(tmp / "text.txt"), "--out", str(run),
                     "--no-progress", *TRAIN]) == 0
        assert main(["export", str(run), str(out)]) == 0
        model = load_model(resolve_model_folder(run)).eval()  # the run's latest checkpoint, as export reads it
        models[method] = (load_model(conv).eval(), model)
        g = torch.Generator().manual_seed(10 + i)
        x = torch.randint(0, VOCAB, (2, 20), generator=g)
        prompt = torch.randint(0, 256, (8,), generator=g).tolist()
        batch = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9)]
        with torch.no_grad():
            expect[method + ".tokens"] = x
            expect[method + ".logits"] = model(x, backend="eager").contiguous()
        cases[method] = {"folder": str(out), "prompt": prompt, "batch": batch, "new": NEW, "tokenizer": True,
                         "difftx_generated": generate(model, [prompt], NEW, temperature=0)[0],
                         "difftx_batch": generate(model, batch, NEW, temperature=0)}
    save_file(expect, str(tmp / "expect.safetensors"))
    results = run_checker(tmp, tmp / "expect.safetensors", cases)
    for method, res in results.items():
        print(f"\n{method}: max rel logits error {res['rel']:.2e}, cached step {res['step_rel']:.2e}")
    return {"results": results, "cases": cases, "models": models}


@pytest.mark.parametrize("method", list(METHODS))
def test_a_converted_and_fine_tuned_llama_loads_in_transformers_without_difftx(trip, method):
    res, case = trip["results"][method], trip["cases"][method]
    start, tuned = trip["models"][method]
    moved = [float((a - b).abs().max()) for (n, a), (_, b) in zip(start.named_parameters(), tuned.named_parameters())
             if "lambda" in n]
    assert moved and max(moved) > 0, "fine-tuning left every lambda parameter where conversion put it"
    assert json.loads((Path(case["folder"]) / "config.json").read_text())["model_type"] == "difftx"
    assert res["class"] == "DifftxForCausalLM" and "difftx/interop" not in res["module"]
    assert res["missing"] == [] and res["unexpected"] == []
    assert res["rel"] <= REL, f"{method}: max relative logits error {res['rel']:.3g}"
    assert res["step_rel"] <= REL
    assert res["generated"] == case["difftx_generated"] and res["batch"] == case["difftx_batch"]
    assert res["tokens"] == list("h\u00e9llo".encode())  # the source's tokenizer.json travelled with the model
