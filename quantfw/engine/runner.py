"""Runs one `StepBatch` through the model: packs it into one int32 tensor (`engine.step`), builds
the attention metadata on the device, calls the cache-aware forward, returns the logits of the
rows to sample. Decode steps, and with ``prefill_graph_tokens`` short steps that prefill,
replay CUDA graphs when enabled (`engine.cuda_graphs`).

Decode windows: for a batch of plain greedy sequences the engine may run `window` decode steps
back to back: each captured step ends by taking the argmax of its logits, writing it as the next
step's input token and advancing positions and context lengths, so the GPU runs the window
without waiting for the host; the host reads the window's tokens once at the end.

Under tensor parallelism the leader broadcasts each step as two tensors (a 9-int header, then
the packed payload) and the other ranks sit in `worker_loop`, running exactly the same steps
from the same tensors (in a window, every rank takes the argmax of the same all-gathered
logits); only the leader samples. No Python object is pickled per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quantfw import distributed as qdist
from quantfw.engine.cuda_graphs import DecodeGraphs, PrefillGraphs, naming_the_way_out
from quantfw.engine.kv_cache import KVCache
from quantfw.engine.scheduler import StepBatch
from quantfw.engine.step import HEADER_LEN, STOP, PackedStep, build_metadata, pack
from quantfw.layers.attention import AttentionBackend


class ModelRunner:
    """Runs the engine's steps; with `cuda_graphs`, through `DecodeGraphs` and, for
    ``prefill_graph_tokens`` > 0 (as `cuda_graphs.resolve_prefill_graph_tokens` validates it
    for the engine), `PrefillGraphs`."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        *,
        cuda_graphs: bool,
        max_graph_batch: int,
        graph_backend: AttentionBackend | None = None,
        max_window: int = 1,
        prefill_graph_tokens: int = 0,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.block_size = kv_cache.block_size
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if cuda_graphs:
            if device.type != "cuda":
                raise ValueError("cuda_graphs=True needs a CUDA device")
            graph_backend = graph_backend or backend
            if not graph_backend.graph_capturable:
                raise ValueError(
                    f"the {graph_backend.name} attention backend cannot run in CUDA graphs"
                )
            with torch.inference_mode():
                with naming_the_way_out("decode", "cuda_graphs=False (--no-cuda-graphs)"):
                    self.graphs = DecodeGraphs(
                        model, kv_cache, graph_backend, device, max_graph_batch, max_window
                    )
                if prefill_graph_tokens:
                    switch = "prefill_graph_tokens=0 (--prefill-graph-tokens 0)"
                    with naming_the_way_out("prefill", switch):
                        self.prefill_graphs = PrefillGraphs(
                            model, kv_cache, graph_backend, device, prefill_graph_tokens,
                            max_graph_batch, pool=self.graphs.pool,
                        )  # fmt: skip
            qdist.on_teardown(self.release_graphs)

    def release_graphs(self) -> None:
        """Drop the CUDA graphs, at teardown (`distributed.destroy_distributed`: graphs that
        captured NCCL collectives must be gone before the process group is); the engine is not
        stepped after it (its decode windows need the graphs)."""
        self.graphs = None
        self.prefill_graphs = None

    @property
    def max_window(self) -> int:
        """The longest decode window the graphs can run (1: none)."""
        return self.graphs.max_window if self.graphs is not None else 1

    @torch.inference_mode()
    def run(self, step: PackedStep, stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Logits [num_sample, vocab] (float32) of this step; for a decode window, its greedy
        tokens [steps run, B] (int32): all `step.window` steps, or fewer when `stop` (asked
        between them, `DecodeGraphs.run_window`) says so."""
        if step.window > 1:
            if self.graphs is None or not self.graphs.can_run(step):
                raise ValueError("a decode window needs the CUDA graphs of its batch size")
            return self.graphs.run_window(step, stop)
        if self.graphs is not None and self.graphs.can_run(step):
            return self.graphs.run(step).float()
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(step):
            logits = self.prefill_graphs.run(step)
            if not step.num_sample:  # only prefill chunks this step
                return logits.new_empty(0, 0, dtype=torch.float32)
            return logits.float()
        parts = step.split()
        meta = build_metadata(step, parts, self.backend, self.block_size)
        self.backend.prepare(meta)
        hidden = self.model.forward_cached(parts["input_ids"], parts["positions"], meta)
        if not step.num_sample:  # only prefill chunks this step
            return hidden.new_empty(0, 0, dtype=torch.float32)
        rows = parts["sample_rows"].long()
        return self.model.compute_logits(hidden.index_select(0, rows)).float()

    def execute(
        self, batch: StepBatch, window: int = 1, stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """Leader side: send the step to the other TP ranks, then run it. `stop` may end a
        decode window early on one GPU only (the other ranks run whole windows)."""
        step = pack(batch, self.block_size, self.kv_cache.max_model_len, window)
        payload = step.payload.to(self.device, non_blocking=True)
        if qdist.get_tp_size() > 1:
            if stop is not None:
                raise ValueError("a decode window cannot end early under tensor parallelism")
            header = torch.tensor(step.header(), dtype=torch.int32, device=self.device)
            qdist.broadcast(header)
            qdist.broadcast(payload)
        step.payload = payload
        return self.run(step, stop)

    def worker_loop(self) -> None:
        """Non-leader TP ranks: run every step the leader broadcasts until it says stop."""
        header = torch.empty(HEADER_LEN, dtype=torch.int32, device=self.device)
        while True:
            qdist.broadcast(header)
            values = header.tolist()
            if values[0] == STOP:
                return
            step = PackedStep.from_header(values, payload=header)
            payload = torch.empty(step.payload_len, dtype=torch.int32, device=self.device)
            qdist.broadcast(payload)
            step.payload = payload
            self.run(step)

    def stop_workers(self) -> None:
        if qdist.get_tp_size() > 1 and qdist.is_tp_leader():
            header = torch.zeros(HEADER_LEN, dtype=torch.int32, device=self.device)
            header[0] = STOP
            qdist.broadcast(header)
