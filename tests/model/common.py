"""Shared pieces of the model tests: tiny configs, deterministic batches, the single-process plain-model
reference, and the per-rank TDS pipeline runner.

Parameters are compared by "spec key": f"{spec index}.{name inside the spec's module}", the naming of
GPT2ModelPipe / T5ModelPipe; `plain_params` gives the plain model's parameters under the same keys.
Tensor-parallel parameters are compared slice by slice: the reference's full tensor is cut with
mpu.partition_master like the layer's own initialisation.
"""
from __future__ import annotations

import torch

MBS, GAS = 2, 2
LR = 0.05


def gpt2_config(**kw):
    from megatron.model.config import GPT2Config
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=300, seq_length=16,
                hidden_dropout=0.0, attention_dropout=0.0, seed=7)
    return GPT2Config(**{**base, **kw})


def t5_config(**kw):
    from megatron.model.config import T5Config
    base = dict(num_layers=2, num_decoder_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
                ffn_hidden_size=64, vocab_size=300, seq_length=16, decoder_seq_length=8,
                relative_attention_num_buckets=8, relative_attention_max_distance=16,
                feed_forward_proj="gated-gelu", hidden_dropout=0.0, attention_dropout=0.0, seed=7)
    return T5Config(**{**base, **kw})


def make_config(kind: str, **kw):
    return gpt2_config(**kw) if kind == "gpt2" else t5_config(**kw)


# --- data ---------------------------------------------------------------------------------------------
def _causal(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).triu(1)  # True above the diagonal = masked


def gpt2_batch(config, b: int, g: torch.Generator):
    """((tokens, position_ids), (labels, loss_mask)): causal attention, no mask tensor; with
    config.explicit_attention_mask ((tokens, position_ids, mask), ...), mask (b, 1, s, s) bool True = masked,
    the causal mask with the first row's first quarter a document of its own (a --reset-attention-mask mask)."""
    s, v = config.seq_length, config.vocab_size
    tokens = torch.randint(0, v, (b, s), generator=g)
    labels = torch.randint(0, v, (b, s), generator=g)
    loss_mask = (torch.rand(b, s, generator=g) > 0.2).float()
    positions = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    if not config.explicit_attention_mask:
        return (tokens, positions), (labels, loss_mask)
    mask = _causal(s).expand(b, 1, s, s).clone()
    mask[0, 0, s // 4:, :s // 4] = True  # later positions of row 0 do not see its first document
    return (tokens, positions, mask), (labels, loss_mask)


def t5_batch(config, b: int, g: torch.Generator):
    """((enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask), (labels, loss_mask)), masks True = masked;
    the encoder of the last sample is padded after 3/4 of its length."""
    se, sd, v = config.seq_length, config.decoder_seq_length, config.vocab_size
    enc = torch.randint(0, v, (b, se), generator=g)
    dec = torch.randint(0, v, (b, sd), generator=g)
    labels = torch.randint(0, v, (b, sd), generator=g)
    loss_mask = (torch.rand(b, sd, generator=g) > 0.2).float()
    enc_pad = torch.zeros(b, se, dtype=torch.bool)
    enc_pad[-1, 3 * se // 4:] = True
    enc_mask = (enc_pad[:, None, None, :] | enc_pad[:, None, :, None]).contiguous()
    dec_mask = _causal(sd).expand(b, 1, sd, sd).contiguous()
    cross_mask = enc_pad[:, None, None, :].expand(b, 1, sd, se).contiguous()
    return (enc, dec, enc_mask, dec_mask, cross_mask), (labels, loss_mask)


def make_batches(kind: str, config, steps: int, global_batch: int, seed: int = 0) -> list:
    """steps global batches, each a list of micro-batches (inputs, labels) of MBS rows."""
    g = torch.Generator().manual_seed(seed)
    batch = gpt2_batch if kind == "gpt2" else t5_batch
    return [[batch(config, MBS, g) for _ in range(global_batch // MBS)] for _ in range(steps)]


# --- reference -----------------------------------------------------------------------------------------
def build_plain(kind: str, config, tp_group=None):
    from megatron.model.gpt2_model import GPT2Model
    from megatron.model.t5_model import T5Model
    return (GPT2Model if kind == "gpt2" else T5Model)(config, tp_group)


def plain_params(kind: str, model) -> dict:
    """The plain model's parameters keyed like the pipeline's specs."""
    if kind == "gpt2":
        head = [model.lm_head] if model.lm_head is not None else []
        modules = [model.embedding, *model.layers, model.final_layernorm, *head]
        prefixes = [""] * len(model.layers) + ["", "final_layernorm.", *([""] * len(head))]
    else:
        modules = [model.embedding, *model.encoder_layers, model.encoder_final, *model.decoder_layers,
                   model.decoder_final, *([model.lm_head] if model.lm_head is not None else [])]
        prefixes = [""] * len(modules)
    return {f"{i}.{pre}{n}": p for i, (m, pre) in enumerate(zip(modules, prefixes)) for n, p in m.named_parameters()}


def micro_loss(model, micro) -> torch.Tensor:
    inputs, (labels, loss_mask) = micro
    return model.loss(model(*inputs), labels, loss_mask)


def reference_run(kind: str, config, batches: list) -> dict:
    """Single process, plain model, SGD(LR): per-step mean micro-batch loss, first-step gradients, and the
    eval-mode loss on the first batch after training."""
    model = build_plain(kind, config)
    params = plain_params(kind, model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step, micro_batches in enumerate(batches):
        opt.zero_grad()
        total = 0.0
        for micro in micro_batches:
            loss = micro_loss(model, micro) / len(micro_batches)
            loss.backward()
            total += loss.item()
        if step == 0:
            grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
        opt.step()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        eval_loss = sum(micro_loss(model, m).item() for m in batches[0]) / len(batches[0])
    return {"losses": losses, "grads": grads, "eval_loss": eval_loss}


# --- pipeline rank ---------------------------------------------------------------------------------------
class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it is given at its first step (after every reduction)."""

    def __init__(self, named_params: dict, lr: float):
        super().__init__(list(named_params.values()), lr=lr)
        self.named = named_params
        self.first_grads = None

    @torch.no_grad()
    def step(self, closure=None):
        if self.first_grads is None:
            self.first_grads = {k: p.grad.detach().float().clone() for k, p in self.named.items()
                                if p.grad is not None}
        return super().step(closure)


def pipe_params(model) -> dict:
    """This stage's parameters keyed by spec index. A tied module is keyed by the spec index of its first
    use; a stage that only reuses it (the LM head) contributes the tied weights only. With virtual stages a
    stage holds several non-contiguous chunks of specs (`model.chunk_bounds`)."""
    from tds.pipe import TiedLayerSpec
    out = {}
    layers = [idx for lo, hi in model.chunk_bounds for idx in range(lo, hi)]
    for idx in layers:
        spec = model._layer_specs[idx]
        if isinstance(spec, TiedLayerSpec):
            first = next(i for i, s in enumerate(model._layer_specs)
                         if isinstance(s, TiedLayerSpec) and s.key == spec.key)
            tied = model.tied_modules[spec.key]
            names = None if first in layers else set(spec.tied_weight_attr)
            out.update({f"{first}.{n}": p for n, p in tied.named_parameters() if names is None or n in names})
        else:
            out.update({f"{idx}.{n}": p for n, p in model._modules[str(idx)].named_parameters()})
    return out


def ds_config(dp: int, precision: str = "fp32", zero: int = 0, gas: int = GAS, pipeline: dict | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": gas,
           "train_batch_size": MBS * gas * dp, "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True}
    if pipeline:
        cfg["pipeline"] = dict(pipeline)
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def pipe_rank(kind: str, tp: int, pp: int, dp: int, config_kw: dict, steps: int, partition="type:TransformerLayer",
              precision: str = "fp32", zero: int = 0, seed: int = 0, repeat_batch: bool = False,
              gas: int = GAS, schedule: str = "1f1b", virtual_stages: int = 1, sequence_parallel: bool = False) -> dict:
    """Train `steps` batches of MBS x gas x dp rows (or one batch `steps` times) with the TDS engine in
    `precision` and pipeline `schedule` (`virtual_stages` chunks per stage, the sequence split over tp with
    `sequence_parallel`), then evaluate the first batch;
    return the losses, the eval loss, the first-step fp32 gradients (local slices + how to slice the
    reference), the tp rank and the partition."""
    import torch.distributed as dist

    import tds
    from megatron import mpu
    from megatron.model.gpt2_pipe import GPT2ModelPipe
    from megatron.model.t5_pipe import T5ModelPipe
    tds.init_distributed(dist_backend="gloo")  # adopts the harness's group; no JIT build of DeepSpeed's shm op
    state = mpu.initialize_model_parallel(tp, pp)
    mpu.model_parallel_seed(1234)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    config = make_config(kind, params_dtype=dtype, **config_kw)
    model = (GPT2ModelPipe if kind == "gpt2" else T5ModelPipe)(config, partition_method=partition,
                                                               virtual_stages=virtual_stages,
                                                               sequence_parallel=sequence_parallel)
    from megatron.model.rng import start_iteration
    start_iteration(model, 0, (state.dp_rank, dp))  # replica r draws the masks of the micro-batches it holds
    named = pipe_params(model)
    opt = RecordingSGD(named, LR)
    pipeline = dict(schedule=schedule, **({"virtual_stages": virtual_stages} if virtual_stages > 1 else {}))
    engine, _, _, _ = tds.initialize(model=model, optimizer=opt, config=ds_config(dp, precision, zero, gas, pipeline),
                                     mpu=mpu)
    batches = make_batches(kind, config, 1 if repeat_batch else steps, MBS * gas * dp, seed)
    batches = batches * steps if repeat_batch else batches
    # Megatron's sampler: replica r's j-th micro-batch of a step is the single process's micro-batch j dp + r
    it = iter([m for micro_batches in batches for m in micro_batches[state.dp_rank::dp]])
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    eval_loss = engine.eval_batch(iter(batches[0][state.dp_rank::dp])).item()
    grads = {}
    if opt.first_grads is not None and precision == "fp32":
        grads = {k: (g, getattr(named[k], "tensor_model_parallel", False), getattr(named[k], "partition_dim", 0),
                     getattr(named[k], "partition_stride", 1)) for k, g in opt.first_grads.items()}
    mpu.destroy_model_parallel()
    dist.barrier()
    return {"losses": losses, "eval_loss": eval_loss, "grads": grads, "tp_rank": state.tp_rank,
            "parts": list(model.parts)}


def plain_rank(kind: str, tp: int, dp: int) -> dict:
    """One batch through the plain model on a (tp, dp) grid, gradients averaged over dp by hand; returns
    the batch loss, the local gradient slices (keyed like `plain_params`) and the tp rank."""
    import torch.distributed as dist

    from megatron import mpu
    state = mpu.initialize_model_parallel(tp, 1)
    config = make_config(kind)
    model = build_plain(kind, config)
    params = plain_params(kind, model)
    micro_batches = make_batches(kind, config, 1, MBS * GAS * dp)[0]
    loss = torch.zeros(())
    for micro in micro_batches[state.dp_rank * GAS:(state.dp_rank + 1) * GAS]:
        mb_loss = micro_loss(model, micro) / len(micro_batches)
        mb_loss.backward()
        loss += mb_loss.detach()
    for p in [loss, *(p.grad for p in params.values())]:
        dist.all_reduce(p, group=state.dp_group)
    grads = {k: (p.grad, getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", 0),
                 getattr(p, "partition_stride", 1)) for k, p in params.items()}
    mpu.destroy_model_parallel()
    return {"losses": [loss.item()], "grads": grads, "tp_rank": state.tp_rank}


def run_plain_jobs(jobs: list) -> list:
    return [plain_rank(**job) for job in jobs]


def run_jobs(jobs: list) -> list:
    """Per rank: run several `pipe_rank(**job)` trainings one after the other (same world size)."""
    return [pipe_rank(**job) for job in jobs]


def reference_slice(full: torch.Tensor, is_parallel: bool, dim: int, stride: int, tp: int, tp_rank: int,
                    local_shape) -> torch.Tensor:
    """This tp rank's slice of a reference (TP=1) tensor. The word table is padded to a multiple of 128 * tp
    rows, so the reference is first zero-padded (padded ids get no gradient) to tp * local rows."""
    from megatron import mpu
    if not is_parallel or tp == 1:
        return full
    rows = tp * local_shape[dim] if dim == 0 else full.shape[0]
    if rows > full.shape[0]:
        full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    return mpu.partition_master(full, dim, stride, tp)[tp_rank]


def check_grads(results: list, ref_grads: dict, tp: int, tol: float) -> int:
    """Every rank's first-step gradients against the reference slices; returns how many were compared."""
    seen = set()
    for r in results:
        for key, (g, is_parallel, dim, stride) in r["grads"].items():
            want = reference_slice(ref_grads[key], is_parallel, dim, stride, tp, r["tp_rank"], g.shape)
            err = rel_err(g, want)
            assert err < tol, f"gradient of {key} (tp_rank {r['tp_rank']}): rel err {err:.2e}"
            seen.add(key)
    missing = set(ref_grads) - seen
    assert not missing, f"no rank reported gradients for {sorted(missing)}"
    return len(seen)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
