"""Training: config, the resumable trainer loop, checkpoints of training state, distributed
helpers and metrics. See docs/training.md."""

from .batches import Batch
from .config import TRAIN_PRESETS, TrainConfig, load_train_config, train_preset
from .trainer import TrainingDivergedError, TrainResult, evaluate, train, train_stacked

__all__ = ["Batch", "TRAIN_PRESETS", "TrainConfig", "TrainResult", "TrainingDivergedError", "evaluate",
           "load_train_config", "train", "train_preset", "train_stacked"]
