"""Llama-family decoder (also Mistral-style configs; Qwen2/Qwen3 subclass it with other data).

Module names mirror transformers' so checkpoint names map one to one, except the fused
``qkv_proj`` and ``gate_up_proj`` (see `stacked_params_mapping`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from quantfw.layers.activation import SiluAndMul
from quantfw.layers.attention import Attention, AttentionMetadata
from quantfw.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from quantfw.layers.norm import RMSNorm
from quantfw.layers.quantization.base import QuantizationConfig
from quantfw.layers.rotary import RotaryEmbedding, get_rope
from quantfw.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from quantfw.models.utils import load_weights


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias=bias,
            gated=True,
            quant_config=quant_config,
            prefix=_join(prefix, "gate_up_proj"),
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            quant_config=quant_config,
            prefix=_join(prefix, "down_proj"),
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_gated(x, self.act_fn))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        *,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
        attn_options: dict[str, Any] | None = None,
    ):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            total_heads,
            total_kv_heads,
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=_join(prefix, "qkv_proj"),
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * head_dim,
            config.hidden_size,
            bias=o_bias,
            quant_config=quant_config,
            prefix=_join(prefix, "o_proj"),
        )
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(
            self.num_heads,
            head_dim,
            self.num_kv_heads,
            scale=head_dim**-0.5,
            prefix=_join(prefix, "attn"),
            **(attn_options or {}),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        cos_sin: torch.Tensor,
        attn_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        b, s, _ = hidden.shape
        if attn_meta is not None:
            rope = rotary.args(cos_sin[0], self.q_norm, self.k_norm)
            store = self.attn.decode_rope_store(attn_meta, rope)
            q = self.qkv_proj.forward_rope_store(hidden[0], store) if store is not None else None
            if q is not None:  # one decoding token: k and v went to the cache with q's rotation
                q = q.view(1, self.num_heads, self.head_dim)
                return self.o_proj(self.attn(q, None, None, attn_meta).unsqueeze(0))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if attn_meta is None:
            rope = rotary.args(cos_sin, self.q_norm, self.k_norm)
            return self.o_proj(self.attn(q, k, v, rope=rope))
        # cache-aware: one flat batch of tokens (b == 1)
        return self.o_proj(self.attn(q[0], k[0], v[0], attn_meta, rope).unsqueeze(0))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_cls: type[LlamaForCausalLM],
        *,
        layer_index: int,
        quant_config,
        prefix: str,
    ):
        super().__init__()
        qkv_bias, o_bias = layer_cls.attention_biases(config)
        self.self_attn = LlamaAttention(
            config,
            head_dim=layer_cls.head_dim(config),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=layer_cls.qk_norm,
            quant_config=quant_config,
            prefix=_join(prefix, "self_attn"),
            attn_options=layer_cls.attention_options(config, layer_index),
        )
        self.mlp = layer_cls.build_mlp(
            config, layer_index, quant_config=quant_config, prefix=_join(prefix, "mlp")
        )
        self.input_layernorm = layer_cls.build_norm(config)
        self.post_attention_layernorm = layer_cls.build_norm(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        cos_sin: torch.Tensor,
        attn_meta: AttentionMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual add is fused
        into the next norm, as in vLLM."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, cos_sin, attn_meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: Any, layer_cls: type[LlamaForCausalLM], *, quant_config, prefix: str
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=_join(prefix, "embed_tokens")
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                layer_cls,
                layer_index=i,
                quant_config=quant_config,
                prefix=_join(prefix, f"layers.{i}"),
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = layer_cls.build_norm(config)
        self.rotary_emb = get_rope(layer_cls.head_dim(config), config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, self.rotary_emb, cos_sin, attn_meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral causal LM. ``model(input_ids)`` -> logits ``[batch, seq, vocab]``."""

    #: Fused layer -> the checkpoint modules it holds (quantization configs use this to
    #: resolve modules_to_not_convert for fused layers).
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    #: (parameter name part, checkpoint name part, shard id)
    stacked_params_mapping: ClassVar[list[tuple[str, str, Any]]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    #: Checkpoint tensors skipped on purpose (regexes): rotary caches some exports contain.
    skip_weight_patterns: ClassVar[tuple[str, ...]] = (
        r"rotary_emb\.inv_freq$",
        r"rotary_emb\.(cos|sin)_cached$",
    )
    #: Qwen3-style per-head RMSNorm on q and k before rotary.
    qk_norm: ClassVar[bool] = False
    #: The decoder's RMSNorms scale by their weight in float32 before rounding (GPT-OSS).
    norm_weight_in_float32: ClassVar[bool] = False

    @classmethod
    def build_norm(cls, config: Any) -> RMSNorm:
        """One of the decoder's hidden-size RMSNorms (per layer and the final one)."""
        return RMSNorm(
            config.hidden_size, config.rms_norm_eps, weight_in_float32=cls.norm_weight_in_float32
        )

    @classmethod
    def attention_biases(cls, config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @classmethod
    def attention_options(cls, config: Any, layer_index: int) -> dict[str, Any]:
        """Extra `Attention` options of one layer (sliding_window, use_sinks)."""
        return {}

    @classmethod
    def build_mlp(
        cls, config: Any, layer_index: int, *, quant_config: QuantizationConfig | None, prefix: str
    ) -> nn.Module:
        """The feed-forward block of one decoder layer: ``mlp(hidden) -> hidden``."""
        return LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=bool(getattr(config, "mlp_bias", False)),
            quant_config=quant_config,
            prefix=prefix,
        )

    @staticmethod
    def head_dim(config: Any) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def __init__(
        self, config: Any, *, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ):
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        self.model = LlamaModel(
            config, type(self), quant_config=quant_config, prefix=_join(prefix, "model")
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = ParallelLMHead.tied_to(
                self.model.embed_tokens, quant_config, prefix=_join(prefix, "lm_head")
            )
        else:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=quant_config,
                prefix=_join(prefix, "lm_head"),
            )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(
                input_ids
            )
            self.model.rotary_emb.reserve(input_ids.shape[1])
        else:
            self.model.rotary_emb.reserve(int(positions.max()) + 1)
        return self.compute_logits(self.model(input_ids, positions))

    def forward_cached(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        """Cache-aware forward over one flat batch: input_ids and positions [T] (the tokens of
        several sequences, concatenated), `attn_meta` saying where each lives in the KV cache.
        Returns hidden states [T, hidden]; pick rows and call `compute_logits`."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"forward_cached takes flat input_ids and positions [T], got shapes "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        hidden = self.model(input_ids.unsqueeze(0), positions.unsqueeze(0), attn_meta)
        return hidden[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def weight_skip_patterns(self) -> tuple[str, ...]:
        tied = (r"^lm_head\.weight$",) if self.tie_word_embeddings else ()
        return self.skip_weight_patterns + tied

    def params_mapping(self) -> list[tuple[str, str, Any]]:
        """The checkpoint-name mapping `load_weights` uses (MoE models put their experts'
        entries first)."""
        return self.stacked_params_mapping

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(
            self,
            weights,
            stacked_params_mapping=self.params_mapping(),
            skip_patterns=self.weight_skip_patterns(),
        )
