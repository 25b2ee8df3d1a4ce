"""One GPT-2 transformer layer per tp rank: saved activation bytes term by term, and collective bytes.

Korthikanti et al. 2022 (table 2), per layer and micro-batch, 2-byte activations and 1-byte dropout masks:

    term                                  bytes     split by tp   split by SP
    LN1 input                             2sbh      no            yes
    QKV GEMM input                        2sbh      no            yes (only X^r stored, re-gathered in backward)
    Q, K, V                               6sbh      yes           -
    softmax out, its dropout mask, output 5as^2b    yes           -
    dense GEMM input                      2sbh      yes           -
    attention-output dropout mask          sbh      no            yes
    LN2 input                             2sbh      no            yes
    h->4h GEMM input                      2sbh      no            yes
    GeLU input                            8sbh      yes           -
    4h->h GEMM input                      8sbh      yes           -
    MLP-output dropout mask                sbh      no            yes
    total: sbh (34 + 5as/h) at tp = 1; sbh (10 + 24/t + 5as/(ht)) with tp; sbh/t (34 + 5as/h) with SP;
    selective recomputation drops the 5as^2b term; full recomputation keeps only the layer input, 2sbh (/t).

Here activations have e bytes (fp32: 4, bf16: 2) and torch's CPU dropout stores its mask as the scaled
keep tensor in the activation dtype (m = e bytes, 1 byte on CUDA's fused dropout); the formula column uses
(e, m). Measured: the distinct non-parameter storages autograd saves during the forward (saved-tensor hooks),
attributed to the sub-module that saved them first, plus the inputs a checkpoint keeps.

Collectives: every all-reduce / all-gather / reduce-scatter of one forward + backward of the layer, as the
size N of the full tensor and the bytes a rank sends in a ring (all-reduce 2(t-1)/t N, all-gather and
reduce-scatter (t-1)/t N each). Sequence parallelism's all-gathers and reduce-scatters move what the all-reduces
they replace move; the backward re-gather of each stored input part (the price of storing s/t rows) is
counted separately.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from harness.spawn import run_on_ranks

TERMS = [  # (label, region, coefficient of sbh or as^2b in e-byte units, mask?, unit, tp-split)
    ("LN1 input", "input_layernorm", 1, False, "sbh", False),
    ("QKV GEMM input", "self_attention.query_key_value", 1, False, "sbh", False),
    ("Q, K, V (measured: with the core)", "self_attention", 3, False, "sbh", True),
    ("  + softmax, its dropout mask, out", None, 2, True, "as2b", True),  # 2e + m per as^2b
    ("dense GEMM input", "self_attention.dense", 1, False, "sbh", True),
    ("attention-output dropout mask", "attention_output_dropout", 1, True, "sbh", False),
    ("LN2 input", "post_attention_layernorm", 1, False, "sbh", False),
    ("h->4h GEMM input", "mlp.dense_h_to_4h", 1, False, "sbh", False),
    ("GeLU input", "mlp", 4, False, "sbh", True),
    ("4h->h GEMM input", "mlp.dense_4h_to_h", 4, False, "sbh", True),
    ("MLP-output dropout mask", "mlp_output_dropout", 1, True, "sbh", False),
]
RECOMPUTE = ("none", "selective", "full")


def formula(term, tp: int, sp: bool, e: int, m: int, s: int, b: int, h: int, a: int) -> float:
    label, _, coef, mask, unit, tp_split = term
    if unit == "as2b":
        return (2 * e + m) * a * s * s * b / tp
    size = (m if mask else coef * e) * s * b * h
    return size / tp if (tp_split or sp) else size


def formula_total(tp: int, sp: bool, recompute: str, e: int, m: int, s: int, b: int, h: int, a: int) -> float:
    if recompute == "full":
        return e * s * b * h / (tp if sp else 1)
    return sum(formula(t, tp, sp, e, m, s, b, h, a) for t in TERMS
               if not (recompute == "selective" and t[4] == "as2b"))


class Regions:
    """Which sub-module of the layer is running (forward hooks); storages saved are charged to it."""

    def __init__(self, layer: torch.nn.Module):
        self.stack, self.bytes, self.seen = ["other"], defaultdict(int), set()
        self.params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        names = {t[1] for t in TERMS if t[1]}
        for name, module in layer.named_modules():
            if name in names:
                module.register_forward_pre_hook(lambda _m, _i, n=name: self.stack.append(n) and None)
                module.register_forward_hook(lambda _m, _i, _o: self.stack.pop() and None)

    def add(self, t, region=None):
        if isinstance(t, torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.params and ptr not in self.seen:
                self.seen.add(ptr)
                self.bytes[region or self.stack[-1]] += t.untyped_storage().nbytes()
        return t


class Collectives:
    """Counts the full-tensor bytes N of each collective while installed: torch's all-reduce, and the sequence
    mappings (`mpu.mappings`, whose CPU all-gathers and reduce-scatters are all-to-alls moving a ring's bytes)."""

    def __init__(self):
        self.n = defaultdict(int)
        self.originals = []
        self.inside = False  # in the backward's fused re-gather + reduce-scatter: count it once, there

    def __enter__(self):
        from megatron.mpu import mappings, sequence_parallel

        def wrap(module, name, count):
            original = getattr(module, name)
            self.originals.append((module, name, original))

            def counted(*args, **kwargs):
                if self.inside:
                    return original(*args, **kwargs)
                self.inside = name == "gather_and_reduce_scatter_seq"
                try:
                    out = original(*args, **kwargs)
                finally:
                    self.inside = False
                count(args, out)
                return out
            setattr(module, name, counted)

        def all_reduce(args, out):
            self.n["all_reduce"] += args[0].nbytes

        def all_gather(args, gathered):
            self.n["all_gather"] += gathered.nbytes

        def reduce_scatter(args, out):
            self.n["reduce_scatter"] += args[0].nbytes

        def regather(args, out):  # the backward's second all-gather of a stored input part, and dX's reduce-scatter
            gathered, reduced = out
            all_gather(args, gathered)
            self.n["of which backward re-gather"] += gathered.nbytes
            if reduced is not None:
                self.n["reduce_scatter"] += reduced.nbytes * dist.get_world_size(args[2])

        wrap(dist, "all_reduce", all_reduce)
        wrap(mappings, "_gather_seq", all_gather)
        wrap(sequence_parallel, "_gather_seq", all_gather)  # the forward's gather, imported by name
        wrap(mappings, "_reduce_scatter_seq", reduce_scatter)
        wrap(sequence_parallel, "gather_and_reduce_scatter_seq", regather)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self.originals):
            setattr(module, name, original)


def measure_layer(tp: int, cases: list, seq: int, batch: int, hidden: int, heads: int, dtype: str,
                  attention_dropout: float) -> list:
    """Per case (sp, recompute): (bytes per region on this rank, collective bytes N per op)."""
    from megatron import mpu
    from megatron.model.config import GPTConfig
    from megatron.model.rng import start_iteration
    from megatron.model.transformer import TransformerLayer, run_layers
    state = mpu.initialize_model_parallel(tp, 1)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    out = []
    for sp, recompute in cases:
        cfg = GPTConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, vocab_size=128, seq_length=seq,
                         hidden_dropout=0.1, attention_dropout=attention_dropout, params_dtype=torch_dtype,
                         recompute_granularity=None if recompute == "none" else recompute,
                         checkpoint_num_layers=1 if recompute == "full" else 0)
        layer = TransformerLayer(cfg, 1, state.tp_group, sequence_parallel=sp)
        start_iteration(layer, 0)
        regions = Regions(layer)
        gen = torch.Generator().manual_seed(state.tp_rank)
        x = torch.randn(batch, seq // tp if sp else seq, hidden, generator=gen).to(torch_dtype).requires_grad_()
        original = mpu.checkpoint

        def counting_checkpoint(function, *args):
            for t in args:
                regions.add(t, "checkpoint inputs" if recompute == "full" else None)
            return original(function, *args)

        mpu.checkpoint = counting_checkpoint
        try:
            with Collectives() as comm:
                with torch.autograd.graph.saved_tensors_hooks(regions.add, lambda t: t):
                    y = run_layers([layer], x, cfg.checkpoint_num_layers)
                y.float().sum().backward()
        finally:
            mpu.checkpoint = original
        out.append((dict(regions.bytes), dict(comm.n)))
    mpu.destroy_model_parallel()
    return out


def print_layer_table(seq: int, batch: int, hidden: int, heads: int, dtype: str, attention_dropout: float) -> None:
    e = 4 if dtype == "fp32" else 2
    m, s, b, h, a = e, seq, batch, hidden, heads
    mib = 2 ** 20
    results = {}
    for tp in (1, 2, 4):
        cases = [(sp, r) for sp in ((False,) if tp == 1 else (False, True)) for r in RECOMPUTE]
        for case, res in zip(cases, run_on_ranks(measure_layer, tp, tp, cases, seq, batch, hidden, heads, dtype,
                                                 attention_dropout)):
            results[(tp, *case)] = res
    print(f"\nper transformer layer per micro-batch, rank 0: GPT-2 s={s} b={b} h={h} a={a} {dtype}, hidden dropout 0.1, "
          f"attention dropout {attention_dropout}; formula with e={e}, m={m} bytes (paper: e=2, m=1)")
    print(f"{'tp':>3s} {'SP':>4s} {'recompute':>10s} {'measured':>12s} {'formula':>12s} {'ratio':>6s} "
          f"{'goal <= 1.05 x tp1/t':>22s}")
    for (tp, sp, recompute), (regions, _) in results.items():
        got = sum(regions.values())
        want = formula_total(tp, sp, recompute, e, m, s, b, h, a)
        goal = ""
        if sp:
            base = sum(results[(1, False, recompute)][0].values())
            goal = f"{got / (base / tp):.3f} {'ok' if got <= 1.05 * base / tp else 'MISSED'}"
        print(f"{tp:3d} {'on' if sp else 'off':>4s} {recompute:>10s} {got / mib:9.3f} MiB {want / mib:9.3f} MiB "
              f"{got / want:6.3f} {goal:>22s}")
    print("\nterm by term (no recomputation), MiB per rank: measured / formula")
    layouts = [(1, False), (2, False), (2, True), (4, False), (4, True)]
    print(f"{'term':36s}" + "".join(f"{f'tp{tp} SP' if sp else f'tp{tp}':>18s}" for tp, sp in layouts))
    for term in TERMS:
        if term[1] is None:
            cells = [f"{'':>8s} {formula(term, tp, sp, e, m, s, b, h, a) / mib:8.3f}" for tp, sp in layouts]
        else:
            cells = [f"{results[(tp, sp, 'none')][0].get(term[1], 0) / mib:8.3f} "
                     f"{formula(term, tp, sp, e, m, s, b, h, a) / mib:8.3f}" for tp, sp in layouts]
        print(f"{term[0]:36s}" + "".join(f"{c:>18s}" for c in cells))
    others = [results[(tp, sp, "none")][0].get("other", 0) / mib for tp, sp in layouts]
    print(f"{'(elsewhere: residual, casts)':36s}" + "".join(f"{o:8.3f} {'-':>8s}".rjust(18) for o in others))
    print("\ncollectives of one forward + backward of the layer, rank 0: full-tensor bytes N (ring bytes sent)")
    for tp in (2, 4):
        for sp in (False, True):
            comm = results[(tp, sp, "none")][1]
            ring = (2 * comm.get("all_reduce", 0) + comm.get("all_gather", 0) + comm.get("reduce_scatter", 0)) \
                * (tp - 1) / tp
            regather = comm.get("of which backward re-gather", 0) * (tp - 1) / tp
            ops = ", ".join(f"{k} {v / mib:.3f} MiB" for k, v in sorted(comm.items()))
            print(f"  tp {tp} SP {'on ' if sp else 'off'}: {ops}; ring bytes sent per rank {ring / mib:.3f} MiB"
                  + (f", {(ring - regather) / mib:.3f} MiB without the re-gathers" if sp else ""))
