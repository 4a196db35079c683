"""quantfw: load dense and quantized HF checkpoints, run them with tensor parallelism."""

from quantfw.api import load_model
from quantfw.config import LoadConfig, ModelConfig
from quantfw.engine import LLM, SamplingParams
from quantfw.layers.quantization import register_quantization_method
from quantfw.models.registry import register_model

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LoadConfig",
    "ModelConfig",
    "SamplingParams",
    "__version__",
    "load_model",
    "register_model",
    "register_quantization_method",
]
