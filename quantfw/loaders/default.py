"""Loads real checkpoints: safetensors first, then .bin/.pt; strict accounting of tensors."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from quantfw import distributed as qdist
from quantfw.config import ModelConfig
from quantfw.loaders.base import BaseModelLoader, initialize_model, process_weights_after_loading
from quantfw.loaders.weight_utils import (
    download_snapshot,
    find_weight_files,
    iterate_pt,
    iterate_safetensors,
)
from quantfw.models.utils import WeightLoadError


class DefaultModelLoader(BaseModelLoader):
    """A local folder or hub repo id -> weight files -> `model.load_weights` -> repack."""

    def prepare_folder(self, model: str) -> str:
        cfg = self.load_config
        return download_snapshot(
            model,
            load_format=cfg.load_format,
            revision=cfg.revision,
            cache_dir=cfg.download_dir,
            ignore_patterns=cfg.ignore_patterns,
        )

    def weight_files(self, model: str) -> tuple[list[str], bool]:
        folder = self.prepare_folder(model)
        return find_weight_files(
            folder, self.load_config.load_format, self.load_config.ignore_patterns
        )

    def iterate_weights(
        self, files: list[str], use_safetensors: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of every file, with a progress bar on TP rank 0. The file being read is
        kept in `self.current_file` so errors can name it."""
        reader = iterate_safetensors if use_safetensors else iterate_pt
        bar = tqdm(
            files,
            desc=f"Loading {'safetensors' if use_safetensors else 'pt'} shards",
            unit="shard",
            disable=not qdist.is_tp_leader() or len(files) == 0,
        )
        for path in bar:
            self.current_file = path
            yield from reader(path)

    def load_model(self, model_config: ModelConfig, device: torch.device) -> nn.Module:
        files, use_safetensors = self.weight_files(model_config.model)
        model = initialize_model(model_config, device)
        self.current_file: str | None = None
        try:
            model.load_weights(self.iterate_weights(files, use_safetensors))
        except WeightLoadError as e:
            if e.tensor_name is not None and self.current_file is not None:
                raise WeightLoadError(
                    f"{e} [file {os.path.basename(self.current_file)} in "
                    f"{os.path.dirname(self.current_file)}]",
                    tensor_name=e.tensor_name,
                ) from e
            raise
        process_weights_after_loading(model)
        return model.eval()
