"""What checking a weights file's SHA-256 on every load costs (issue 41, item 1): for a few model
sizes, the median time to load ``model.safetensors`` without the check (safetensors' ``load_file``,
what ``difftx.checkpoint.load_state`` did before) and with it (``load_state`` now: the same load,
then :func:`difftx.checkpoint.verify_digest`), the same for the whole ``load_model`` (build the
model, load, check, copy the weights in) that eval, export and ``runs`` call, and the atomic
write (fsync included) of the weights with and without recording the digest (which reads the
file back once and patches its header). The file is in the page cache (it was just written and
is read repeatedly); from a cold disk both pay one read of the file.

    python benchmarks/load_digest.py [--repeats 11] [--sizes cpu,cpu-5m,50mb,cpu-17m]

Sizes: ``cpu`` is the model of ``difftx compare --preset cpu`` (its DIFF arm), ``cpu-5m`` and
``cpu-17m`` the model presets of that name, ``50mb`` a 7-layer, 384-wide model of about 50 MB."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from difftx.checkpoint import (
    WEIGHTS_NAME, _weights, file_sha256, load_config, load_model, load_state, load_weights_into, save_model,
    save_weights,
)
from difftx.config import ModelConfig, preset
from difftx.io import atomic_write
from difftx.model import Transformer


def model_config(name: str) -> ModelConfig:
    if name == "cpu":
        from difftx.compare.plan import resolve
        from difftx.compare.presets import PRESETS

        return resolve(PRESETS["cpu"]).arms["diff"]
    if name == "50mb":
        return ModelConfig(vocab_size=256, dim=384, n_layers=7, n_heads=6, max_seq_len=256)
    return preset(name)


def load_model_unchecked(folder: Path) -> Transformer:
    """``load_model`` as it was before the check: build the model, ``load_file``, copy the weights in."""
    model = Transformer(load_config(folder))
    load_weights_into(model, load_file(str(folder / WEIGHTS_NAME)))
    return model


def median_s(fn, repeats: int) -> float:
    fn()  # warm: page cache, allocator
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=11, help="timed repeats per cell (median; default 11)")
    ap.add_argument("--sizes", default="cpu,cpu-5m,50mb,cpu-17m", help="comma-separated sizes (see the doc)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, median of {args.repeats}, file in the page cache")
    print()
    print("| model | parameters | file MB | load_state without check ms | with check ms | the check alone ms | "
          "check MB/s | load_model without check ms | with check ms | load_model overhead | "
          "save without digest ms | save with digest ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.sizes.split(","):
        torch.manual_seed(0)
        model = Transformer(model_config(name))
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "model"
            save_model(model, folder)
            path = folder / WEIGHTS_NAME
            mb = path.stat().st_size / 1e6
            plain = median_s(lambda: load_file(str(path)), args.repeats)
            checked = median_s(lambda: load_state(folder), args.repeats)
            digest = median_s(lambda: file_sha256(path), args.repeats)
            whole_plain = median_s(lambda: load_model_unchecked(folder), args.repeats)
            whole = median_s(lambda: load_model(folder), args.repeats)
            sd = _weights(model)
            other, meta = Path(tmp) / "other.safetensors", {"format": "difftx"}
            save_plain = median_s(lambda: atomic_write(other, lambda p: save_file(sd, p, metadata=meta)), args.repeats)
            save_digest = median_s(lambda: save_weights(other, sd, meta), args.repeats)
        print(f"| {name} | {model.num_parameters():,} | {mb:.1f} | {plain * 1e3:.2f} | {checked * 1e3:.2f} | "
              f"{digest * 1e3:.2f} | {mb / digest:,.0f} | {whole_plain * 1e3:.1f} | {whole * 1e3:.1f} | "
              f"{whole / whole_plain - 1:+.0%} | {save_plain * 1e3:.1f} | {save_digest * 1e3:.1f} |")


if __name__ == "__main__":
    main()
