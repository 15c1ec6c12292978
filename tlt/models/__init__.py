"""Model core: one decoder for Llama / Qwen2 / Qwen3 that loads HF checkpoints."""
from tlt.models.config import ModelConfig
from tlt.models.decoder import CacheView, Decoder, DecoderLayer, RMSNorm
from tlt.models.loader import hf_state_dict, load_model, load_tokenizer, read_config, save_model

__all__ = ["ModelConfig", "CacheView", "Decoder", "DecoderLayer", "RMSNorm", "hf_state_dict", "load_model",
           "load_tokenizer", "read_config", "save_model"]
