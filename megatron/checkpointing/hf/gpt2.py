"""GPT-2 (GPT2LMHeadModel) <-> this project's GPT with GPT-2's layer (learned positions, pre-LayerNorm, GELU-tanh,
biases, tied head).

    config.json (GPT2Config)                    project
        n_layer, n_embd, n_head                 num_layers, hidden_size, num_attention_heads (head width: the quotient)
        n_inner (null: 4 n_embd)                ffn_hidden_size
        n_positions                             max_position_embeddings, and the sequence length of an import
        layer_norm_epsilon, initializer_range   layernorm_epsilon, init_method_std
        resid_pdrop (= embd_pdrop), attn_pdrop  hidden_dropout, attention_dropout

    tensors (HF Conv1D stores (in, out), hence transposed)
        embedding.word_embeddings / position_embeddings       transformer.wte / transformer.wpe
        layers.i.input_layernorm / post_attention_layernorm   transformer.h.i.ln_1 / ln_2
        layers.i.self_attention.query_key_value               transformer.h.i.attn.c_attn  rows [Q; K; V] = its columns
        layers.i.self_attention.dense                         transformer.h.i.attn.c_proj
        layers.i.mlp.dense_h_to_4h / dense_4h_to_h            transformer.h.i.mlp.c_fc / c_proj
        final_layernorm                                       transformer.ln_f            (lm_head tied to wte)
"""
from __future__ import annotations

from typing import Any, Dict, List

from megatron.model.specs.gpt import GPTSpec
from .base import Adapter, Rule, refuse

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# the options config.json may set, each with the values this project's GPT-2 layer computes
OPTIONS = (("activation_function", lambda v: v in GELU_TANH, " or ".join(GELU_TANH)),
           ("scale_attn_weights", lambda v: v is True, "true"),
           ("scale_attn_by_inverse_layer_idx", lambda v: v is False, "false"),
           ("add_cross_attention", lambda v: v is False, "false"),
           ("tie_word_embeddings", lambda v: v is True, "true"))
PAIRS = (("input_layernorm", "ln_1", False), ("self_attention.query_key_value", "attn.c_attn", True),
         ("self_attention.dense", "attn.c_proj", True), ("post_attention_layernorm", "ln_2", False),
         ("mlp.dense_h_to_4h", "mlp.c_fc", True), ("mlp.dense_4h_to_h", "mlp.c_proj", True))


class GPT2(Adapter):
    hf_model_type, architecture, model_type = "gpt2", "GPT2LMHeadModel", GPTSpec.model_type
    FIELDS = dict(num_layers="n_layer", hidden_size="n_embd", num_attention_heads="n_head",
                  max_position_embeddings="n_positions", layernorm_epsilon="layer_norm_epsilon",
                  init_method_std="initializer_range", hidden_dropout="resid_pdrop", attention_dropout="attn_pdrop")
    HF_DEFAULTS = dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, layer_norm_epsilon=1e-5,
                       initializer_range=0.02, resid_pdrop=0.1, attn_pdrop=0.1)  # transformers' GPT2Config

    def project_args(self, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
        args = self.read_fields(cfg)
        h, heads = args["hidden_size"], args["num_attention_heads"]
        bad = [f"{key} = {cfg[key]}" for key, ok, _ in OPTIONS if key in cfg and not ok(cfg[key])]
        supported = "; ".join(f"{key} {values}" for key, ok, values in OPTIONS if key in cfg and not ok(cfg[key]))
        if h % heads:
            bad.append(f"n_embd {h} not divisible by n_head {heads}")
        refuse(bad, f"{where} uses options this project's model does not implement", supported)
        positions = args["max_position_embeddings"]
        return dict(model_type=self.model_type, **args, ffn_hidden_size=cfg.get("n_inner") or 4 * h,
                    kv_channels=h // heads, seq_length=positions, encoder_seq_length=positions,
                    decoder_seq_length=positions)

    def hf_config(self, config, rows: int, ids: Dict[str, int]) -> Dict[str, Any]:
        return {**self.head(rows, ids), **self.write_fields(config), "n_inner": config.ffn_hidden_size,
                "activation_function": "gelu_new", "embd_pdrop": config.hidden_dropout, "scale_attn_weights": True,
                "tie_word_embeddings": True}

    def rules(self, config) -> List[Rule]:
        rules = [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",)),
                 Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",))]
        for i in range(config.num_layers):
            for ours, theirs, transposed in PAIRS:
                rules.append(Rule(f"layers.{i}.{ours}.weight", (f"transformer.h.{i}.{theirs}.weight",), transposed))
                rules.append(Rule(f"layers.{i}.{ours}.bias", (f"transformer.h.{i}.{theirs}.bias",)))
        return rules + [Rule("final_layernorm.weight", ("transformer.ln_f.weight",)),
                        Rule("final_layernorm.bias", ("transformer.ln_f.bias",))]
