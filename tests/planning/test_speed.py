"""megatron.planning.speed: the bubble and the hops on the critical path come from the schedule simulator."""
from dataclasses import replace

import pytest

from megatron.model.config import GPTConfig
from megatron.planning.memory import Layout
from megatron.planning.model_shape import ModelShape
from megatron.planning.speed import Cluster, bubble_fraction, exposed_hops, predict_step
from tds.pipe.instructions import train_schedule
from tds.pipe.schedule_sim import Costs, expected_bubble, simulate_timed

GPT2_MEDIUM = ModelShape.of(GPTConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50257,
                                     seq_length=1024))


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_bubble_is_the_closed_form(schedule, v):
    lay = Layout(pp=4, gas=8, schedule=schedule, virtual_stages=v)
    assert bubble_fraction(lay) == pytest.approx(expected_bubble(schedule, 4, 8, v))
    assert bubble_fraction(replace(lay, pp=1)) == 0.0 and exposed_hops(replace(lay, pp=1)) == (0, 0)


def test_exposed_hops_count_the_critical_path():
    """GPipe with one micro-batch crosses each of the p-1 boundaries twice, each crossing a send, a hop and a
    receive; for 1F1B the counts are what the full simulation with small hop and instruction costs adds."""
    assert exposed_hops(Layout(pp=4, gas=1, schedule="gpipe")) == (6, 12)
    lay = Layout(pp=4, gas=8, schedule="1f1b")
    hops, instructions = exposed_hops(lay)
    lists = [train_schedule("1f1b", 4, s, 8) for s in range(4)]

    def makespan(costs):
        return max(s.end for s in simulate_timed(lists, costs))
    base = makespan(Costs())
    assert makespan(Costs(comm=0.01)) - base == pytest.approx(0.01 * hops)
    assert makespan(Costs(instruction=0.01)) - base == pytest.approx(0.01 * instructions)
    assert hops > 2 * 3 and instructions > hops  # 1F1B's steady state waits on round trips too


def test_pp_comm_is_hops_times_their_cost():
    lay = Layout(pp=4, dp=2, micro_batch=4, gas=8, precision="bf16")
    hops, instructions = exposed_hops(lay)
    base = Cluster(hop_latency_ms=0.0, instruction_ms=0.0)
    bytes_per_hop = 4 * 1024 * 1024 * 2  # b s h bf16
    assert predict_step(GPT2_MEDIUM, lay, base).pp_comm == pytest.approx(hops * bytes_per_hop / 450e9)
    slower = replace(base, hop_latency_ms=0.5, instruction_ms=0.25)
    extra = predict_step(GPT2_MEDIUM, lay, slower).pp_comm - predict_step(GPT2_MEDIUM, lay, base).pp_comm
    assert extra == pytest.approx(hops * 0.5e-3 + instructions * 0.25e-3)
    assert predict_step(GPT2_MEDIUM, replace(lay, pp=1, dp=8), slower).pp_comm == 0.0
