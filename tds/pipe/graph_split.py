"""Zero-bubble B/W split of any module's backward, through the autograd graph (ZB-H1's B and W).

torch.distributed.pipelining does the same (`_backward.stage_backward_input` / `stage_backward_weight`);
this version keeps DeepSpeed's hooks working (W accumulates through each parameter's AccumulateGrad node).

Nodes of one micro-batch's graph (roots: the stage's outputs, or its loss):

    leaves  = every leaf the graph reaches, except the parameters P split here: the stage inputs (the
              boundary's anchor), the weights of `weight_grad.py`'s deferring linears, checkpoint dummies
    N       = the nodes that reach a leaf: what B must run (the input gradient sent to the previous stage)
    F       = the nodes of N with an edge into a branch that reaches P without passing N: the W frontier

    B:  autograd.backward(roots, dY, inputs=leaves, retain_graph=True)  runs N only; a pre-hook on each
        node of F keeps the gradients flowing into it
    W:  per group of F nodes that share parameters, autograd.backward(F edges, kept gradients, inputs=P):
        runs the parameter branches (e.g. AddmmBackward computes dW = dY^T X and not dX again); a node of F
        that another node of the group reaches again is clamped to its kept gradients (no double count).
        Only a parameter used at two depths of the graph (reached from F through other nodes of N) makes W
        run nodes of N again; the graph is freed when the unit's W is done

With no leaf (the first stage without deferring linears) B is empty and W runs the whole backward
(as torch does). A parameter the graph does not reach (unused this micro-batch, or inside a reentrant
checkpoint or another function that runs its own backward) gets its gradient wherever autograd gives it,
i.e. in B: `BackwardInput.unsplit` names them. A graph with a reentrant checkpoint (torch's or DeepSpeed's
CheckpointFunction, whose own backward refuses `inputs=`) runs its whole backward in B (`backward_whole`), and
so does the engine (executor.py) for a stage that checkpoints activations at all: W would recompute each segment's forward
a second time (and a recomputation context made for one use, as Megatron's RNG replay, cannot run twice). Between B and W the micro-batch's graph is retained
(B's saved tensors stay until W); a non-reentrant checkpointed segment is recomputed again in W.
"""
from __future__ import annotations

from typing import Optional

import torch
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils import checkpoint as torch_checkpointing

__all__ = ["BackwardInput", "backward_input", "backward_whole"]

# reentrant checkpoints run a backward of their own, which refuses `inputs=`: B then runs the whole backward
_REENTRANT = (torch_checkpointing.CheckpointFunction, ds_checkpointing.CheckpointFunction)


class BackwardInput:
    """The result of B for one micro-batch: `run()` is its W; `unsplit` the parameters W will not compute."""

    def __init__(self, groups: list, kept: dict, needed: set, unsplit: list[torch.Tensor], reason: str = ""):
        self._groups, self._kept, self._needed, self.unsplit = groups, kept, needed, unsplit
        self.reason = reason or "the autograd graph does not reach them (unused this micro-batch, or inside an " \
                                "autograd function that runs a backward of its own)"

    def run(self) -> None:
        """W: accumulate the weight gradients into `.grad` (hooks fire as in a full backward)."""
        groups, kept, needed = self._groups, self._kept, self._needed
        self._groups, self._kept, self._needed = [], {}, set()
        for nodes, params in groups:
            edges = [(GradientEdge(n, i), g) for n in nodes for i, g in kept.get(n, {}).items()]
            clamped = [n for n in nodes if n in needed and n in kept] if len(nodes) > 1 else []
            clamps = [n.register_prehook(_returning(kept[n])) for n in clamped]
            try:
                if edges:
                    torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=params,
                                            retain_graph=True)  # a node of N may serve two groups
            finally:
                for handle in clamps:
                    handle.remove()


def backward_input(roots: list[torch.Tensor], grads: list[Optional[torch.Tensor]],
                   params: list[torch.Tensor]) -> BackwardInput:
    """B of `roots` (with output gradients `grads`; None for a scalar loss): every gradient but the weight
    gradients of `params`, which the returned object's `run()` computes later."""
    grads = [torch.ones_like(t) if g is None else g for t, g in zip(roots, grads)]
    kept = _root_grads(roots, grads)  # roots that B does not run start W with their own gradients
    reverse = _reverse_edges(list(kept))
    param_nodes = {_node(p): p for p in params}
    unsplit = [p for n, p in param_nodes.items() if n not in reverse]
    if any(issubclass(getattr(n, "_forward_cls", type(None)), _REENTRANT) for n in reverse):
        return backward_whole(roots, grads, params, "reentrant activation checkpointing (its backward cannot be "
                                                    "split)")
    leaf_nodes = [n for n in reverse if n not in param_nodes and hasattr(n, "variable")]
    if not leaf_nodes:  # nothing B must compute: W is the whole backward
        return BackwardInput([(list(kept), None)], kept, set(), unsplit)
    needed = _ancestors(leaf_nodes, reverse)
    groups = _groups([n for n in param_nodes if n in reverse], param_nodes, needed, set(kept), reverse)
    kept = {n: g for n, g in kept.items() if n not in needed}
    hooks = [n.register_prehook(_keeping(kept, n)) for group, _ in groups for n in group if n in needed]
    try:
        torch.autograd.backward(roots, grads, inputs=[n.variable for n in leaf_nodes], retain_graph=True)
    finally:
        for handle in hooks:
            handle.remove()
    return BackwardInput(groups, kept, needed, unsplit)


def backward_whole(roots: list[torch.Tensor], grads: list[Optional[torch.Tensor]], params: list[torch.Tensor],
                   reason: str) -> BackwardInput:
    """B that computes the weight gradients of `params` too (W has nothing left of them), for `reason`."""
    torch.autograd.backward(roots, grads)
    return BackwardInput([], {}, set(), list(params), reason)


def _node(t: torch.Tensor) -> Node:
    return get_gradient_edge(t).node  # a leaf's AccumulateGrad node


def _reverse_edges(roots: list[Node]) -> dict[Node, list[Node]]:
    """{node: the nodes with an edge into it} over the graph below `roots` (every node is a key)."""
    reverse: dict[Node, list[Node]] = {n: [] for n in roots}
    todo = list(reverse)
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in reverse:
                reverse[child] = []
                todo.append(child)
            reverse[child].append(node)
    return reverse


def _ancestors(starts: list[Node], reverse: dict) -> set[Node]:
    """`starts` and every node with a path into one of them (N: what B runs)."""
    seen, todo = set(starts), list(starts)
    while todo:
        for parent in reverse[todo.pop()]:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _groups(pnodes: list[Node], param_nodes: dict, needed: set, roots: set,
            reverse: dict) -> list[tuple[list, list]]:
    """[(W's start nodes, parameters)]: walk up from each parameter's node until N; the nodes of N reached,
    and the roots outside N passed, start its W. Parameters whose walks meet (a shared branch or frontier
    node) form one group (union-find over the parameters)."""
    parent = list(range(len(pnodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Node, int] = {}
    for i, start in enumerate(pnodes):
        todo = [start]
        while todo:
            node = todo.pop()
            if node in owner:
                parent[find(i)] = find(owner[node])
                continue
            owner[node] = i
            if node not in needed:
                todo += reverse[node]
    starts: dict[int, list[Node]] = {}
    members: dict[int, list[torch.Tensor]] = {}
    for node, i in owner.items():
        if node in needed or node in roots:
            starts.setdefault(find(i), []).append(node)
    for i, node in enumerate(pnodes):
        members.setdefault(find(i), []).append(param_nodes[node])
    return [(starts.get(r, []), ps) for r, ps in members.items()]


def _keeping(kept: dict, node: Node):
    def hook(grad_outputs):
        kept[node] = {i: g for i, g in enumerate(grad_outputs) if g is not None}
    return hook


def _returning(grads: dict):
    return lambda grad_outputs: tuple(grads.get(i) for i in range(len(grad_outputs)))


def _root_grads(roots: list[torch.Tensor], grads: list[torch.Tensor]) -> dict:
    """{root node: {output index: gradient}}."""
    kept: dict = {}
    for t, g in zip(roots, grads):
        edge = get_gradient_edge(t)
        slots = kept.setdefault(edge.node, {})
        slots[edge.output_nr] = g + slots[edge.output_nr] if edge.output_nr in slots else g
    return kept
