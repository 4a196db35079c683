"""Random weights with the right shapes and dtypes, for benchmarks without a checkpoint.

Every parameter is filled the way a checkpoint would fill it: one full (unsharded) tensor is
drawn on the target device from a generator seeded with the parameter's name, and the
parameter's own ``weight_loader`` keeps this rank's shard of it. So a TP=N dummy model computes
the same function as the TP=1 one, and the values do not depend on the device count (they do
depend on the device type: CPU and CUDA generators draw different streams).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from quantfw import distributed as qdist
from quantfw.config import ModelConfig
from quantfw.layers.vocab import VocabParallelEmbedding
from quantfw.loaders.base import BaseModelLoader, initialize_model, process_weights_after_loading
from quantfw.models.utils import default_weight_loader

#: floating point parameters are drawn from U(-DUMMY_RANGE, DUMMY_RANGE) (as vLLM's dummy loader
#: does), small enough that activations stay finite through deep fp16 models
DUMMY_RANGE = 1e-3


def dummy_generator(name: str, device: torch.device | str) -> torch.Generator:
    """The generator a parameter's values are drawn from: seeded by its name only."""
    return torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))


def fill_random(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Fill in place: floats uniform in [-DUMMY_RANGE, DUMMY_RANGE), integers any bit pattern
    of their dtype (every packed code and zero point), booleans a coin flip."""
    if tensor.dtype.is_floating_point:
        tensor.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
    elif tensor.dtype == torch.bool or tensor.dtype == torch.int64:
        tensor.random_(generator=generator)
    else:
        info = torch.iinfo(tensor.dtype)
        tensor.random_(info.min, info.max + 1, generator=generator)


def full_model(model: nn.Module, model_config: ModelConfig) -> nn.Module:
    """`model` as tensor-parallel size 1 would build it: the model itself at TP=1, otherwise a
    TP=1 twin on the meta device (shapes only)."""
    if qdist.get_tp_size() == 1:
        return model
    with qdist.simulated_tp(1, 0):
        return initialize_model(model_config, "meta")


def checkpoint_shapes(full: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of the tensor a checkpoint would hold for each parameter of the TP=1 `full`
    model: the parameter's own, except that vocabulary rows are not padded and a parameter that
    quantizes what it loads declares its dense source as ``checkpoint_spec = (shape, dtype)``."""
    shapes = {}
    for module_name, module in full.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            shape, dtype = getattr(param, "checkpoint_spec", (param.shape, param.dtype))
            shape = list(shape)
            if isinstance(module, VocabParallelEmbedding):
                shape[0] = module.num_embeddings
            key = f"{module_name}.{param_name}" if module_name else param_name
            shapes[key] = (torch.Size(shape), dtype)
    return shapes


@torch.no_grad()
def load_dummy_weights(model: nn.Module, model_config: ModelConfig) -> None:
    """Fill every parameter of `model` (this rank's shards) with its dummy values.

    A parameter whose random bits would be invalid (group indices, zero points that must fit a
    format) carries ``dummy_init(tensor, generator)``, which fills the full TP=1 `tensor` instead
    of `fill_random`; it must depend only on the tensor's shape and the generator, not on the rank.
    """
    shapes = checkpoint_shapes(full_model(model, model_config))
    for name, param in model.named_parameters():
        if name not in shapes:
            raise ValueError(
                f"dummy loader: parameter {name!r} of {type(model).__name__} has no counterpart "
                "in the model built at tensor_parallel_size 1"
            )
        shape, dtype = shapes[name]
        full = torch.empty(shape, dtype=dtype, device=param.device)
        init = getattr(param, "dummy_init", None) or fill_random
        init(full, dummy_generator(name, param.device))
        getattr(param, "weight_loader", default_weight_loader)(param, full)


class DummyModelLoader(BaseModelLoader):
    def load_model(self, model_config: ModelConfig, device: torch.device) -> nn.Module:
        model = initialize_model(model_config, device)
        load_dummy_weights(model, model_config)
        process_weights_after_loading(model)
        return model.eval()
