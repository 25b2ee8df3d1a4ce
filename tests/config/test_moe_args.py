"""Mixture-of-experts arguments (megatron/config/moe_args.py): Megatron-LM's defaults, --moe-layer-freq parsed
without eval, the expert rank layout, and every refusal as one line naming the flags and values."""
import pytest

from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
from megatron.errors import UserError
from megatron.model.moe_config import layer_pattern
from megatron.model.specs import spec_for
from tests.config.test_arguments import assert_one_line_error

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10", "--swiglu", "--zero-stage", "0"]


def parse(*extra, world_size=8, defaults=ENTRY_DEFAULTS["gpt"]):
    return parse_args(BASE + list(extra), world_size=world_size, defaults=defaults)


def test_megatron_defaults_and_the_config():
    args = parse("--num-experts", "8", "--moe-ffn-hidden-size", "24", world_size=1)
    args.vocab_size = 64
    moe = spec_for("gpt").config(args).moe
    assert (moe.num_experts, moe.ffn_hidden_size, moe.topk, moe.score_function, moe.router_dtype) == \
        (8, 24, 2, "softmax", "fp32")
    assert (moe.load_balancing, moe.aux_loss_coeff, moe.capacity_factor, moe.dispatcher) == \
        ("aux_loss", 0.0, None, "allgather")
    assert moe.layer_pattern == (1, 1, 1, 1) and args.expert_model_parallel_size == 1
    dense = parse(world_size=1)
    dense.vocab_size = 64
    assert spec_for("gpt").config(dense).moe is None and dense.expert_model_parallel_size == 1


@pytest.mark.parametrize("freq, layers, want", [
    ("1", 4, (1, 1, 1, 1)), ("2", 4, (1, 0, 1, 0)), ("[0,1,1,0]", 4, (0, 1, 1, 0)),
    ("([0]+[1]*3)", 4, (0, 1, 1, 1)), ("[1, 0]*2", 4, (1, 0, 1, 0)), ("([0]*2+[1]*2)", 4, (0, 0, 1, 1)),
])
def test_layer_pattern(freq, layers, want):
    assert layer_pattern(freq, layers) == want


@pytest.mark.parametrize("extra, world, words", [
    (["--moe-router-topk", "3"], 8, ["--moe-router-topk need --num-experts"]),
    (["--num-experts", "8", "--moe-layer-freq", "__import__('os').system('true')"], 8,
     ["--moe-layer-freq", "neither an int nor a list"]),
    (["--num-experts", "8", "--moe-layer-freq", "[1,0]"], 8, ["lists 2 layers", "--num-layers is 4"]),
    (["--num-experts", "8", "--moe-layer-freq", "[1,0,2,1]"], 8, ["--moe-layer-freq"]),
    (["--num-experts", "8", "--moe-layer-freq", "0"], 8, ["--moe-layer-freq 0"]),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 8,
     ["--num-experts 6", "--expert-model-parallel-size 4"]),
    (["--num-experts", "8", "--expert-model-parallel-size", "8", "--pipe-parallel-size", "2"], 8,
     ["--expert-model-parallel-size 8", "4 ranks per pipeline stage"]),
    (["--num-experts", "8", "--moe-router-topk", "9"], 8, ["--moe-router-topk 9", "--num-experts 8"]),
    (["--num-experts", "8", "--expert-tensor-parallel-size", "2"], 8, ["--expert-tensor-parallel-size 2"]),
    (["--num-experts", "8", "--tensor-model-parallel-size", "2"], 8, ["--tensor-model-parallel-size 2",
                                                                      "--sequence-parallel"]),
    (["--num-experts", "8", "--expert-model-parallel-size", "2", "--zero-stage", "1"], 8, ["--zero-stage 1"]),
    (["--num-experts", "8", "--expert-model-parallel-size", "2", "--bf16"], 8, ["fp32", "--bf16"]),
    (["--num-experts", "8", "--moe-grouped-gemm"], 8, ["--moe-grouped-gemm", "not built yet"]),
    (["--num-experts", "8", "--moe-router-enable-expert-bias"], 8, ["needs --moe-router-score-function sigmoid"]),
    (["--num-experts", "8", "--expert-model-parallel-size", "2", "--layout-invariant", "--zero-stage", "0"], 8,
     ["--layout-invariant with --expert-model-parallel-size 2", "use ep 1"]),
])
def test_mistakes_are_one_line(extra, world, words):
    assert_one_line_error(lambda: parse(*extra, world_size=world), words)


def test_experts_need_swiglu_and_t5_takes_none():
    with pytest.raises(UserError, match="give --swiglu"):
        parse_args([a for a in BASE if a != "--swiglu"] + ["--num-experts", "8"], world_size=1,
                   defaults=ENTRY_DEFAULTS["gpt"])
    with pytest.raises(UserError, match="--num-experts: GPT options; pretrain_t5.py does not take them"):
        parse_args([a for a in BASE if a != "--swiglu"] + ["--num-experts", "8"], world_size=1,
                   defaults=ENTRY_DEFAULTS["t5"])


def test_expert_groups_fold_out_of_each_stage():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from tds.pipe.grid import expert_rank_lists
    lists = expert_rank_lists(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2), 2)
    assert lists == {"expert": [[0, 1], [2, 3], [4, 5], [6, 7]], "expert_data": [[0, 2], [1, 3], [4, 6], [5, 7]],
                     "expert_model": [[0, 1, 4, 5], [2, 3, 6, 7]]}
    lists = expert_rank_lists(PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=8), 4)
    assert lists["expert"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and lists["expert_data"][1] == [1, 5]


def test_the_start_up_line_predicts_experts():
    from megatron.training.pretrain import predicted_peak
    args = parse("--num-experts", "8", world_size=1)
    assert predicted_peak(args, 64).startswith("predicted peak ")
