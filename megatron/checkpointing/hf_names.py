"""Name tables between this project's canonical parameters and Hugging Face transformers' state dicts.

A `Rule(canonical, hf_names, transpose, sizes)`: the canonical full tensor is the concatenation along rows of the
HF tensors (each transposed first when `transpose`), so export splits (in proportion to `sizes`, equal parts by
default) and import concatenates. The Llama family's table is in `hf_llama`.

    GPT-2 (GPT2LMHeadModel; HF Conv1D stores (in, out), hence transposed)
        embedding.word_embeddings / position_embeddings   transformer.wte / transformer.wpe
        layers.i.input_layernorm / post_attention_layernorm   transformer.h.i.ln_1 / ln_2
        layers.i.self_attention.query_key_value            transformer.h.i.attn.c_attn   rows [Q; K; V] = HF's columns
        layers.i.self_attention.dense                      transformer.h.i.attn.c_proj
        layers.i.mlp.dense_h_to_4h / dense_4h_to_h         transformer.h.i.mlp.c_fc / c_proj
        final_layernorm                                    transformer.ln_f            (lm_head tied to wte)
    T5 (T5ForConditionalGeneration; S = encoder.block.i / decoder.block.j)
        embedding.word_embeddings                          shared                      (embed_tokens, lm_head tied)
        *.self_attention.q / kv / o                        S.layer.0.SelfAttention.q / [k; v] / o
        *_layers.0.self_attention.relative_attention_bias  S.layer.0.SelfAttention.relative_attention_bias
        *.self_attention_layernorm                         S.layer.0.layer_norm
        decoder: cross_attention.q / kv / o, its norm      S.layer.1.EncDecAttention.q / [k; v] / o,
                                                           S.layer.1.layer_norm
        mlp.wi / mlp.wo, mlp_layernorm                     S.layer.f.DenseReluDense.wi (v1.1: [wi_0; wi_1]) / wo,
                                                           S.layer.f.layer_norm        (f = 1 encoder, 2 decoder)
        encoder_final / decoder_final                      encoder / decoder.final_layer_norm
        lm_head (v1.1, untied)                             lm_head
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch


@dataclass(frozen=True)
class Rule:
    canonical: str
    hf: Tuple[str, ...]
    transpose: bool = False
    sizes: Optional[Tuple[int, ...]] = None  # relative row counts of the HF tensors (None: equal)

    def split(self, full: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The canonical tensor cut into the HF tensors' rows."""
        if self.sizes is None:
            return full.chunk(len(self.hf), dim=0)
        unit = full.size(0) // sum(self.sizes)
        return full.split([unit * s for s in self.sizes], dim=0)


def gpt2_rules(num_layers: int) -> List[Rule]:
    rules = [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",)),
             Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",))]
    pairs = [("input_layernorm", "ln_1", False), ("self_attention.query_key_value", "attn.c_attn", True),
             ("self_attention.dense", "attn.c_proj", True), ("post_attention_layernorm", "ln_2", False),
             ("mlp.dense_h_to_4h", "mlp.c_fc", True), ("mlp.dense_4h_to_h", "mlp.c_proj", True)]
    for i in range(num_layers):
        for ours, theirs, transposed in pairs:
            rules.append(Rule(f"layers.{i}.{ours}.weight", (f"transformer.h.{i}.{theirs}.weight",), transposed))
            rules.append(Rule(f"layers.{i}.{ours}.bias", (f"transformer.h.{i}.{theirs}.bias",)))
    rules += [Rule("final_layernorm.weight", ("transformer.ln_f.weight",)),
              Rule("final_layernorm.bias", ("transformer.ln_f.bias",))]
    return rules


def _t5_attention(ours: str, theirs: str) -> List[Rule]:
    return [Rule(f"{ours}.q.weight", (f"{theirs}.q.weight",)),
            Rule(f"{ours}.kv.weight", (f"{theirs}.k.weight", f"{theirs}.v.weight")),
            Rule(f"{ours}.o.weight", (f"{theirs}.o.weight",))]


def _t5_block(ours: str, theirs: str, decoder: bool, first: bool, gated: bool) -> List[Rule]:
    rules = [Rule(f"{ours}.self_attention_layernorm.weight", (f"{theirs}.layer.0.layer_norm.weight",))]
    rules += _t5_attention(f"{ours}.self_attention", f"{theirs}.layer.0.SelfAttention")
    if first:
        rules.append(Rule(f"{ours}.self_attention.relative_attention_bias.weight",
                          (f"{theirs}.layer.0.SelfAttention.relative_attention_bias.weight",)))
    ff = 2 if decoder else 1
    if decoder:
        rules.append(Rule(f"{ours}.cross_attention_layernorm.weight", (f"{theirs}.layer.1.layer_norm.weight",)))
        rules += _t5_attention(f"{ours}.cross_attention", f"{theirs}.layer.1.EncDecAttention")
    mlp = f"{theirs}.layer.{ff}.DenseReluDense"
    wi = (f"{mlp}.wi_0.weight", f"{mlp}.wi_1.weight") if gated else (f"{mlp}.wi.weight",)
    rules += [Rule(f"{ours}.mlp_layernorm.weight", (f"{theirs}.layer.{ff}.layer_norm.weight",)),
              Rule(f"{ours}.mlp.wi.weight", wi), Rule(f"{ours}.mlp.wo.weight", (f"{mlp}.wo.weight",))]
    return rules


def t5_rules(num_layers: int, num_decoder_layers: int, gated: bool, tied: bool) -> List[Rule]:
    rules = [Rule("embedding.word_embeddings.weight", ("shared.weight",))]
    for i in range(num_layers):
        rules += _t5_block(f"encoder_layers.{i}", f"encoder.block.{i}", False, i == 0, gated)
    rules.append(Rule("encoder_final.final_layernorm.weight", ("encoder.final_layer_norm.weight",)))
    for j in range(num_decoder_layers):
        rules += _t5_block(f"decoder_layers.{j}", f"decoder.block.{j}", True, j == 0, gated)
    rules.append(Rule("decoder_final.final_layernorm.weight", ("decoder.final_layer_norm.weight",)))
    if not tied:
        rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return rules
