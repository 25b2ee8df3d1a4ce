"""megatron/mpu/context_parallel.py: attention over a sequence split across cp ranks equals full attention.

One launch of 4 gloo ranks, cp 4 over all of them and cp 2 over each pair: for every comm type (all_gather, p2p,
a2a), causal attention with grouped-query heads (8 query heads, 4 groups), and with packed documents whose
boundaries fall inside a chunk and across the chunks' boundaries: this rank's rows of the output and its tokens'
dq, dk and dv (from an upstream gradient drawn at random over the whole sequence) equal those of full attention
computed by one process (fp32, relative error < 1e-5). Each comm type sends the messages its docstring states.
The zigzag split and the one-line errors run without processes.
"""
import pytest
import torch

from harness.dist import run_distributed
from megatron.mpu.context_parallel import COMM_TYPES, MESSAGES, attention, split_for_rank, zigzag_indices

RTOL = 1e-5
B, N, G, S, D = 2, 8, 4, 32, 8


def _inputs():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, heads, S, D, generator=gen) for heads in (N, G, G))
    grad = torch.randn(B, N, S, D, generator=gen)
    documents = torch.zeros(B, S, dtype=torch.long)
    documents[0, 5:] = 1   # inside rank 0's first chunk at cp 4
    documents[0, 20:] = 2
    documents[1, 16:] = 1  # on the boundary of two chunks
    return q, k, v, grad, documents


def _full(q, k, v, grad, documents):
    """Full attention (one process) and its input gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    if documents is not None:
        allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
    k_rep, v_rep = (t.repeat_interleave(N // G, dim=1) for t in (k, v))
    scores = (q @ k_rep.transpose(-2, -1) * D ** -0.5).masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v_rep
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _errors() -> dict:
    """{(cp, comm, packed): max relative error of out, dq, dk, dv} and {comm: messages} on this rank."""
    import torch.distributed as dist
    rank = dist.get_rank()
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]}
    q, k, v, grad, documents = _inputs()
    errors, messages = {}, {}
    for packed in (False, True):
        docs = documents if packed else None
        want = _full(q, k, v, grad, docs)
        for cp, group in groups.items():
            cp_rank = dist.get_rank(group)
            mine = [split_for_rank(t, 2, cp, cp_rank) for t in want]
            for comm in COMM_TYPES:
                MESSAGES.clear()
                local = [split_for_rank(t, 2, cp, cp_rank).requires_grad_() for t in (q, k, v)]
                out = attention(*local, group, comm,
                                None if docs is None else split_for_rank(docs, 1, cp, cp_rank))
                out.backward(split_for_rank(grad, 2, cp, cp_rank))
                got = [out.detach()] + [t.grad for t in local]
                errors[cp, comm, packed] = max(_rel(a, b) for a, b in zip(got, mine))
                messages[cp, comm] = dict(MESSAGES)
    return dict(errors=errors, messages=messages)


def test_every_comm_type_equals_full_attention_and_sends_what_it_says():
    results = run_distributed(_errors, 4, timeout=180)
    for r in results:
        for key, err in r["errors"].items():
            assert err < RTOL, f"cp {key[0]} {key[1]} packed={key[2]}: relative error {err:.2e}"
        for cp in (2, 4):
            assert r["messages"][cp, "all_gather"] == {("all_gather", "forward"): 1, ("all_gather", "backward"): 1}
            assert r["messages"][cp, "p2p"] == {("p2p", "forward"): cp - 1, ("p2p", "backward"): cp - 1}
            assert r["messages"][cp, "a2a"] == {("a2a", "forward"): 2, ("a2a", "backward"): 2}


def test_the_zigzag_split_balances_the_causal_work():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([zigzag_indices(48, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(48))
    work = [int((zigzag_indices(48, 4, r) + 1).sum()) for r in range(4)]  # keys each rank's queries attend
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="the sequence length 30 is not divisible by 2 x context-parallel size"):
        zigzag_indices(30, 4, 0)
