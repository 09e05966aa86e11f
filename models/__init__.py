"""Decoder-only MoE transformers built on `uniep_jax.UniEPMoE`.

models.config       ModelConfig and the named configs (CONFIGS, get_config)
models.transformer  Transformer (Flax NNX)
models.report       parameter counts and FLOPs per token (`python -m models.report`)
"""

from models.config import CONFIGS, ModelConfig, get_config
from models.transformer import Transformer

__all__ = ["CONFIGS", "ModelConfig", "Transformer", "get_config"]
