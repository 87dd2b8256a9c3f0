"""The model room: a registry of families, their shared layers and decoder, the checkpoint
loader, tokenizer and chat template."""

from mstar.engine.model.config import ModelConfig, ModelLoadError, RopeScaling
from mstar.engine.model.decoder import AttentionContext, Decoder
from mstar.engine.model.gguf_convert import convert_gguf, default_model_path
from mstar.engine.model.loader import load_model
from mstar.engine.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

__all__ = [
    "AttentionContext",
    "ChatTemplateError",
    "Decoder",
    "IncrementalDetokenizer",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "convert_gguf",
    "default_model_path",
    "load_model",
]
