"""Tiny random GPT-OSS and Qwen3-MoE checkpoints built with transformers, their MXFP4 exports,
and transformers references with the MXFP4-rounded weights (no hub access)."""

from __future__ import annotations

import contextlib
import glob
import os
import re
from collections.abc import Callable

import pytest
import torch
from tiny_checkpoint import hf_greedy  # noqa: F401 (re-exported for the MoE tests)

VOCAB = 300
#: GPT-OSS: 3 layers (sliding, full, sliding) with an 8-token window; I = 96 = 3 scale blocks,
#: so TP=2 pads each rank to 2 blocks (rank 1 holds one real block and one of zeros)
GPT_OSS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=6,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
    initializer_range=0.15,
    eos_token_id=None,  # greedy runs the full length in transformers and the engine
    tie_word_embeddings=False,
)
#: Qwen3-MoE: layer 1 keeps a dense MLP (mlp_only_layers)
QWEN3_MOE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    mlp_only_layers=[1],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=256,
    initializer_range=0.15,
    eos_token_id=None,  # greedy runs the full length in transformers and the engine
    tie_word_embeddings=False,
)
FAMILIES = {"gpt_oss": GPT_OSS, "qwen3_moe": QWEN3_MOE}


def build_hf(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers zero-initialises the expert biases and sets the norm
        for name, p in model.named_parameters():  # weights to one: make them count
            if name.endswith(("_proj_bias", "router.bias")):
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def save(model: torch.nn.Module, path: str) -> str:
    model.save_pretrained(path)
    return path


def export_mxfp4(dense: str, out: str, *, experts_only: bool) -> str:
    from quantfw.exporter import quantize_checkpoint

    return quantize_checkpoint(dense, out, method="mxfp4", experts_only=experts_only)


def rounded_reference(dense: str, mxfp4_dir: str) -> torch.nn.Module:
    """transformers' model of the dense checkpoint with every tensor the MXFP4 export
    quantized replaced by its dequantization (decoded with transformers' own MXFP4 code)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    loaded = 0
    for file in sorted(glob.glob(os.path.join(mxfp4_dir, "*.safetensors"))):
        with safe_open(file, "pt") as f:
            for name in [n for n in f.keys() if n.endswith("_blocks")]:  # noqa: SIM118
                base = name[: -len("_blocks")]
                blocks, scales = f.get_tensor(name), f.get_tensor(base + "_scales")
                if base.endswith(".weight"):  # a linear layer [O, I]: experts of one
                    value = convert_moe_packed_tensors(
                        blocks[None], scales[None], dtype=torch.float32
                    )[0].t()
                else:  # GPT-OSS experts: transformers returns their [E, in, out] layout
                    value = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                with torch.no_grad():
                    _param_view(params, base).copy_(value)
                loaded += 1
    assert loaded, f"{mxfp4_dir} holds no MXFP4 tensors"
    return model


def _param_view(params: dict, name: str) -> torch.Tensor:
    """The parameter (or slice of one) a checkpoint name holds; transformers 5 fuses Qwen3-MoE's
    per-expert tensors into ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj``."""
    if name in params:
        return params[name]
    match = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
    assert match, f"no parameter for {name}"
    head, e, proj = match.group(1), int(match.group(2)), match.group(3)
    if proj == "down":
        return params[f"{head}.down_proj"][e]
    fused = params[f"{head}.gate_up_proj"][e]
    half = fused.shape[0] // 2
    return fused[:half] if proj == "gate" else fused[half:]


def record_routing(
    model: torch.nn.Module,
) -> tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None]]:
    """Hooks on a quantfw model's MoE layers, in layer order per forward: (the list of each
    layer's expert ids [tokens, k] as the layer itself selects them, the list of its router
    logits [tokens, E] (float32, CPU), a function that removes the hooks)."""
    from quantfw.kernels.moe import select_experts
    from quantfw.layers.moe import FusedMoE

    chosen: list[torch.Tensor] = []
    logits_seen: list[torch.Tensor] = []

    def hook(layer, args):
        logits = args[1].reshape(-1, layer.num_experts)
        _, ids = select_experts(logits, layer.top_k, layer.scoring, layer.renormalize)
        chosen.append(ids.cpu())
        logits_seen.append(logits.float().cpu())

    handles = [
        m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, FusedMoE)
    ]
    return chosen, logits_seen, lambda: [h.remove() for h in handles]


@contextlib.contextmanager
def gpt_oss_routed_as(reference: torch.nn.Module, chosen: list[torch.Tensor]):
    """transformers' GPT-OSS `reference` routes every token to the experts in `chosen` (one
    [tokens, k] per layer, `record_routing`'s list) with weights from its own router logits (the
    softmax of those experts' logits). Yields the list each layer's ``(router logits [tokens, E],
    the reference's own top-k ids)`` is appended to, for `near_tie_gap`."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(router, args, out):
        assert isinstance(out, tuple) and len(out) == 3, (
            "GPT-OSS router output should be (logits, top-k scores, top-k ids); got "
            f"{type(out).__name__} of {len(out) if isinstance(out, tuple) else 1}"
        )
        logits, _, own_ids = out
        ids = chosen[len(seen)].to(logits.device)
        assert ids.shape == own_ids.shape, (ids.shape, own_ids.shape)
        seen.append((logits.detach().float().cpu(), own_ids.cpu()))
        scores = torch.softmax(logits.gather(-1, ids), dim=-1, dtype=logits.dtype)
        return logits, scores, ids

    handles = [layer.mlp.router.register_forward_hook(hook) for layer in reference.model.layers]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == len(chosen), f"the reference ran {len(seen)} MoE layers, {len(chosen)}"


def near_tie_gap(seen: list[tuple[torch.Tensor, torch.Tensor]], chosen: list[torch.Tensor]):
    """The worst routing disagreement, relative to the layer's largest |logit|: over layers and
    tokens, how far below the reference's k-th largest logit the lowest of the experts `chosen`
    instead lies (0 where both pick the same set). A near-tie flip gives a tiny gap; choosing
    the wrong experts gives a large one. Returns (gap, [(layer, token)] of the flips)."""
    worst, flips = 0.0, []
    for layer, ((logits, own), ids) in enumerate(zip(seen, chosen, strict=True)):
        kth = logits.gather(-1, own).min(-1).values
        lowest_chosen = logits.gather(-1, ids).min(-1).values
        gap = (kth - lowest_chosen).clamp(min=0) / logits.abs().max()
        worst = max(worst, gap.max().item())
        differs = (own.sort(-1).values != ids.sort(-1).values).any(-1)
        flips += [(layer, t) for t in differs.nonzero().flatten().tolist()]
    return worst, flips


def require_sm90_flashinfer() -> None:
    """Skip unless FlashInfer's SM90 fused MoE runs here (`flashinfer_sm90.available`)."""
    from quantfw.kernels.mxfp4 import flashinfer_sm90

    if not torch.cuda.is_available() or not flashinfer_sm90.available(torch.device("cuda")):
        pytest.skip("FlashInfer's SM90 fused MoE needs an SM90 GPU and flashinfer installed")
