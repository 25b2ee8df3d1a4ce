"""Pretrain T5 (span corruption) with 3D parallelism (tensor x pipeline x data) on DeepSpeed + TDS.

    deepspeed pretrain_t5.py --num-layers 12 --hidden-size 768 --encoder-seq-length 512 \
        --decoder-seq-length 128 --tokenizer-type SentencePieceTokenizer --tokenizer-model spm.model ...

A micro-batch is ((enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask), (labels, loss_mask)):
tokens/labels int64 (b, se) / (b, sd); masks bool, True = masked out: enc_mask (b, 1, se, se),
dec_mask (b, 1, sd, sd) (causal), cross_mask (b, 1, sd, se); loss_mask float (b, sd).
--num-layers is the depth of the encoder, and of the decoder unless --decoder-num-layers is given.
T5 v1.0 by default (ReLU feed-forward, LM head tied to the word embeddings); T5 v1.1 with
--feed-forward-proj gated-gelu --untie-embeddings-and-output-weights (usually with dropout 0 for pretraining).
"""
import sys

import torch

from megatron import mpu
from megatron.arguments import ENTRY_DEFAULTS
from megatron.data.t5_dataset import build_t5_datasets
from megatron.errors import exit_on_user_error
from megatron.model.config import T5Config
from megatron.model.t5_pipe import T5ModelPipe
from megatron.training import ModelHooks, run

DEFAULTS = ENTRY_DEFAULTS["t5"]
KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask", "enc_dec_mask")


def t5_config(args) -> T5Config:
    """The model's hyper-parameters from the resolved arguments (model code never reads args)."""
    return T5Config(num_layers=args.num_layers, num_decoder_layers=args.decoder_num_layers,
                    hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                    vocab_size=args.vocab_size, seq_length=args.encoder_seq_length,
                    decoder_seq_length=args.decoder_seq_length, ffn_hidden_size=args.ffn_hidden_size,
                    kv_channels=args.kv_channels, feed_forward_proj=args.feed_forward_proj,
                    tie_word_embeddings=not args.untie_embeddings_and_output_weights,
                    relative_attention_num_buckets=args.relative_attention_num_buckets,
                    relative_attention_max_distance=args.relative_attention_max_distance,
                    hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                    layernorm_epsilon=args.layernorm_epsilon,
                    make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                    checkpoint_num_layers=args.checkpoint_num_layers if args.checkpoint_activations else 0,
                    seed=args.seed)


def model_provider(args):
    """T5ModelPipe: encoder then decoder layers over the pipeline stages (one stage at pp = 1)."""
    return T5ModelPipe(t5_config(args), topology=mpu.get_topology(),
                       partition_method=args.partition_method or "type:TransformerLayer",
                       verbose=args.deepspeed_verbose or None,  # None: tds default (env TDS_VERBOSE)
                       virtual_stages=args.virtual_pipe_stages)


def train_valid_test_datasets_provider(args, tokenizer, num_samples):
    return build_t5_datasets(args.data_path, args.split, num_samples, args.encoder_seq_length,
                             args.decoder_seq_length, args.seed, tokenizer, noise_density=args.mask_prob)


def get_batch(raw, args, tokenizer):
    """Tensor-parallel rank 0's loader dict -> the micro-batch on every tp rank (one int64 broadcast)."""
    as_long = {key: raw[key].long() for key in KEYS} if raw is not None else None
    data = mpu.broadcast_data(KEYS, as_long, torch.int64)
    masks = [data[key].bool().unsqueeze(1) for key in ("enc_mask", "dec_mask", "enc_dec_mask")]  # (b, 1, q, k)
    return (data["text_enc"], data["text_dec"], *masks), (data["labels"], data["loss_mask"].float())


HOOKS = ModelHooks(model_provider, train_valid_test_datasets_provider, get_batch)

if __name__ == "__main__":
    exit_on_user_error(lambda: run(sys.argv[1:], HOOKS, DEFAULTS))
