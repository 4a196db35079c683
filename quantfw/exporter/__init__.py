"""Export a dense HF checkpoint into a quantized on-disk format (``quantfw quantize``).

`quantize_checkpoint` streams the checkpoint tensor by tensor through one method's exporter and
writes safetensors shards, config.json (with the method's ``quantization_config``) and the
tokenizer files. Each method lives in its own module and is registered by name in
`EXPORT_METHODS` (``"module:attr"`` of a `build(method, args, hf_config) -> MethodExporter`).
"""

from __future__ import annotations

from quantfw.exporter.checkpoint import (
    EXPORT_METHODS,
    MethodExporter,
    quantize_checkpoint,
    register_export_method,
)

__all__ = ["EXPORT_METHODS", "MethodExporter", "quantize_checkpoint", "register_export_method"]
