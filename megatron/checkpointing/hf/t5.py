"""T5 (T5ForConditionalGeneration) <-> this project's T5: v1.0 (ReLU, tied head scaled by h^-0.5) and v1.1 (gated
GELU, untied head).

    config.json (T5Config)                      project
        num_layers, num_decoder_layers (null: the same)   num_layers, decoder_num_layers
        d_model, num_heads, d_kv, d_ff          hidden_size, num_attention_heads, kv_channels, ffn_hidden_size
        relative_attention_num_buckets / _max_distance    the same names
        feed_forward_proj                       feed_forward_proj ('relu', 'gated-gelu')
        layer_norm_epsilon, dropout_rate        layernorm_epsilon, hidden_dropout (= attention_dropout)
        scale_decoder_outputs (transformers 5; 4.x: tie_word_embeddings)   not untie_embeddings_and_output_weights
    config.json has no sequence length (relative positions): an import records SEQUENCE, the run's to change.

    tensors (S = encoder.block.i / decoder.block.j)
        embedding.word_embeddings                          shared                      (embed_tokens, lm_head tied)
        *.self_attention.q / kv / o                        S.layer.0.SelfAttention.q / [k; v] / o
        *_layers.0.self_attention.relative_attention_bias  S.layer.0.SelfAttention.relative_attention_bias
        *.self_attention_layernorm                         S.layer.0.layer_norm
        decoder: cross_attention.q / kv / o, its norm      S.layer.1.EncDecAttention.q / [k; v] / o,
                                                           S.layer.1.layer_norm
        mlp.wi / mlp.wo, mlp_layernorm                     S.layer.f.DenseReluDense.wi (v1.1: [wi_0; wi_1]) / wo,
                                                           S.layer.f.layer_norm        (f = 1 encoder, 2 decoder)
        encoder_final / decoder_final                      encoder / decoder.final_layer_norm
        lm_head (v1.1, untied)                             lm_head (transformers 5 may save it tied: shared)
"""
from __future__ import annotations

from typing import Any, Dict, List

from megatron.model.specs.t5 import T5Spec
from .base import Adapter, Rule, refuse

FFN = ("relu", "gated-gelu")
SEQUENCE = dict(seq_length=512, encoder_seq_length=512, decoder_seq_length=128, max_position_embeddings=512)


class T5(Adapter):
    hf_model_type, architecture, model_type = "t5", "T5ForConditionalGeneration", T5Spec.model_type
    FIELDS = dict(num_layers="num_layers", hidden_size="d_model", num_attention_heads="num_heads", kv_channels="d_kv",
                  ffn_hidden_size="d_ff", relative_attention_num_buckets="relative_attention_num_buckets",
                  relative_attention_max_distance="relative_attention_max_distance",
                  feed_forward_proj="feed_forward_proj", layernorm_epsilon="layer_norm_epsilon",
                  hidden_dropout="dropout_rate")
    HF_DEFAULTS = dict(num_layers=6, d_model=512, num_heads=8, d_kv=64, d_ff=2048, relative_attention_num_buckets=32,
                       relative_attention_max_distance=128, feed_forward_proj="relu", layer_norm_epsilon=1e-6,
                       dropout_rate=0.1)  # transformers' T5Config

    def project_args(self, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
        args = self.read_fields(cfg)
        ffn = args["feed_forward_proj"]
        bad = [] if ffn in FFN else [f"feed_forward_proj = {ffn!r} (supported: {', '.join(FFN)})"]
        if cfg.get("is_encoder_decoder", True) is not True:
            bad.append("is_encoder_decoder = false")
        refuse(bad, f"{where} uses options this project's model does not implement")
        scaled = cfg.get("scale_decoder_outputs", cfg.get("tie_word_embeddings", True))
        return dict(model_type=self.model_type, **args, decoder_num_layers=cfg.get("num_decoder_layers") or
                    args["num_layers"], attention_dropout=args["hidden_dropout"],
                    untie_embeddings_and_output_weights=not scaled, **SEQUENCE)

    def hf_config(self, config, rows: int, ids: Dict[str, int]) -> Dict[str, Any]:
        tied = config.tie_word_embeddings
        return {**self.head(rows, ids), **self.write_fields(config), "num_decoder_layers": config.num_decoder_layers,
                "initializer_factor": config.initializer_factor, "is_encoder_decoder": True,
                "tie_word_embeddings": tied, "scale_decoder_outputs": tied}

    def rules(self, config) -> List[Rule]:
        gated = config.feed_forward_proj == "gated-gelu"
        rules = [Rule("embedding.word_embeddings.weight", ("shared.weight",))]
        for i in range(config.num_layers):
            rules += _block(f"encoder_layers.{i}", f"encoder.block.{i}", False, i == 0, gated)
        rules.append(Rule("encoder_final.final_layernorm.weight", ("encoder.final_layer_norm.weight",)))
        for j in range(config.num_decoder_layers):
            rules += _block(f"decoder_layers.{j}", f"decoder.block.{j}", True, j == 0, gated)
        rules.append(Rule("decoder_final.final_layernorm.weight", ("decoder.final_layer_norm.weight",)))
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",), tied=("shared.weight",)))
        return rules

    def token_ids(self, tokenizer) -> Dict[str, int]:
        return {"pad_token_id": tokenizer.pad, "eos_token_id": tokenizer.eos, "decoder_start_token_id": tokenizer.pad}

    def model_max_length(self, config) -> int:
        return config.seq_length  # the encoder's

    def logits(self, ours, hf_dir: str, ids, order, gen) -> tuple:
        """Encoder ids (b, s) and random decoder ids (b, s / 2): no padding, a causal decoder."""
        import torch
        import transformers
        hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).float().eval()
        batch, k = ids.shape
        dec = torch.randint(0, len(order), (batch, k // 2), generator=gen)
        q = dec.size(1)
        causal = torch.triu(torch.ones(q, q, dtype=torch.bool), 1).expand(batch, 1, q, q)
        mine = ours(ids, dec, torch.zeros(batch, 1, k, k, dtype=torch.bool), causal,
                    torch.zeros(batch, 1, q, k, dtype=torch.bool))
        return mine, hf(input_ids=order[ids], decoder_input_ids=order[dec]).logits


def _attention(ours: str, theirs: str) -> List[Rule]:
    return [Rule(f"{ours}.q.weight", (f"{theirs}.q.weight",)),
            Rule(f"{ours}.kv.weight", (f"{theirs}.k.weight", f"{theirs}.v.weight")),
            Rule(f"{ours}.o.weight", (f"{theirs}.o.weight",))]


def _block(ours: str, theirs: str, decoder: bool, first: bool, gated: bool) -> List[Rule]:
    rules = [Rule(f"{ours}.self_attention_layernorm.weight", (f"{theirs}.layer.0.layer_norm.weight",))]
    rules += _attention(f"{ours}.self_attention", f"{theirs}.layer.0.SelfAttention")
    if first:
        rules.append(Rule(f"{ours}.self_attention.relative_attention_bias.weight",
                          (f"{theirs}.layer.0.SelfAttention.relative_attention_bias.weight",)))
    ff = 2 if decoder else 1
    if decoder:
        rules.append(Rule(f"{ours}.cross_attention_layernorm.weight", (f"{theirs}.layer.1.layer_norm.weight",)))
        rules += _attention(f"{ours}.cross_attention", f"{theirs}.layer.1.EncDecAttention")
    mlp = f"{theirs}.layer.{ff}.DenseReluDense"
    wi = (f"{mlp}.wi_0.weight", f"{mlp}.wi_1.weight") if gated else (f"{mlp}.wi.weight",)
    rules += [Rule(f"{ours}.mlp_layernorm.weight", (f"{theirs}.layer.{ff}.layer_norm.weight",)),
              Rule(f"{ours}.mlp.wi.weight", wi), Rule(f"{ours}.mlp.wo.weight", (f"{mlp}.wo.weight",))]
    return rules
