"""A run's checkpoints: where a resume continues (:func:`resume`: the checkpoint's weights, optimizer and
:class:`Position`) and what each save writes (:class:`Saver`). The files and their format:
:mod:`difftx.training.checkpointing`."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .. import __version__
from ..attention.registry import kind_code
from ..checkpoint import CheckpointError
from ..provenance import machine
from . import checkpointing as ckpt
from .config import TrainConfig
from .distributed import all_gather_object, broadcast_object, full_state_dicts, is_sharded, load_full_state_dicts
from .optim import lr_at
from .setup import RunSetup, TrainResult, tokenizer_name


@dataclass
class Position:
    """Where a run starts: step 0, or what the checkpoint it resumes recorded."""

    step: int = 0
    tokens_seen: int = 0
    train_time: Optional[float] = 0.0  # the training time before this call (None: a checkpoint that did not record it)
    loaders: Optional[list] = None  # every rank's data-loader state
    rngs: Optional[list] = None  # every rank's RNG state
    log_sums: Optional[dict] = None  # the sums of the log record in progress (None: a checkpoint at a log step)
    new_data: list[dict] = field(default_factory=list)  # each resume that continued on changed text (allow_new_data)


def _read_checkpoint(setup: RunSetup) -> tuple[dict, dict, dict]:
    """Rank 0 reads and checks the checkpoint to resume; every rank gets its trainer state
    (and, under DDP, the full model and optimizer states)."""
    dist, resume_dir = setup.dist, setup.resume_dir
    state, model_sd, optim_sd, failure = None, {}, {}, None
    if dist.is_main:
        try:
            state = ckpt.read_trainer_state(resume_dir)
            ckpt.check_kind_code(resume_dir, setup.model_config.attention, state.get("kind_code"))
            ckpt.check_compatible(resume_dir, setup.model_config, setup.train_dict, dist.world_size,
                                  tokenizer_name(setup.tokenizer), state)
            model_sd = ckpt.load_model_state(resume_dir, setup.model_config)
            optim_sd = ckpt.read_optimizer_state(resume_dir)
        except CheckpointError as e:
            failure = str(e)
    state, failure = broadcast_object((state, failure))
    if failure:  # on every rank, so none is left waiting
        raise CheckpointError(failure)
    if dist.distributed and not is_sharded(setup.bare):  # DDP: every rank needs the full copy
        model_sd, optim_sd = broadcast_object((model_sd, optim_sd))
    return state, model_sd, optim_sd


def resume(setup: RunSetup) -> Position:
    """Continue the checkpoint :meth:`RunSetup.start` chose (step 0 when none): its weights, optimizer and loss
    scaler are loaded into the setup's; its step, tokens, training time, data-loader and RNG states returned."""
    config, resume_dir = setup.config, setup.resume_dir
    if resume_dir is None:
        return Position()
    state, model_sd, optim_sd = _read_checkpoint(setup)
    try:  # FSDP2: rank 0's copy is broadcast shard by shard inside
        load_full_state_dicts(setup.model, setup.optimizer, model_sd, optim_sd)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{resume_dir / ckpt.OPTIM_NAME}: does not fit this model/optimizer "
                              f"({e})") from e
    position = Position(step=int(state["step"]), tokens_seen=int(state.get("tokens_seen", 0)),
                        train_time=state.get("train_time_s"),  # None: written by a difftx that did not record it
                        loaders=state["loaders"], rngs=state["rng"],
                        log_sums=state.get("log_sums"))  # None: a checkpoint at a log step, or from an older difftx
    if setup.scaler is not None and state.get("scaler"):
        setup.scaler.load_state_dict(state["scaler"])
    position.new_data = _new_data(setup, state, position.step)
    if position.step > config.steps:  # before anything in the run folder is rewritten
        raise ValueError(f"TrainConfig.steps: {config.steps} is below the step {position.step} of the "
                         f"checkpoint {resume_dir}; resume with steps >= {position.step}, or start a new "
                         f"run from it (--init-from) for another schedule")
    if setup.dist.is_main:
        note = _schedule_change_note(resume_dir, config, position.step)
        if note:
            print(note)
    return position


def _new_data(setup: RunSetup, state: dict, step: int) -> list[dict]:
    """The checkpoint's record of resumes on changed text, and this one's when it is one (said on stderr)."""
    kept = state.get("new_data")
    new_data = [r for r in kept if isinstance(r, dict)] if isinstance(kept, list) else []
    change = setup.plan.get("new_data")
    if change is None:
        return new_data
    new_data.append({"step": step, **change})
    if setup.dist.is_main:
        print(f"difftx train: note: {change['data_source']} changed since the checkpoint of step {step} "
              f"(SHA-256 {change['old_sha256'][:12]} then, {change['new_sha256'][:12]} now); continuing on the new "
              f"text as allow_new_data asks (recorded in trainer_state.json under new_data)", file=sys.stderr)
    return new_data


SCHEDULE_FIELDS = ("steps", "warmup_steps", "decay", "lr", "min_lr")


def _schedule_change_note(resume_dir: Path, config: TrainConfig, start_step: int) -> Optional[str]:
    """What a resume changes in the learning-rate schedule of the checkpoint it continues (``None``
    if nothing): the changed fields, the LR of the next step under the old and the new schedule,
    and the new warmup and decay."""
    try:
        saved = TrainConfig.from_dict(json.loads((resume_dir / ckpt.TRAIN_CONFIG_NAME).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None  # check_compatible has read this file already; nothing to compare with
    changed = [f"{k} {getattr(saved, k)} -> {getattr(config, k)}" for k in SCHEDULE_FIELDS
               if getattr(saved, k) != getattr(config, k)]
    if not changed:
        return None
    step = start_step + 1
    before, after = lr_at(step, saved), lr_at(step, config)
    warmup = f"warmup to {config.lr:.3g} until step {config.warmup_steps}" if config.warmup_steps > start_step \
        else f"no warmup (it ended at step {config.warmup_steps})"
    decay = f"then constant {config.lr:.3g}" if config.decay == "constant" else \
        f"{config.decay} decay to {config.min_lr:.3g} at step {config.steps}"
    return (f"difftx train: the resume changes the schedule ({', '.join(changed)}): the learning rate at step "
            f"{step} goes from {before:.3g} to {after:.3g}; from here: {warmup}, {decay}")




class Saver:
    """The checkpoints a run writes (rank 0 writes; every rank takes part): when (:meth:`saves_at`), from the
    one model (:meth:`save`) or from given full states (:meth:`write`, a stack's), with the trainer state a
    resume needs (:meth:`trainer_state`)."""

    def __init__(self, setup: RunSetup, position: Position, result: TrainResult) -> None:
        self.setup, self.position, self.result = setup, position, result

    def saves_at(self, step: int, stop: bool) -> bool:
        interval = self.setup.config.ckpt_interval
        return bool(interval and step % interval == 0) or step == self.setup.end_step or stop

    def save(self, step: int, log_sums: Optional[dict]) -> None:
        """A checkpoint of this step, written by rank 0 (the full states are gathered first under
        FSDP2). A failed write stops every rank; the previous checkpoint is intact."""
        setup = self.setup
        model_sd, optim_sd = {}, {}
        if setup.dist.is_main or is_sharded(setup.bare):  # collective under FSDP2; replicated (DDP) state: rank 0's
            model_sd, optim_sd = full_state_dicts(setup.model, setup.optimizer)
        self.write(step, model_sd, optim_sd, log_sums)

    def write(self, step: int, model_sd: dict, optim_sd: dict, log_sums: Optional[dict],
              keep_last: Optional[int] = None) -> None:
        """Rank 0 writes the checkpoint of ``step`` from these full states, with every rank's data
        loader position and RNG state and ``log_sums`` (the sums of the log record in progress, or None), then
        keeps ``keep_last`` checkpoints (default the config's)."""
        setup, result = self.setup, self.result
        loaders = all_gather_object(setup.loader.state_dict())
        rngs = all_gather_object(ckpt.rng_state())
        failure: Optional[BaseException] = None
        if setup.dist.is_main:
            try:
                result.last_checkpoint = ckpt.save_checkpoint(
                    setup.out_dir, step, model_state=model_sd, model_config=setup.model_config,
                    optim_state=optim_sd, trainer_state=self.trainer_state(step, loaders, rngs, log_sums),
                    train_config=setup.train_dict, tokenizer=setup.tokenizer,
                    keep_last=keep_last or setup.config.keep_last)
            except Exception as e:  # the previous checkpoint is intact; stop every rank
                failure = e
        last, message = broadcast_object((result.last_checkpoint, None if failure is None else repr(failure)))
        if failure is not None:
            raise failure
        if message is not None:
            raise RuntimeError(f"rank 0 failed to write the checkpoint of step {step}: {message}")
        result.last_checkpoint = last

    def trainer_state(self, step: int, loaders: list, rngs: list, log_sums: Optional[dict]) -> dict:
        """``trainer_state.json``: what a resume needs besides the weights and optimizer."""
        setup, result, train_time = self.setup, self.result, self.position.train_time
        new_data = self.position.new_data
        # {"kind_code": {"file", "sha256"}} when the kind is not built into difftx: a resume after its file is
        # edited is refused (difftx.attention.registry.kind_code)
        code = kind_code(setup.model_config.attention)
        return {"step": step, "tokens_seen": result.tokens_seen, "world_size": setup.dist.world_size,
                "train_time_s": None if train_time is None else train_time + result.train_time_s,
                "val_split_tokens": len(setup.val_store) if setup.val_store is not None else 0,
                "loaders": loaders, "rng": rngs, "tokenizer": tokenizer_name(setup.tokenizer),
                "scaler": setup.scaler.state_dict() if setup.scaler is not None else None,
                "log_sums": log_sums,  # the sums of the log record in progress (a stop between two records)
                "machine": machine(setup.device),  # where this checkpoint was computed (difftx.provenance)
                "difftx": __version__, **({} if code is None else {"kind_code": code}),  # the code it was computed with
                **({"new_data": new_data} if new_data else {})}  # resumes that continued on changed text
