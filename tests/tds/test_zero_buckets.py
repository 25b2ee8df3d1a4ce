"""ZeRO-1's reduce buckets are capped at the gradients of the rank's stage (tds.pipe.zero_buckets), in the
engine DeepSpeed builds and in the planner."""
import torch

from tds.pipe.zero_buckets import DEFAULT_REDUCE_BUCKET, sized_reduce_buckets


def test_capped_at_the_trainable_elements():
    module = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))  # 110 + 22
    module[1].weight.requires_grad_(False)  # frozen: not reduced
    cfg = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    out = sized_reduce_buckets(cfg, module)
    assert out["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 112}
    assert cfg == {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}, "the caller's dict is unchanged"
    assert sized_reduce_buckets({"zero_optimization": {"reduce_bucket_size": 50}}, module) == \
        {"zero_optimization": {"reduce_bucket_size": 50}}  # a smaller size asked for is kept
    assert sized_reduce_buckets({}, module)["zero_optimization"]["reduce_bucket_size"] == 112
    assert sized_reduce_buckets({"zero_optimization": {"reduce_bucket_size": "auto"}}, module)[
        "zero_optimization"]["reduce_bucket_size"] == "auto"
    assert DEFAULT_REDUCE_BUCKET == 500_000_000
