"""Built-in models and the model registry."""

from quantfw.models.registry import (
    MODELS,
    register_model,
    resolve_model_class,
    supported_architectures,
)

__all__ = ["MODELS", "register_model", "resolve_model_class", "supported_architectures"]
