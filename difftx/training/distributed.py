"""Multi-process training helpers, applied from outside the model (the model never imports
``torch.distributed``).

Launch with ``torchrun``: it sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``, which :func:`init_distributed` reads. The backend is ``nccl`` on CUDA and
``gloo`` on CPU. :func:`parallelize` wraps a model with DDP, or shards it with FSDP2
(``fully_shard`` on each block, then on the root).

Checkpoints under FSDP2 use *full* state dicts gathered to rank 0 (and broadcast back from
rank 0 on load), so a checkpoint written by any mode loads in any other, at the cost of one
full copy of the model and optimizer state in rank 0's CPU memory while saving.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: ``rank`` of ``world_size`` and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` -> this process's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but no CUDA device is available (use cpu or auto)")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout: Optional[timedelta] = None) -> DistInfo:
    """Join the process group described by torchrun's environment, if any.

    Without torchrun (or with ``WORLD_SIZE=1``) this is a no-op returning rank 0 of 1.
    ``timeout``: how long a collective may wait (torch's default when None; a longer one lets the
    other ranks wait while rank 0 alone does a long piece of work, see :func:`on_main`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if world <= 1:
        return DistInfo(0, 1, 0, dev)
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo",
                                device_id=dev if dev.type == "cuda" else None,
                                **({"timeout": timeout} if timeout is not None else {}))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def under_torchrun() -> bool:
    """True in a worker that torchrun started with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def exit_worker(code: int) -> None:
    """End a torchrun worker at once (``os._exit``), after flushing its output, skipping Python's
    interpreter shutdown.

    Why: once a model has been wrapped in DDP, ``destroy_process_group`` leaves gloo's worker
    threads running (measured with torch 2.13: the threads outlive it; without DDP they stop). A
    worker thread still releasing the tensors of a finished collective then needs the GIL while
    the interpreter shuts down, and the process aborts ("terminate called without an active
    exception", exit -6) after a successful run: about 1 run in 30 of ``tests/test_distributed.py``'s
    DDP worker, also with a barrier before ``destroy_process_group``; 0 in 100 with this exit.
    Files are closed by then (checkpoints are written atomically), so nothing is lost.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def parallelize(model: nn.Module, mode: str, device: Optional[torch.device] = None,
                compile: bool = False) -> nn.Module:
    """Wrap ``model`` for data-parallel training.

    ``ddp``: :class:`~torch.nn.parallel.DistributedDataParallel` (replicated weights, gradients
    all-reduced). ``fsdp``: FSDP2 ``fully_shard`` on each transformer block, then on the root
    (parameters become sharded DTensors; the returned module is the same object). ``compile``
    compiles each block (FSDP2) or the wrapped model (DDP).
    Returns ``model`` unchanged when no process group is initialised.
    """
    if mode not in ("ddp", "fsdp"):
        raise ValueError(f"parallel mode must be 'ddp' or 'fsdp', got {mode!r}")
    if not is_initialized():
        return torch.compile(model) if compile else model
    if mode == "ddp":
        ids = [device.index] if device is not None and device.type == "cuda" else None
        wrapped = DDP(model, device_ids=ids)
        return torch.compile(wrapped) if compile else wrapped
    from torch.distributed.fsdp import fully_shard  # about a second to import: only under torchrun with FSDP2

    for block in model.layers:
        if compile:
            block.compile()
        fully_shard(block)
    fully_shard(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under ``torch.compile`` and DDP wrappers (FSDP2 does not wrap)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model


def on_main(fn, share: bool = False) -> Any:
    """Run ``fn()`` on rank 0 alone while the other ranks wait; an exception there is raised on
    every rank (rank 0: the original; others: a ``RuntimeError`` quoting it), so no rank is left
    waiting in a later collective. Returns ``fn()``'s value on rank 0; on the others ``None``, or
    rank 0's value when ``share`` (it must then be picklable). Without a process group: ``fn()``."""
    if not is_initialized():
        return fn()
    value, failure = None, None
    if dist.get_rank() == 0:
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after telling the others
            failure = e
    message = None if failure is None else f"{type(failure).__name__}: {failure}"
    message, shared = broadcast_object((message, value if share and failure is None else None))
    if failure is not None:
        raise failure
    if message is not None:
        raise RuntimeError(f"rank 0 failed: {message}")
    return value if dist.get_rank() == 0 else shared


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (in place copy), identity without a process group."""
    if not is_initialized():
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a picklable value), in rank order."""
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) parameter; collective for DTensors."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def is_sharded(model: nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state with full (unsharded) tensors on CPU, keyed by parameter name.

    Collective under FSDP2 (every rank must call it); the result is complete on rank 0.
    Works the same on plain and DDP models, so checkpoints are interchangeable across modes.
    A single process with an unsharded model builds the same dicts directly (importing
    ``torch.distributed.checkpoint`` takes seconds, a noticeable share of a short CPU run).
    """
    if not is_initialized() and not is_sharded(model):
        return _plain_state_dicts(unwrap(model), optimizer)
    from torch.distributed.checkpoint.state_dict import (  # slow to import: only when sharded or distributed
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = unwrap(model)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def _plain_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """What ``get_model_state_dict`` / ``get_optimizer_state_dict`` (full, CPU) return for a plain
    model in one process: the optimizer's state and groups keyed by parameter name (a shared
    parameter by its first name), tensors on CPU."""
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters():
        first_name.setdefault(id(p), name)
    order = [first_name[id(p)] for group in optimizer.param_groups for p in group["params"]]
    sd = optimizer.state_dict()  # state and params keyed by index in param_groups order
    cpu = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
    optim = {"state": {order[i]: {k: cpu(v) for k, v in st.items()} for i, st in sd["state"].items()},
             "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]}
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, optim


def load_full_state_dicts(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], model_state: dict,
                          optim_state: Optional[dict]) -> None:
    """Load full state dicts written by :func:`full_state_dicts` (rank 0's copy is broadcast
    under FSDP2, so other ranks may pass empty dicts)."""
    from torch.distributed.checkpoint.state_dict import (  # slow to import: a resume pays it, a fresh run not
        StateDictOptions, set_model_state_dict, set_optimizer_state_dict,
    )

    model = unwrap(model)
    sharded = is_sharded(model)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded)
    set_model_state_dict(model, model_state, options=opts)
    if optimizer is not None and optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
