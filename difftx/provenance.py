"""Where a number was computed: the machine record every results file of difftx carries.

Float32 kernels differ from one CPU to another (the vector instructions torch dispatches to, the
MKL and oneDNN code paths), and a few thousand training steps amplify such rounding like a change
of seed. So a result reproduces on the same CPU kernel path with the same library versions, not
across machines. :func:`machine` records what decides that; :func:`machine_line` says it in one
line for a report, so that two reports can be told apart.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Optional

# environment variables that change which kernels run or how they sum (recorded when set)
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
               "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_DEFAULT_FPMATH_MODE", "ONEDNN_DEFAULT_FPMATH_MODE")


def parse_build(text: str) -> dict:
    """The library versions in ``torch.__config__.show()``'s text: ``mkl`` ("2024.2"), ``onednn``
    ("3.12.0"), ``openmp`` ("201511"), ``blas`` and ``lapack`` (``BLAS_INFO`` / ``LAPACK_INFO``:
    "mkl", "open", "accelerate", ...); ``None`` for what the text does not name."""
    def find(pattern: str) -> Optional[str]:
        found = re.search(pattern, text)
        return found.group(1) if found else None

    return {"mkl": find(r"Math Kernel Library Version ([0-9][\w.]*)"),
            "onednn": find(r"(?:MKL-DNN|oneDNN)\s+v?([0-9][\w.]*)"),
            "openmp": find(r"OpenMP ([0-9]+)"),
            "blas": find(r"BLAS_INFO=([^,\s]+)"),
            "lapack": find(r"LAPACK_INFO=([^,\s]+)")}


def _cpu_model() -> Optional[str]:
    """The CPU's name (``/proc/cpuinfo``'s model name on Linux, else the platform's), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


@functools.lru_cache(maxsize=1)
def _static() -> dict:
    """What does not change while the process runs: the CPU, the builds and the versions."""
    import numpy
    import torch

    try:
        build = parse_build(torch.__config__.show())
    except Exception:  # a build without the config text: the versions stay unknown
        build = parse_build("")
    mkl = bool(torch.backends.mkl.is_available())
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu": _cpu_model(),
            "arch": platform.machine() or None, "torch": torch.__version__, "numpy": numpy.__version__,
            "mkl": build["mkl"] if mkl else None, "onednn": build["onednn"],
            "blas": build["blas"], "lapack": build["lapack"], "openmp": build["openmp"],
            "python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count()}


def _cuda(device: Any) -> Optional[dict]:
    """The CUDA device of ``device`` ("cuda", "cuda:1", "auto", a ``torch.device``): its name,
    compute capability and the CUDA / cuDNN versions; None for a CPU or when CUDA is unavailable."""
    import torch

    if device is None:
        return None
    text = str(device)
    if text == "auto":
        text = "cuda"
    if not text.startswith("cuda") or not torch.cuda.is_available():
        return None
    dev = torch.device(text)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"device": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}",
            "cuda": torch.version.cuda, "cudnn": cudnn, "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32)}


def machine(device: Any = None) -> dict:
    """The machine a result is computed on, JSON-ready (strings, integers, booleans, None):

    - ``cpu_capability``: the CPU kernel path torch dispatches to
      (``torch.backends.cpu.get_cpu_capability()``: "AVX2", "AVX512", "DEFAULT", ...), ``cpu`` (its
      name), ``arch``;
    - ``torch``, ``numpy``, ``mkl`` (None when torch runs without MKL), ``onednn`` and whether it is
      enabled (``onednn_enabled``), ``blas``, ``lapack``, ``openmp`` (from ``torch.__config__.show()``);
    - ``threads`` and ``interop_threads`` (torch's, now), ``cpu_count``, ``python``, ``platform``;
    - ``env``: the variables of :data:`NUMERIC_ENV` that are set;
    - ``cuda``: with ``device`` a CUDA device, its name, compute capability, CUDA / cuDNN versions and
      TF32 setting; else None.
    """
    import torch

    env = {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ}
    return {**_static(), "onednn_enabled": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
            "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(), "env": env,
            "cuda": _cuda(device)}


@functools.lru_cache(maxsize=1)
def difftx_commit() -> Optional[str]:
    """The git commit of the difftx source this process runs (``git rev-parse HEAD`` in its checkout), or None
    for an installed copy, a machine without git, or a checkout git cannot read."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    out = done.stdout.strip()
    return out if done.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", out) else None


MACHINE_FILE = "machine.json"  # beside a compare model's train.json: the machine that trained it


def write_machine(folder: str | os.PathLike, device: Any = None) -> Path:
    """``folder/machine.json``: :func:`machine` of this process (strict JSON, written atomically)."""
    from .io import atomic_write, dumps_strict

    path = Path(folder) / MACHINE_FILE
    text = dumps_strict(machine(device), indent=1) + "\n"
    atomic_write(path, lambda p: Path(p).write_text(text))
    return path


def read_machine(folder: str | os.PathLike) -> Optional[dict]:
    """The record :func:`write_machine` left in ``folder``; None where there is none (a model
    trained by an older difftx). A file that is not a JSON object raises ``ValueError`` naming it."""
    from .io import read_json

    path = Path(folder) / MACHINE_FILE
    if not path.is_file():
        return None
    data = read_json(path, "the machine record of a compare model")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a machine record (not a JSON object); remove it to continue without one")
    return data


# what decides the kernels: two records that agree on these computed with the same code paths
KERNEL_KEYS = ("cpu_capability", "torch", "mkl", "onednn", "blas", "threads", "cuda")


def kernel_path(m: dict, *, threads: bool = True) -> tuple:
    """The part of a :func:`machine` record that decides which float32 kernels ran (hashable);
    ``threads=False`` leaves the thread count out."""
    cuda = m.get("cuda") or {}
    return tuple(cuda.get("device") if k == "cuda" else str(m.get(k)) for k in KERNEL_KEYS
                 if threads or k != "threads")


def machine_line(m: Optional[dict]) -> str:
    """One line naming the machine of a :func:`machine` record, e.g. "CPU kernel path AVX512 (AMD
    EPYC, x86_64), torch 2.13.0+cpu, MKL 2024.2, oneDNN 3.12.0 (enabled), BLAS mkl, numpy 2.4.6, 2
    threads, Python 3.11.7, Linux-..."; "machine not recorded" for None (a record of an older difftx)."""
    if not m:
        return "machine not recorded"
    where = ", ".join(x for x in (m.get("cpu"), m.get("arch")) if x)
    parts = [f"CPU kernel path {m.get('cpu_capability')}" + (f" ({where})" if where else ""), f"torch {m.get('torch')}",
             f"MKL {m['mkl']}" if m.get("mkl") else "no MKL",
             (f"oneDNN {m['onednn']} ({'enabled' if m.get('onednn_enabled') else 'disabled'})" if m.get("onednn")
              else "no oneDNN"),
             f"BLAS {m.get('blas') or 'unknown'}", f"numpy {m.get('numpy')}",
             f"{m.get('threads')} thread{'s' if m.get('threads') != 1 else ''}"]
    cuda = m.get("cuda")
    if cuda:
        parts.append(f"CUDA device {cuda['device']} (capability {cuda['capability']}, CUDA {cuda['cuda']}, "
                     f"cuDNN {cuda['cudnn']})")
    if m.get("env"):
        parts.append(", ".join(f"{k}={v}" for k, v in sorted(m["env"].items())))
    parts.append(f"Python {m.get('python')}, {m.get('platform')}")
    return ", ".join(parts)
