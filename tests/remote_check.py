"""Loading exported transformers folders where difftx cannot be imported: one subprocess (``python -I -S``, only
the site-packages folders on its path, so difftx's editable-install hook never runs; a difftx installed into those
folders is blocked) loads each case's folder with ``trust_remote_code=True`` and reports its logits' relative error
against what difftx computed, one cached decoding step, greedy ``generate()`` (one prompt and a left-padded batch)
and, where asked, its tokenizer. Used by tests/test_export_remote.py and tests/test_round_trip.py."""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

import difftx

CHECK = r'''
import json, sys, time
spec = json.loads(open(sys.argv[1]).read())
sys.path[:0] = spec["site"]  # torch and transformers; their .pth files (difftx's editable hook) are not run
if spec["block"]:  # difftx installed into those folders themselves (not editable): keep it out all the same
    import importlib.abc

    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, *args):
            if name == "difftx" or name.startswith("difftx."):
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, _Block())
try:
    import difftx
    raise SystemExit(f"difftx was importable: {difftx.__file__}")
except ModuleNotFoundError:
    pass
import inspect
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(1)
expect = load_file(spec["expect"])
results = {}
for name, case in spec["cases"].items():
    t0 = time.time()
    model, info = AutoModelForCausalLM.from_pretrained(case["folder"], trust_remote_code=True, dtype=torch.float32,
                                                       output_loading_info=True)
    model.eval()
    x = expect[name + ".tokens"]
    with torch.no_grad():
        logits = model(x).logits
        ref = expect[name + ".logits"]
        rel = ((logits - ref).abs().max() / ref.abs().max()).item()
        out = model(x[:, :-1], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        cached_len = cache.get_seq_length()
        step = model(x[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1]
        step_rel = ((step - logits[:, -1]).abs().max() / logits[:, -1].abs().max()).item()
        prompt = torch.tensor([case["prompt"]])
        one = model.generate(prompt, max_new_tokens=case["new"], do_sample=False, use_cache=True, pad_token_id=0,
                             eos_token_id=None)[0, prompt.shape[1]:].tolist()
        rows = case["batch"]
        P = max(map(len, rows))
        ids = torch.tensor([[0] * (P - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=case["new"], do_sample=False, use_cache=True,
                               pad_token_id=0, eos_token_id=None)[:, P:].tolist()
    res = {"class": type(model).__name__, "module": inspect.getfile(type(model)), "rel": rel, "step_rel": step_rel,
           "cached_len": cached_len, "generated": one, "batch": batch, "missing": list(info["missing_keys"]),
           "unexpected": list(info["unexpected_keys"]), "seconds": time.time() - t0}
    if case.get("tokenizer"):
        tok = AutoTokenizer.from_pretrained(case["folder"])
        res["tokens"] = tok("h\u00e9llo", add_special_tokens=False)["input_ids"]
        res["eos"] = tok.eos_token_id
    results[name] = res
open(spec["out"], "w").write(json.dumps(results))
'''


def _blocked_site(dirs: list[str]) -> list[str]:
    """The site folders that hold difftx itself (a non-editable install): the checker blocks its import there."""
    here = Path(difftx.__file__).resolve()
    return [d for d in dirs if Path(d).resolve() in here.parents]


def run_checker(tmp: Path, expect_file: Path, cases: dict, timeout: int = 300) -> dict:
    """Run the checker on ``cases`` (name -> folder, prompt, batch, new, tokenizer) against the logits and tokens
    saved in ``expect_file`` (``NAME.tokens``, ``NAME.logits``); its results by case. Fails the test on a non-zero
    exit, with the checker's stderr."""
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    spec = {"site": dirs, "block": _blocked_site(dirs), "expect": str(expect_file), "out": str(tmp / "results.json"),
            "cases": cases}
    (tmp / "spec.json").write_text(json.dumps(spec))
    (tmp / "check.py").write_text(CHECK)
    env = {"HF_HOME": str(tmp / "hf_home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-I", "-S", str(tmp / "check.py"), str(tmp / "spec.json")], cwd=tmp,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "results.json").read_text())
