"""tlt: reasoning RL (GRPO family) with adaptive speculative decoding and a drafter trained on idle compute."""
from tlt.engine.outputs import CompletionOutput, RequestOutput
from tlt.engine.params import SamplingParams
from tlt.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
