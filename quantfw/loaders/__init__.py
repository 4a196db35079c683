"""Model loaders: real checkpoints (DefaultModelLoader) and random weights (DummyModelLoader)."""

from quantfw.config import LoadConfig
from quantfw.loaders.base import BaseModelLoader, initialize_model, process_weights_after_loading
from quantfw.loaders.default import DefaultModelLoader
from quantfw.loaders.dummy import DummyModelLoader


def get_model_loader(load_config: LoadConfig) -> BaseModelLoader:
    if load_config.load_format == "dummy":
        return DummyModelLoader(load_config)
    return DefaultModelLoader(load_config)


__all__ = [
    "BaseModelLoader",
    "DefaultModelLoader",
    "DummyModelLoader",
    "get_model_loader",
    "initialize_model",
    "process_weights_after_loading",
]
