"""`tlt bench trl`: the same benchmark as `tlt bench trl_grpo` (TRL's GRPOTrainer vs tlt per RL step)."""
from tlt.bench.trl_grpo import main

__all__ = ["main"]
