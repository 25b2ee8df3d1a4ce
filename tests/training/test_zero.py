"""ZeRO-1 given only on the command line really reaches DeepSpeed: the engine's optimizer is DeepSpeed's
stage-1/2 optimizer at stage 1, and Adam's state is partitioned across the data-parallel replicas
(each holds ~1/dp of every parameter group, and together they cover it)."""
import json

import pytest
import torch

from megatron.config.arguments import parse_args
from megatron.training.pretrain import initialize_and_build
from harness.dist import run_distributed
from tests.training.runner import GPT_DEFAULTS, small_argv


def _zero_state(argv, world_size):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from megatron import mpu
    from tests.training.toy_model import TOY_SPEC
    args = parse_args(argv, defaults=GPT_DEFAULTS, world_size=world_size)
    engine, _, cfg, _ = initialize_and_build(args, TOY_SPEC)
    V, b, s = cfg.tokenizer.padded_vocab_size, cfg.batch.micro_batch_size, cfg.data.seq_length
    gen = torch.Generator().manual_seed(0)
    batches = iter([((torch.randint(V, (b, s), generator=gen),),
                     (torch.randint(V, (b, s), generator=gen), torch.ones(b, s))) for _ in range(args.gas)])
    engine.train_batch(batches)
    opt = engine.optimizer
    stage_params = [sum(p.numel() for p in group) for group in opt.bit16_groups]
    partitions = [p.numel() for p in opt.single_partition_of_fp32_groups]
    adam_state = [opt.optimizer.state[p]["exp_avg"].numel() for p in opt.single_partition_of_fp32_groups]
    return dict(is_zero=isinstance(opt, DeepSpeedZeroOptimizer), stage=engine.zero_optimization_stage(),
                stage_params=stage_params, partitions=partitions, adam_state=adam_state,
                pp_rank=mpu.get_pipe_parallel_rank(), dp_rank=mpu.get_data_parallel_rank(),
                first_values=[p[:4].tolist() for p in opt.single_partition_of_fp32_groups])


@pytest.mark.long
def test_zero_stage_1_from_command_line_partitions_adam_state(gpt_data, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"steps_per_print": 1000}))  # no zero_optimization section at all
    argv = small_argv(gpt_data, pp=2, extra=["--deepspeed", "--deepspeed_config", str(cfg)])
    results = run_distributed(_zero_state, 4, argv, 4, timeout=180)
    dp = 2
    for r in results:
        assert r["is_zero"] and r["stage"] == 1
        assert r["adam_state"] == r["partitions"]
        for total, part in zip(r["stage_params"], r["partitions"]):
            assert part == -(-total // dp) or part == total // dp, (total, part)  # ~1/dp, DeepSpeed pads
    for pp_rank in (0, 1):
        replicas = [r for r in results if r["pp_rank"] == pp_rank]
        assert sorted(r["dp_rank"] for r in replicas) == [0, 1]
        for g, total in enumerate(replicas[0]["stage_params"]):
            assert sum(r["partitions"][g] for r in replicas) >= total
        assert replicas[0]["first_values"] != replicas[1]["first_values"]  # different slices
