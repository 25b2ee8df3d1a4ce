"""Shared pieces of the tds tests: a tiny deterministic layer stack, its data, a DeepSpeed config, and a
single-process reference trainer.

Shapes: b = micro-batch size, D_IN = 6 input features, H = 8 hidden, D_OUT = 3 outputs.
Every layer's weights come from a generator seeded by its global index, so a pipeline stage and the
single-process reference build bit-identical layers wherever they are built.
"""
from __future__ import annotations

import torch
import torch.nn as nn

D_IN, H, D_OUT = 6, 8, 3


class SeededLinear(nn.Linear):
    """Linear layer (x @ W^T + b, then tanh unless last) with weights drawn from a per-layer seed."""

    def __init__(self, n_in: int, n_out: int, seed: int, act: bool = True):
        super().__init__(n_in, n_out)
        g = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in ** 0.5)
            self.bias.copy_(torch.randn(n_out, generator=g) * 0.1)
        self.act = act

    def forward(self, x):  # (b, n_in) -> (b, n_out)
        y = super().forward(x)
        return torch.tanh(y) if self.act else y


def stack_specs(num_hidden: int = 6):
    """LayerSpecs: input (D_IN->H), num_hidden x (H->H), head (H->D_OUT)."""
    from tds.pipe import LayerSpec
    specs = [LayerSpec(SeededLinear, D_IN, H, 0)]
    specs += [LayerSpec(SeededLinear, H, H, i + 1) for i in range(num_hidden)]
    specs += [LayerSpec(SeededLinear, H, D_OUT, num_hidden + 1, act=False)]
    return specs


def reference_model(num_hidden: int = 6) -> nn.Sequential:
    return nn.Sequential(*[spec.build() for spec in stack_specs(num_hidden)])


def mse(out, label):
    return ((out.float() - label.float()) ** 2).mean()


def make_data(steps: int, global_batch: int, seed: int = 0):
    """X: (steps, global_batch, D_IN), Y: (steps, global_batch, D_OUT)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, global_batch, D_IN, generator=g), torch.randn(steps, global_batch, D_OUT, generator=g)


def rank_iterator(X, Y, dp_rank: int, dp: int, gas: int, mbs: int):
    """(inputs, labels) per micro-batch: step t's global batch is cut into dp*gas micro-batches of mbs rows;
    data-parallel rank d takes micro-batches d*gas .. d*gas+gas-1 of every step."""
    for t in range(X.shape[0]):
        for i in range(gas):
            lo = (dp_rank * gas + i) * mbs
            yield X[t, lo:lo + mbs], Y[t, lo:lo + mbs]


def ds_config(mbs: int, gas: int, dp: int, zero: int = 1, **pipeline) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
           "train_batch_size": mbs * gas * dp, "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True}
    if pipeline:
        cfg["pipeline"] = pipeline
    return cfg


def make_optimizer(params):
    return torch.optim.Adam(params, lr=1e-2)


def reference_train(X, Y, steps: int, num_hidden: int = 6):
    """Single process, whole global batch per step: (losses, {'layer.param': tensor}) after `steps` steps."""
    model = reference_model(num_hidden)
    opt = make_optimizer(model.parameters())
    losses = []
    for t in range(steps):
        opt.zero_grad()
        loss = mse(model(X[t]), Y[t])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {f"{i}.{n}": p.detach().clone() for i, layer in enumerate(model) for n, p in layer.named_parameters()}
    return losses, params


def topology(pp: int, tp: int, dp: int):
    from tds.pipe import PipeModelDataParallelTopology
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


def stage_params(engine) -> dict:
    """This rank's parameters keyed by global layer index, like reference_train's."""
    module, out = engine.module, {}
    tied = [id(m) for m in module.tied_modules.values()]
    for local_idx, layer in enumerate(module.forward_funcs):
        if isinstance(layer, nn.Module) and id(layer) not in tied:
            for n, p in layer.named_parameters():
                out[f"{local_idx + module._local_start}.{n}"] = p.detach().float().clone()
    return out


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def init_ds() -> None:
    """DeepSpeed's comm layer over the harness's already-initialised gloo group."""
    from tds import device
    device.init_distributed()

