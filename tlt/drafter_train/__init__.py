"""Online drafter training: rollout hidden states -> buffer -> packed batches -> spot trainer on idle replicas."""
from tlt.drafter_train.buffer import DrafterBuffer, DrafterSample
from tlt.drafter_train.coordinator import (AssignGroups, PublishDrafter, ReplicaState, SpotCoordinator, StartTraining,
                                           StepReport, StopTraining)
from tlt.drafter_train.packing import PackedBatch, Window, block_causal_mask, pack
from tlt.drafter_train.trainer import AsyncCheckpointer, DrafterTrainer, StepMetrics, TrainStats, should_publish

__all__ = ["DrafterBuffer", "DrafterSample", "AssignGroups", "PublishDrafter", "ReplicaState", "SpotCoordinator",
           "StartTraining", "StepReport", "StopTraining", "PackedBatch", "Window", "block_causal_mask", "pack",
           "AsyncCheckpointer", "DrafterTrainer", "StepMetrics", "TrainStats", "should_publish"]
