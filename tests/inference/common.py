"""Tiny GPT-2 / T5 models and real tokenizers for the inference tests.

The models are initialised with large weights (GPT-2 init std 0.5, T5 initializer factor 5) so that greedy
decoding wanders over the vocabulary instead of repeating the prompt's last token, which a small-init tied
model does; positional or masking mistakes then change the text. The same seed builds the same weights at
any tp size (the layers draw full master weights), so a tp=2 model is the slices of the tp=1 one.
"""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden", "data")
VOCAB, MERGES = os.path.join(GOLDEN, "vocab.json"), os.path.join(GOLDEN, "merges.txt")

PROMPTS = ["The model", "Tensor parallel pipeline stage gradient token", "A", "data data data batch", ""]
T5_PROMPTS = ["The <extra_id_0> sat on the mat.", "pipeline <extra_id_0> tensor <extra_id_1> stage",
              "token", "Gradient checkpoint memory throughput sequence embedding vocabulary."]


def bpe_tokenizer():
    from megatron.tokenizer import build_tokenizer
    return build_tokenizer("GPT2BPETokenizer", VOCAB, MERGES)


def spm_tokenizer(model_file: str):
    from megatron.tokenizer import build_tokenizer
    return build_tokenizer("SentencePieceTokenizer", tokenizer_model=model_file, vocab_extra_ids=10)


LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
             add_bias_linear=False, tie_word_embeddings=False, ffn_hidden_size=48)
QWEN3 = dict(LLAMA, qk_layernorm=True, kv_channels=12)  # per-head query / key norms, heads of width 12 (not h / a)
OLMO2 = dict(LLAMA, qk_layernorm_full=True, post_sublayer_norm=True)  # norms over all heads, after the sublayers


def gpt2_model(tp_group=None, vocab_size: int = 512, **kw):
    from megatron.model import GPT2Config, GPT2Model
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=vocab_size, seq_length=48,
                init_method_std=0.5, seed=11)
    return GPT2Model(GPT2Config(**{**base, **kw}), tp_group).eval()


def t5_model(vocab_size: int, tp_group=None, **kw):
    from megatron.model import T5Config, T5Model
    base = dict(num_layers=2, num_decoder_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
                ffn_hidden_size=64, vocab_size=vocab_size, seq_length=32, decoder_seq_length=24,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, initializer_factor=5.0,
                seed=11)
    return T5Model(T5Config(**{**base, **kw}), tp_group).eval()
