"""The FusedMoE layer on its own: routing against transformers' routers, the intermediate dim
sharded with padding to whole 32-blocks (tp 1, 2, 4, 8 for I = 2880) and the ranks' partial
outputs summing to the TP=1 output, expert-parameter mappings with strict accounting."""

from __future__ import annotations

import pytest
import torch

from quantfw import distributed as qdist
from quantfw.kernels import moe, mxfp4
from quantfw.layers.activation import SwigluOAIAndMul
from quantfw.layers.moe import ExpertShard, FusedMoE, expert_params_mapping
from quantfw.layers.quantization.mxfp4 import Mxfp4Config
from quantfw.layers.sharding import ShardShapeError, padded_shard_size
from quantfw.models.utils import WeightLoadError, load_weights, map_checkpoint_name


@pytest.mark.parametrize("tp,per_rank", [(1, 2880), (2, 1440), (4, 736), (8, 384)])
def test_intermediate_2880_splits_into_whole_blocks(tp, per_rank):
    assert padded_shard_size(2880, tp, 32) == per_rank
    assert per_rank % 32 == 0 and per_rank * tp >= 2880
    assert padded_shard_size(2880, tp, 1) * tp >= 2880


def _reference(x, w13, b13, w2, b2, weights, ids, act):
    """Per token, per chosen expert, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = act(x[t].double() @ w13[e].double().T + b13[e].double())
            out[t] += weights[t, j].double() * (h @ w2[e].double().T + b2[e].double())
    return out


def _gpt_oss_style_checkpoint(e, h, i, quantized, g):
    """GPT-OSS tensors: interleaved gate/up rows, MXFP4 or bf16-style [in, out] storage."""
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.2
    w2 = torch.randn(e, h, i, generator=g) * 0.2
    b13, b2 = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    if quantized:
        (b13q, s13), (b2q, s2) = mxfp4.quantize(w13), mxfp4.quantize(w2)
        w13, w2 = (
            mxfp4.dequantize(b13q, s13, torch.float32),
            mxfp4.dequantize(b2q, s2, torch.float32),
        )
        tensors = {
            "gate_up_proj_blocks": (b13q, ExpertShard(None, "w13")),
            "gate_up_proj_scales": (s13, ExpertShard(None, "w13")),
            "down_proj_blocks": (b2q, ExpertShard(None, "w2")),
            "down_proj_scales": (s2, ExpertShard(None, "w2")),
        }
    else:
        tensors = {
            "gate_up_proj": (w13.transpose(1, 2).contiguous(), ExpertShard(None, "w13", True)),
            "down_proj": (w2.transpose(1, 2).contiguous(), ExpertShard(None, "w2", True)),
        }
    tensors["gate_up_proj_bias"] = (b13, ExpertShard(None, "w13"))
    tensors["down_proj_bias"] = (b2, ExpertShard(None, "w2"))
    # the layer's [gate | up] halves from the interleaved rows
    halves = lambda t: torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)  # noqa: E731
    return tensors, (halves(w13), halves(b13), w2, b2)


_PARAM_OF = {
    "gate_up_proj_blocks": "w13_blocks",
    "gate_up_proj_scales": "w13_scales",
    "down_proj_blocks": "w2_blocks",
    "down_proj_scales": "w2_scales",
    "gate_up_proj": "w13_weight",
    "down_proj": "w2_weight",
    "gate_up_proj_bias": "w13_bias",
    "down_proj_bias": "w2_bias",
}


@pytest.mark.parametrize("quantized", [True, False], ids=["mxfp4", "bf16-style"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_shards_sum_to_the_reference(tp, quantized):
    e, h, i, k, t = 4, 32, 2880, 2, 5
    g = torch.Generator().manual_seed(tp)
    tensors, (w13, b13, w2, b2) = _gpt_oss_style_checkpoint(e, h, i, quantized, g)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    act = SwigluOAIAndMul(1.702, 7.0)
    weights, ids = moe.select_experts(logits, k, "topk_softmax")
    expected = _reference(x, w13, b13, w2, b2, weights, ids, act)
    total = torch.zeros(t, h, dtype=torch.float64)
    for rank in range(tp):
        with qdist.simulated_tp(tp, rank):
            layer = FusedMoE(
                e, k, h, i, activation=act, bias=True, scoring="topk_softmax",
                reduce_results=False, quant_config=Mxfp4Config() if quantized else None,
            )  # fmt: skip
        assert layer.intermediate_size_per_partition == padded_shard_size(
            i, tp, 32 if quantized else 1
        )
        params = dict(layer.named_parameters())
        for name, (tensor, shard) in tensors.items():
            layer.weight_loader(params[_PARAM_OF[name]], tensor, shard)
        if quantized:  # the padding beyond I is zero on the last rank
            real = i - rank * layer.intermediate_size_per_partition
            if real < layer.intermediate_size_per_partition:
                assert (
                    layer.w13_scales[:, max(real, 0) : layer.intermediate_size_per_partition] == 0
                ).all()
                assert (layer.w2_blocks[:, :, max(real, 0) // 32 :] == 0).all()
        with torch.no_grad():
            total += layer(x, logits).double()
    err = ((total - expected).abs().max() / expected.abs().max()).item()
    assert err <= 1e-5, f"tp={tp}: relative error {err:.2e}"


def test_fused_tp1_tensor_without_shard_id_loads_the_halves_layout():
    """What a dummy or fused loader passes: every expert in the parameter's own TP=1 layout."""
    e, h, i = 3, 32, 64
    full = torch.randn(e, 2 * i, h)
    with qdist.simulated_tp(2, 1):
        layer = FusedMoE(e, 2, h, i)
    layer.weight_loader(layer.w13_weight, full)
    assert torch.equal(layer.w13_weight[:, :32], full[:, 32:64])  # gate, rank 1's half
    assert torch.equal(layer.w13_weight[:, 32:], full[:, 96:])  # up


@pytest.mark.parametrize(
    "scoring,renorm", [("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)]
)
def test_routing_matches_transformers(scoring, renorm):
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(11, 16)
    if scoring == "topk_softmax":
        cfg = AutoConfig.for_model(
            "gpt_oss", num_local_experts=8, num_experts_per_tok=3, hidden_size=16
        )
        router = GptOssTopKRouter(cfg)
        torch.nn.init.normal_(router.bias)
    else:
        cfg = AutoConfig.for_model(
            "qwen3_moe", num_experts=8, num_experts_per_tok=3, hidden_size=16, norm_topk_prob=renorm
        )
        router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    logits, ref_w, ref_ids = router(x)
    w, ids = moe.select_experts(logits, 3, scoring, renorm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)


def test_sort_and_combine():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sort = moe.sort_by_expert(ids, 4)
    assert sort.m_indptr.tolist() == [0, 2, 3, 6, 6]
    assert sort.expert_of_row.tolist() == [0, 0, 1, 2, 2, 2]
    assert sort.token_index.tolist() == [0, 2, 1, 0, 1, 2]
    rows = torch.arange(6.0).unsqueeze(-1)
    w = torch.tensor([[1.0, 10.0], [100.0, 1000.0], [1e4, 1e5]])
    # token 0: expert 2 (row 3) and 0 (row 0); token 1: rows 4, 2; token 2: rows 1, 5
    assert combine_list(rows, sort, w) == [3 + 0, 400 + 2000, 1e4 + 5e5]


@pytest.mark.parametrize("block_m", [1, 8, 16])
def test_plans_real_blocks_never_undercut_min_blocks(block_m):
    """``min_blocks`` (what split-K kernels plan for) is a true lower bound of the real blocks
    for any routing, and reached when every token picks the same experts."""
    g = torch.Generator().manual_seed(block_m)
    e, k = 32, 4
    for t in (1, 2, 5, 16, 64):
        spread = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        same = torch.arange(k).repeat(t, 1)
        for ids in (spread, same):
            sort = moe.sort_by_expert(ids, e)
            plan = moe.block_schedule(sort.m_indptr, t * k, block_m, top_k=k)
            real = int((plan.block_expert < e).sum())
            assert plan.min_blocks <= real <= plan.num_blocks, (t, block_m)
        assert plan.min_blocks == real  # the same k experts for every token


def combine_list(rows, sort, w):
    return moe.combine(rows, sort, w).squeeze(-1).tolist()


def test_checkpoint_leaf_names_map_and_experts_account_strictly():
    mapping = [("self_attn.attn.sinks", "self_attn.sinks", None)]
    assert map_checkpoint_name("model.layers.3.self_attn.sinks", mapping) == (
        "model.layers.3.self_attn.attn.sinks",
        None,
    )
    assert map_checkpoint_name("model.layers.3.self_attn.sinks_x", mapping)[0] == (
        "model.layers.3.self_attn.sinks_x"
    )
    e, h, i = 3, 32, 32

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = FusedMoE(e, 2, h, i)

    mapping = expert_params_mapping(e)
    assert map_checkpoint_name("mlp.experts.2.up_proj.weight", mapping) == (
        "mlp.experts.w13_weight",
        ExpertShard(2, "w3"),
    )
    weights = {
        f"experts.{x}.{p}.weight": torch.randn(
            h if p == "down_proj" else i, i if p == "down_proj" else h
        )
        for x in range(e)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    block = Block()
    assert load_weights(block, weights.items(), stacked_params_mapping=mapping) == {
        "experts.w13_weight",
        "experts.w2_weight",
    }
    assert torch.equal(block.experts.w13_weight[1, i:], weights["experts.1.up_proj.weight"])
    del weights["experts.1.up_proj.weight"]
    with pytest.raises(
        WeightLoadError,
        match=r"experts.w13_weight.*missing shard.*ExpertShard\(expert_id=1, part='w3'",
    ):
        load_weights(Block(), weights.items(), stacked_params_mapping=mapping)


def test_wrong_shapes_and_parts_are_named():
    layer = FusedMoE(4, 2, 32, 64, quant_config=Mxfp4Config(), prefix="model.layers.0.mlp.experts")
    with pytest.raises(ShardShapeError, match="all 4 experts"):
        layer.weight_loader(
            layer.w13_blocks,
            torch.zeros(3, 128, 1, 16, dtype=torch.uint8),
            ExpertShard(None, "w13"),
        )
    with pytest.raises(ValueError, match="part 'w2' cannot load a gate/up parameter"):
        layer.weight_loader(
            layer.w13_scales, torch.zeros(4, 128, 1, dtype=torch.uint8), ExpertShard(None, "w2")
        )
    with pytest.raises(ValueError, match="hidden size 48 .* multiple of 32"):
        FusedMoE(4, 2, 48, 64, quant_config=Mxfp4Config())


def test_method_without_moe_support_is_a_clear_error():
    from quantfw.layers.quantization.awq import AWQConfig

    with pytest.raises(ValueError, match="'awq' has no method for mixture-of-experts layers"):
        FusedMoE(4, 2, 32, 64, quant_config=AWQConfig(), prefix="model.layers.0.mlp.experts")


def test_modules_to_not_convert_regex_like_gpt_oss():
    from quantfw.layers.linear import QKVParallelLinear
    from quantfw.layers.quantization.base import UnquantizedLinearMethod

    cfg = Mxfp4Config(modules_to_not_convert=["model.layers.*.self_attn", "lm_head"])
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert cfg.is_layer_skipped("model.layers.11.self_attn.qkv_proj")
    assert not cfg.is_layer_skipped("model.layers.11.mlp.experts")
    assert not cfg.is_layer_skipped("model.layers.11.self_attention_x.o_proj")
    layer = QKVParallelLinear(
        64, 16, 4, 2, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj"
    )
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)


def test_mxfp4_methods_keep_their_runtime_weights_across_calls():
    """The MXFP4 methods hand the kernels one `Mxfp4Weights` per weight for the layer's life (the
    kernels keep its TMA descriptors on it; a new wrapper per call rebuilt them at every eager
    launch), made again only when the buffers are replaced; a dense weight's group-of-one view
    is made once."""
    from torch import nn

    from quantfw.kernels.mxfp4 import grouped
    from quantfw.layers.quantization.mxfp4 import _packed

    layer = nn.Module()
    layer.register_buffer("w13_qweight", torch.zeros(2, 64, 8, dtype=torch.int32))
    layer.register_buffer("w13_qscales", torch.zeros(2, 64, 2, dtype=torch.uint8))
    layer.w13_mxfp4_size = (64, 64)
    assert _packed(layer, "w2") is None
    first = _packed(layer, "w13")
    assert _packed(layer, "w13") is first
    assert first.qweight is layer.w13_qweight and first.shape == (2, 64, 64)
    layer.w13_qweight = torch.ones(2, 64, 8, dtype=torch.int32)  # as module.to() replaces it
    again = _packed(layer, "w13")
    assert again is not first and again.qweight is layer.w13_qweight

    dense = grouped.Mxfp4Weights(torch.zeros(64, 8, dtype=torch.int32), torch.zeros(64, 2), 64, 64)
    group = dense.grouped()
    assert dense.grouped() is group and group.qweight.shape == (1, 64, 8)
    assert group.grouped() is group
