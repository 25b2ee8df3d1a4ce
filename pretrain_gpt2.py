"""Pretrain GPT-2 with 3D parallelism (tensor x pipeline x data) on DeepSpeed + TDS.

    deepspeed pretrain_gpt2.py --num-layers 24 --hidden-size 1024 ... --deepspeed --deepspeed_config cfg.json
    torchrun --nproc_per_node 8 pretrain_gpt2.py ...

A micro-batch is ((tokens, position_ids, attention_mask), (labels, loss_mask)): tokens/labels int64 (b, s),
attention_mask bool (1 or b, 1, s, s) with True = masked out, loss_mask float (b, s).
"""
import sys

import torch

from megatron import mpu
from megatron.arguments import ENTRY_DEFAULTS
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.masks import get_ltor_masks_and_position_ids
from megatron.errors import exit_on_user_error
from megatron.model.config import GPT2Config
from megatron.model.gpt2_pipe import GPT2ModelPipe
from megatron.training import ModelHooks, run

DEFAULTS = ENTRY_DEFAULTS["gpt"]


def gpt2_config(args) -> GPT2Config:
    """The model's hyper-parameters from the resolved arguments (model code never reads args)."""
    return GPT2Config(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                      seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
                      hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                      layernorm_epsilon=args.layernorm_epsilon,
                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                      checkpoint_num_layers=args.checkpoint_num_layers if args.checkpoint_activations else 0,
                      seed=args.seed, max_position_embeddings=args.max_position_embeddings,
                      init_method_std=args.init_method_std)


def model_provider(args):
    """GPT2ModelPipe: the layers split over args.pipe_parallel_size stages (one stage at pp = 1)."""
    return GPT2ModelPipe(gpt2_config(args), topology=mpu.get_topology(),
                         partition_method=args.partition_method or "type:TransformerLayer",
                         verbose=args.deepspeed_verbose or None,  # None: tds default (env TDS_VERBOSE)
                         virtual_stages=args.virtual_pipe_stages)


def train_valid_test_datasets_provider(args, tokenizer, num_samples):
    return build_train_valid_test_datasets(args.data_path, args.split, num_samples, args.seq_length, args.seed)


def get_batch(raw, args, tokenizer):
    """Tensor-parallel rank 0's loader dict {'text': (b, s+1)} -> the micro-batch, on every tp rank."""
    data = mpu.broadcast_data(["text"], raw, torch.int64)["text"]  # (b, s + 1)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, tokenizer.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
    return (tokens, position_ids, attention_mask), (labels, loss_mask)


HOOKS = ModelHooks(model_provider, train_valid_test_datasets_provider, get_batch)

if __name__ == "__main__":
    exit_on_user_error(lambda: run(sys.argv[1:], HOOKS, DEFAULTS))
