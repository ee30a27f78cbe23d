"""EAGLE-3 draft training (``eaglet train-draft``): see eaglet/train/trainer.py."""

from eaglet.train.trainer import TrainDraftConfig, TrainDraftResult, train_draft

__all__ = ["TrainDraftConfig", "TrainDraftResult", "train_draft"]
