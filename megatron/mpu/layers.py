"""Tensor-parallel layers (Megatron): vocab-parallel embedding, column- and row-parallel linear, LM logits.

Shape legend: b batch, s sequence, h hidden, V vocabulary, p tensor-parallel size, r this tp rank.

    ColumnParallelLinear  Y = X A + b,  A = [A_1, ..., A_p] split by output columns; weight (out/p, in)
    RowParallelLinear     Y = X A + b,  A = [A_1; ...; A_p] split by input rows;     weight (out, in/p)
                          X = [X_1, ..., X_p],  Y = sum_r X_r A_r + b
    VocabParallelEmbedding  E = [E_1; ...; E_p] split by vocabulary rows;            weight (V/p, h)

Deterministic initialisation: every rank draws the FULL master weight from torch's default CPU generator
(the same draws whatever p is), then keeps its partition (see `utils.partition_master`), so a model built at
TP=p from a seed holds exactly the partitions of the TP=1 model built from that seed. Biases start at zero.

Sequence parallelism (`sequence_parallel=True`, see `mappings`): a ColumnParallelLinear takes X^r (b, s/p, in),
this rank's part of the sequence, and all-gathers it along the sequence (its gradient is reduce-scattered back)
in place of f, storing only X^r for backward (`sequence_parallel`); a RowParallelLinear reduce-scatters its output to (b, s/p, out) in place of g's all-reduce and
adds the bias to that part. Parameters applied to a part of the sequence (LayerNorm, the row-parallel bias) get
only this part's gradient: `mark_sequence_parallel` tags them, and the model sums their gradients over the tp
group before the step.

Fused QKV: with `stride=3` and a master weight laid out [Q; K; V] (each (h, in), heads contiguous inside),
rank r keeps rows [j*h + r*h/p, j*h + (r+1)*h/p) for j = 0, 1, 2, i.e. Q, K and V of heads
r*n/p .. (r+1)*n/p - 1 (n heads, n divisible by p). With the per-head layout [head0: q k v; head1: ...]
(Megatron >= 2.0) use stride 1 instead: contiguous rows are whole heads. Grouped-query attention's [Q; K; V]
(a query heads, G key/value groups) uses the block stride (a, G, G) (`utils`).
"""
from __future__ import annotations

import copy
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn import init

from tds.device import device
from tds.pipe.weight_grad import WeightGradStore, linear
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, resolve_group,
                       scatter_to_tensor_model_parallel_region)
from .sequence_parallel import sequence_parallel_linear
from .utils import Stride, VocabUtility, block_sizes, ensure_divisibility, merge_partitions, partition_master, stride_blocks

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: Stride) -> None:
    """Mark a parameter as split across tp ranks along `dim` with `stride` (read by grads and converters)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def mark_sequence_parallel(module_or_param, on: bool = True):
    """Tag the parameters of a module (or one parameter) as replicated across tp ranks but applied to this rank's
    part of the sequence: their gradients must be summed over the tp group (`param.sequence_parallel`)."""
    params = [module_or_param] if isinstance(module_or_param, torch.Tensor) else module_or_param.parameters()
    for param in params:
        param.sequence_parallel = on
    return module_or_param


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_group=None) -> bool:
    """True for split parameters and, for replicated ones, on tp rank 0 only (count each value once)."""
    return getattr(param, "tensor_model_parallel", False) or resolve_group(tp_group)[1] == 0


def _init_partition(shape: Tuple[int, int], partition_dim: int, stride: Stride, init_method: InitMethod,
                    dtype: torch.dtype, tp_group) -> nn.Parameter:
    """Initialise the full master weight on CPU in fp32, keep this rank's partition, move it to the device."""
    _, tp_rank, tp_size = resolve_group(tp_group)
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master)
    part = partition_master(master, partition_dim, stride, tp_size)[tp_rank]
    weight = nn.Parameter(part.to(device=device(), dtype=dtype).contiguous())
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    return weight


def full_weight(param: torch.Tensor, tp_group=None) -> torch.Tensor:
    """The master (TP=1) tensor of a parameter, all-gathered from the tp ranks; a copy if not split.

    Collective over `tp_group`, the group the parameter is split over (None: the current tp group).
    """
    group, _, tp_size = resolve_group(tp_group)
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return param.detach().clone()
    local = param.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(parts, local, group=group)
    return merge_partitions(parts, param.partition_dim, param.partition_stride)


@torch.no_grad()
def set_full_weight(param: torch.Tensor, master: torch.Tensor, tp_group=None) -> None:
    """Load this rank's partition of the master (TP=1) tensor into `param` (a plain copy if not split).

    `tp_group` is the group the parameter is split over (None: the current tp group); no communication.
    """
    if getattr(param, "tensor_model_parallel", False):
        _, tp_rank, tp_size = resolve_group(tp_group)
        master = partition_master(master, param.partition_dim, param.partition_stride, tp_size)[tp_rank]
    param.copy_(master)


def _zero_bias(size: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(size, device=device(), dtype=dtype))


class _TensorParallelModule(nn.Module):
    """Holds the tp group resolved at construction; a layer built at tp size 1 never communicates,
    even if a parallel state is initialised later (so a dense twin can live beside a tp model)."""

    def __deepcopy__(self, memo):
        """Copy everything but the process group, a shared handle that cannot be copied; keep the
        parameters' partition attributes (Parameter.__deepcopy__ drops them)."""
        memo[id(self.tp_group)] = self.tp_group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        for name, param in self._parameters.items():
            if param is not None:
                new._parameters[name].__dict__.update(param.__dict__)
        return new

    def _set_group(self, tp_group) -> Tuple[int, int]:
        self.tp_group, tp_rank, self.tp_size = resolve_group(tp_group)
        return tp_rank, self.tp_size

    def _copy_to(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else copy_to_tensor_model_parallel_region(x, self.tp_group)

    def _reduce_from(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else reduce_from_tensor_model_parallel_region(x, self.tp_group)

    def _scatter_to(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else scatter_to_tensor_model_parallel_region(x, self.tp_group)

    def _gather_from(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else gather_from_tensor_model_parallel_region(x, self.tp_group)


class VocabParallelEmbedding(_TensorParallelModule):
    """Embedding with the vocabulary split across tp ranks: (b, s) token ids -> (b, s, h).

    Rank r looks up ids in [r*V/p, (r+1)*V/p), writes zeros for the others, and the sum over ranks
    (reduce_from region) is the full lookup.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, init_method: InitMethod = init.xavier_normal_,
                 tp_group=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        tp_rank, tp_size = self._set_group(tp_group)
        ensure_divisibility(num_embeddings, tp_size, "vocab size",
                            hint="pad the vocabulary to a multiple of the tensor-model-parallel size")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, tp_rank, tp_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _init_partition((num_embeddings, embedding_dim), 0, 1, init_method, dtype, self.tp_group)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_, self.weight)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)  # (b, s)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        output_parallel = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self._reduce_from(output_parallel)


class ColumnParallelLinear(_TensorParallelModule):
    """Y = X A + b with A split by output columns: (..., in) -> (..., out) or (..., out/p).

    gather_output=False leaves Y_r = X A_r + b_r on rank r (input of a RowParallelLinear).
    stride > 1 interleaves the partitions (see the module docstring) and requires gather_output=False,
    since the gathered columns would be in partition order, not master order.
    Returns (output, bias): bias is None unless skip_bias_add, in which case it is not added.
    `weight_grad_store`: set from outside by `tds.pipe.weight_grad.attach` (ZB-H1 defers dA, db to W).
    """
    weight_grad_store: Optional[WeightGradStore] = None

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 init_method: InitMethod = init.xavier_normal_, stride: Stride = 1, skip_bias_add: bool = False,
                 tp_group=None, dtype: torch.dtype = torch.float32, sequence_parallel: bool = False):
        super().__init__()
        _, tp_size = self._set_group(tp_group)
        self.sequence_parallel = sequence_parallel and tp_size > 1
        if self.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear with sequence_parallel=True cannot gather_output (its output "
                             "covers the whole sequence; feed a RowParallelLinear instead)")
        block_sizes(output_size, stride, tp_size, "ColumnParallelLinear output size")
        if stride_blocks(stride) != (1,) and gather_output and tp_size > 1:
            raise ValueError(f"ColumnParallelLinear with stride {stride} > 1 cannot gather_output "
                             f"(the gathered columns would be permuted); use gather_output=False")
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = output_size // tp_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.weight = _init_partition((output_size, input_size), 0, stride, init_method, dtype, self.tp_group)
        self.bias = _zero_bias(self.output_size_per_partition, dtype) if bias else None
        if self.bias is not None:
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel:  # (b, s/p, in) -> (b, s, out/p), storing only the s/p part of the input
            output_parallel = sequence_parallel_linear(input_, self.weight, bias, self.tp_group,
                                                       self.weight_grad_store)
        else:
            output_parallel = linear(self._copy_to(input_), self.weight, bias, self.weight_grad_store)  # (..., out/p)
        output = self._gather_from(output_parallel) if self.gather_output else output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_TensorParallelModule):
    """Y = X A + b with A split by input rows: (..., in) or (..., in/p) -> (..., out).

    input_is_parallel=True takes X_r (e.g. from a ColumnParallelLinear with gather_output=False);
    otherwise X is scattered along its last dim. The bias is replicated and added after the all-reduce.
    Returns (output, bias): bias is None unless skip_bias_add, in which case it is not added.
    `weight_grad_store`: as ColumnParallelLinear's (only dA is deferred; the bias is added after the reduce).
    sequence_parallel: the output is reduce-scattered along the sequence, (b, s, in/p) -> (b, s/p, out).
    """
    weight_grad_store: Optional[WeightGradStore] = None

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 init_method: InitMethod = init.xavier_normal_, stride: Stride = 1, skip_bias_add: bool = False,
                 tp_group=None, dtype: torch.dtype = torch.float32, sequence_parallel: bool = False):
        super().__init__()
        _, tp_size = self._set_group(tp_group)
        self.sequence_parallel = sequence_parallel and tp_size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel=True needs input_is_parallel=True")
        block_sizes(input_size, stride, tp_size, "RowParallelLinear input size")
        if stride_blocks(stride) != (1,) and not input_is_parallel and tp_size > 1:
            raise ValueError(f"RowParallelLinear with stride {stride} > 1 needs input_is_parallel=True "
                             f"(scattering the input would not match the interleaved partitions)")
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size // tp_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.weight = _init_partition((output_size, input_size), 1, stride, init_method, dtype, self.tp_group)
        self.bias = _zero_bias(output_size, dtype) if bias else None
        if self.bias is not None and self.sequence_parallel:
            mark_sequence_parallel(self.bias)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        input_parallel = input_ if self.input_is_parallel else self._scatter_to(input_)  # (..., in/p)
        partial = linear(input_parallel, self.weight, None, self.weight_grad_store)  # (b, s, out), a partial sum
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # (b, s/p, out)
        else:
            output = self._reduce_from(partial)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None


def parallel_lm_logits(input_: torch.Tensor, word_embeddings_weight: torch.Tensor, parallel_output: bool,
                       bias: Optional[torch.Tensor] = None, tp_group=None, sequence_parallel: bool = False,
                       store: Optional[WeightGradStore] = None) -> torch.Tensor:
    """Logits against the vocab-parallel embedding: (b, s, h) -> (b, s, V/p), or (b, s, V) if gathered.
    With sequence_parallel the input is this rank's part (b, s/p, h), all-gathered along the sequence first, and
    `store` (ZB-H1's, the head module's `weight_grad_store`) defers the GEMM's weight gradient to W as the other
    linears' (without sequence parallelism the engine routes this F.linear to the store itself)."""
    if sequence_parallel:
        logits_parallel = sequence_parallel_linear(input_, word_embeddings_weight, bias, resolve_group(tp_group)[0],
                                                   store)
    else:
        logits_parallel = F.linear(copy_to_tensor_model_parallel_region(input_, tp_group), word_embeddings_weight, bias)
    if parallel_output:
        return logits_parallel
    return gather_from_tensor_model_parallel_region(logits_parallel, tp_group)
