"""Sharding arithmetic, checked one rank at a time with simulated tensor parallelism: the ranks'
shards put back together must equal the full tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantfw import distributed as qdist
from quantfw.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from quantfw.layers.quantization.base import LinearMethodBase, QuantizationConfig
from quantfw.layers.sharding import ShardShapeError, set_weight_attrs
from quantfw.layers.vocab import ParallelLMHead, VocabParallelEmbedding


def _ranks(tp):
    for rank in range(tp):
        with qdist.simulated_tp(tp, rank):
            yield rank


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_shards_reassemble(tp):
    w, b, x = torch.randn(32, 16), torch.randn(32), torch.randn(3, 16)
    col_outs, row_outs = [], []
    w_row = torch.randn(16, 32)
    for _ in _ranks(tp):
        col = ColumnParallelLinear(16, 32, bias=True)
        col.weight_loader(col.weight, w)
        col.weight_loader(col.bias, b)
        col_outs.append(col.quant_method.apply(col, x, col.bias))
        row = RowParallelLinear(32, 16, bias=False)
        row.weight_loader(row.weight, w_row)
        xs = x.new_empty(3, 32).copy_(torch.arange(96.0).view(3, 32) / 50)
        row_outs.append(row.quant_method.apply(row, xs.chunk(tp, -1)[row.tp_rank], None))
    torch.testing.assert_close(torch.cat(col_outs, -1), F.linear(x, w, b))
    torch.testing.assert_close(sum(row_outs), F.linear(xs, w_row), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "tp,heads,kv_heads", [(1, 4, 2), (2, 4, 2), (4, 4, 2), (4, 8, 1), (2, 4, 4)]
)
def test_qkv_shards_with_kv_replication(tp, heads, kv_heads):
    head, hidden = 8, 32
    q, k, v = (
        torch.randn(heads * head, hidden),
        torch.randn(kv_heads * head, hidden),
        torch.randn(kv_heads * head, hidden),
    )
    for rank in _ranks(tp):
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, bias=False)
        for shard_id, t in zip("qkv", (q, k, v)):
            layer.weight_loader(layer.weight, t, shard_id)
        nh, nkv = layer.num_heads, layer.num_kv_heads
        kv_rank = rank // layer.num_kv_head_replicas
        expected = torch.cat(
            [
                q[rank * nh * head : (rank + 1) * nh * head],
                k[kv_rank * nkv * head : (kv_rank + 1) * nkv * head],
                v[kv_rank * nkv * head : (kv_rank + 1) * nkv * head],
            ]
        )
        assert torch.equal(layer.weight, expected)
        # The fused tensor loads to the same shard.
        fused = QKVParallelLinear(hidden, head, heads, kv_heads, bias=False)
        fused.weight_loader(fused.weight, torch.cat([q, k, v]))
        assert torch.equal(fused.weight, expected)


def test_heads_not_divisible_is_clear_error():
    with (
        qdist.simulated_tp(2, 0),
        pytest.raises(
            ValueError,
            match=r"layer attn\.qkv: number of attention heads 3 is not divisible by tensor_parallel_size 2",
        ),
    ):
        QKVParallelLinear(48, 16, 3, 3, prefix="attn.qkv")
    with qdist.simulated_tp(4, 0), pytest.raises(ValueError, match="kv-head replication"):
        QKVParallelLinear(64, 8, 8, 3, prefix="attn.qkv")


class _PackedMethod(LinearMethodBase):
    """A 4-bit-style layout packed 8 per int32 along the output dim: qweight [in, out/8]."""

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra,
    ):
        qweight = nn.Parameter(
            torch.empty(
                input_size_per_partition, sum(output_partition_sizes) // 8, dtype=torch.int32
            ),
            requires_grad=False,
        )
        set_weight_attrs(
            qweight, {"input_dim": 0, "output_dim": 1, "packed_dim": 1, "pack_factor": 8, **extra}
        )
        layer.register_parameter("qweight", qweight)

    def apply(self, layer, x, bias=None):
        raise AssertionError("not used")


class _PackedConfig(QuantizationConfig):
    @classmethod
    def get_name(cls):
        return "packed-test"

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_quant_method(self, layer, prefix):
        return _PackedMethod()


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_output_dim_offsets_divide_by_pack_factor(tp):
    hidden, head = 32, 16
    q = torch.randint(-(2**31), 2**31 - 1, (hidden, 4 * head // 8), dtype=torch.int32)
    k = torch.randint(-(2**31), 2**31 - 1, (hidden, 2 * head // 8), dtype=torch.int32)
    v = torch.randint(-(2**31), 2**31 - 1, (hidden, 2 * head // 8), dtype=torch.int32)
    gate = torch.randint(-(2**31), 2**31 - 1, (hidden, 64 // 8), dtype=torch.int32)
    up = torch.randint(-(2**31), 2**31 - 1, (hidden, 64 // 8), dtype=torch.int32)
    qkv_parts, gu_parts = [], []
    for _ in _ranks(tp):
        qkv = QKVParallelLinear(hidden, head, 4, 2, bias=False, quant_config=_PackedConfig())
        for sid, t in zip("qkv", (q, k, v)):
            qkv.weight_loader(qkv.qweight, t, sid)
        qkv_parts.append(
            qkv.qweight.split(
                [qkv.qweight.shape[1] // 2, qkv.qweight.shape[1] // 4, qkv.qweight.shape[1] // 4],
                dim=1,
            )
        )
        gu = MergedColumnParallelLinear(hidden, [64, 64], bias=False, quant_config=_PackedConfig())
        gu.weight_loader(gu.qweight, gate, 0)
        gu.weight_loader(gu.qweight, up, 1)
        gu_parts.append(gu.qweight.chunk(2, dim=1))
    for i, full in enumerate((q, k, v)):
        assert torch.equal(torch.cat([p[i] for p in qkv_parts], dim=1), full)
    assert torch.equal(torch.cat([p[0] for p in gu_parts], 1), gate)
    assert torch.equal(torch.cat([p[1] for p in gu_parts], 1), up)


def test_packed_shard_that_splits_an_int32_is_an_error():
    with qdist.simulated_tp(2, 0):
        layer = MergedColumnParallelLinear(32, [8, 8], bias=False, quant_config=_PackedConfig())
        # 8 outputs per part / 2 ranks = 4 per rank: not a whole int32 of 8 nibbles
        with pytest.raises(ShardShapeError, match="pack factor 8"):
            layer.weight_loader(layer.qweight, torch.zeros(32, 1, dtype=torch.int32), 0)


def test_shape_mismatch_and_dtype_mismatch():
    layer = ReplicatedLinear(8, 4, bias=False)
    with pytest.raises(
        ShardShapeError, match=r"checkpoint shape \(4, 9\) != parameter shape \(4, 8\)"
    ):
        layer.weight_loader(layer.weight, torch.randn(4, 9))
    with pytest.raises(ShardShapeError, match="dtype"):
        layer.weight_loader(layer.weight, torch.zeros(4, 8, dtype=torch.int32))
    with qdist.simulated_tp(2, 1):
        col = ColumnParallelLinear(8, 6, bias=False)
        with pytest.raises(ShardShapeError, match=r"expected \(6, 8\)"):
            col.weight_loader(col.weight, torch.randn(7, 8))


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_vocab_padding_shards(tp):
    vocab, dim = 100, 8
    w = torch.randn(vocab, dim)
    ids = torch.randint(0, vocab, (2, 5))
    rows, outs, logits = [], [], []
    h = torch.randn(2, 5, dim)
    for _ in _ranks(tp):
        emb = VocabParallelEmbedding(vocab, dim, padding_size=16)
        emb.weight_loader(emb.weight, w)
        rows.append(emb.weight)
        in_range = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        local = torch.where(in_range, ids - emb.vocab_start, 0)
        outs.append(F.embedding(local, emb.weight) * in_range.unsqueeze(-1))
        head = ParallelLMHead(vocab, dim, padding_size=16)
        head.weight_loader(head.weight, w)
        logits.append(F.linear(h, head.weight))
    padded = torch.cat(rows)
    assert padded.shape[0] % (16 * tp) == 0
    assert torch.equal(padded[:vocab], w) and padded[vocab:].abs().sum() == 0
    torch.testing.assert_close(sum(outs), F.embedding(ids, w))
    torch.testing.assert_close(torch.cat(logits, -1)[..., :vocab], F.linear(h, w))


def test_collective_under_simulated_tp_is_an_error():
    with (
        qdist.simulated_tp(2, 0),
        pytest.raises(RuntimeError, match="simulated tensor parallelism"),
    ):
        qdist.all_reduce(torch.ones(2))


def test_tensor_shared_by_fused_parts_must_agree():
    """A parameter with no output_dim (GPTQ g_idx, say) is carried by every fused part."""
    layer = MergedColumnParallelLinear(8, [4, 4], bias=False)
    shared = nn.Parameter(torch.empty(8, dtype=torch.int32), requires_grad=False)
    set_weight_attrs(shared, {"input_dim": 0})
    value = torch.randperm(8, dtype=torch.int32)
    layer.weight_loader(shared, value, 0)
    layer.weight_loader(shared, value.clone(), 1)
    assert torch.equal(shared, value)
    with pytest.raises(ShardShapeError, match="fused part 1 carries a different value"):
        layer.weight_loader(shared, value.flip(0), 1)
