"""Megatron core as a test peer: run in a subprocess whose PYTHONPATH is a folder holding one megatron-core release
(tests/checkpoint/mcore_peer.py installs it), never this project (its `megatron` package would shadow core's).

It builds Megatron core's own GPTModel on the CPU from Megatron-LM's arguments, as Megatron-LM's
`core_transformer_config_from_args` maps them, with the local layer spec (Transformer Engine does not run on a
CPU), and answers requests, one JSON line each on stdin, one JSON line each on stdout:

    {"op": "save", "kind": K, "dir": D, "ids": F, "logits": F2}   a seeded model of kind K ('gpt2', 'llama',
            'qwen3' or 'moe', MODELS) written with dist_checkpointing.save as Megatron-LM's save_checkpoint
            writes torch_dist (args, checkpoint_version 3.0 and iteration beside the model's sharded state); its
            logits on the token ids in F (torch.save'd) are written to F2
    {"op": "load", "dir": D, "ids": F, "logits": F2}   a fresh model (another seed) built from the arguments the
            checkpoint D records (Megatron-LM's --use-checkpoint-args), loaded with dist_checkpointing.load; its
            logits on F to F2

`python mcore_peer_script.py --tp 2 save K D F F2` writes one checkpoint from two gloo processes of Megatron core
(tensor parallelism 2) instead.

Where Megatron core calls CUDA on this path, only those calls are replaced (`_cpu_only`): the device of its
scratch buffers and of one flag tensor (torch.cuda.current_device), a synchronize before writing, and the CUDA RNG
tracker's fork around attention dropout (the models run in eval mode, dropout 0). Without Transformer Engine,
core 0.15 and 0.16 leave `moe_utils.te_general_gemm` undefined (a failed import), so the router's gating linear
raises NameError; it is set to None, core's own fallback (torch.mm in the router's dtype).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import torch

VOCAB, HIDDEN, HEADS, LAYERS, POSITIONS, SEQ = 96, 32, 4, 3, 64, 16
# Megatron-LM's arguments of each model: GPT-2's layer with Megatron-LM's defaults (the fused bias-GELU, tied
# head) and a Llama-style layer (RMSNorm, SwiGLU, grouped-query attention, rotary, untied head, no biases)
_SHARED = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, kv_channels=HIDDEN // HEADS,
               max_position_embeddings=POSITIONS, seq_length=SEQ, norm_epsilon=1e-5, openai_gelu=False,
               bias_gelu_fusion=True, bias_swiglu_fusion=True, rotary_base=10000, rotary_percent=1.0,
               padded_vocab_size=VOCAB, vocab_size=VOCAB, make_vocab_size_divisible_by=32)
MODELS = {
    "gpt2": dict(_SHARED, ffn_hidden_size=4 * HIDDEN, group_query_attention=False, num_query_groups=1,
                 position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                 add_bias_linear=True, add_qkv_bias=True, untie_embeddings_and_output_weights=False),
    "llama": dict(_SHARED, ffn_hidden_size=48, group_query_attention=True, num_query_groups=2,
                  position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  add_qkv_bias=False, untie_embeddings_and_output_weights=True),
}
MODELS["qwen3"] = dict(MODELS["llama"], qk_layernorm=True)  # the Llama-style layer with per-head q / k norms
# the Llama-style layer with Megatron core's MoELayer in layers 2 and 3 (layer 1 dense): 4 SwiGLU experts, top-2, a
# shared expert, gated from core 0.16 (0.15 cannot); SequentialMLP experts (core's local spec; no grouped GEMM),
# the allgather dispatcher
MODELS["moe"] = dict(MODELS["llama"], num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                     moe_layer_freq=[0, 1, 1], moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                     moe_router_dtype="fp32", moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                     moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_aux_loss_coeff=0.0)
MOE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
              "moe_shared_expert_gate", "moe_router_dtype", "moe_token_dispatcher_type", "moe_grouped_gemm",
              "moe_router_score_function", "moe_router_pre_softmax", "moe_aux_loss_coeff")
ITERATION = 7


def _cpu_only() -> None:
    """The CUDA calls on Megatron core's CPU path, replaced (see the module docstring)."""
    from megatron.core.tensor_parallel import random as core_random
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    core_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)


def _namespace(kind: str, tp: int) -> argparse.Namespace:
    """The `args` Megatron-LM saves, with one of core's enums (a real run's arguments hold several)."""
    from megatron.core.transformer.enums import AttnBackend
    return argparse.Namespace(**MODELS[kind], tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                              iteration=ITERATION, consumed_train_samples=ITERATION * 8, train_iters=100, lr=1e-4,
                              params_dtype=torch.float32, attention_backend=AttnBackend.auto,
                              ckpt_format="torch_dist")


def _model(a: dict, seed: int):
    """Core's GPTModel from Megatron-LM's arguments `a` (core_transformer_config_from_args for these fields);
    every parameter perturbed by a seeded amount so that norms and biases matter."""
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    swiglu = a["swiglu"]
    moe = dict(num_moe_experts=a["num_experts"], **{k: a[k] for k in MOE_FIELDS}) if a.get("num_experts") else {}
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    moe = {k: v for k, v in moe.items() if k in known}  # core 0.15 has no moe_shared_expert_gate: ungated
    cfg = TransformerConfig(num_layers=a["num_layers"], hidden_size=a["hidden_size"],
                            ffn_hidden_size=a["ffn_hidden_size"], num_attention_heads=a["num_attention_heads"],
                            kv_channels=a["kv_channels"],
                            num_query_groups=a["num_query_groups"] if a["group_query_attention"] else None,
                            normalization=a["normalization"], layernorm_epsilon=a["norm_epsilon"],
                            gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
                            bias_activation_fusion=a["bias_swiglu_fusion"] if swiglu else a["bias_gelu_fusion"],
                            add_bias_linear=a["add_bias_linear"], add_qkv_bias=a["add_qkv_bias"],
                            qk_layernorm=bool(a.get("qk_layernorm")),
                            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                            tensor_model_parallel_size=torch.distributed.get_world_size(),
                            params_dtype=torch.float32, **moe)
    torch.manual_seed(seed)
    if moe:  # Megatron-LM's get_gpt_decoder_block_spec: dense and MoE layers by moe_layer_freq
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=a["normalization"])
    else:
        spec = get_gpt_layer_local_spec(normalization=a["normalization"], qk_layernorm=bool(a.get("qk_layernorm")))
    model = GPTModel(cfg, spec, vocab_size=a["padded_vocab_size"],
                     max_sequence_length=a["max_position_embeddings"],
                     position_embedding_type=a["position_embedding_type"], rotary_percent=a["rotary_percent"],
                     rotary_base=a["rotary_base"],
                     share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"])
    g = torch.Generator().manual_seed(seed)  # the same on every rank: replicated parameters stay equal
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _logits(model, ids_file: str, out: str) -> None:
    """Logits (b, s, v) gathered over tensor-parallel ranks, written by rank 0."""
    ids = torch.load(ids_file, weights_only=True)
    b, s = ids.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    with torch.no_grad():
        logits = model(ids, positions, causal)  # (b, s, v / tp)
    world = torch.distributed.get_world_size()
    parts = [torch.empty_like(logits) for _ in range(world)]
    torch.distributed.all_gather(parts, logits.contiguous())
    if torch.distributed.get_rank() == 0:
        torch.save(torch.cat(parts, dim=-1), out)


def save(kind: str, folder: str, ids_file: str, out: str) -> None:
    from megatron.core import dist_checkpointing
    model = _model(MODELS[kind], seed=1)
    _logits(model, ids_file, out)
    tracker = os.path.join(folder, "latest_checkpointed_iteration.txt")
    iteration_dir = os.path.join(folder, f"iter_{ITERATION:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(iteration_dir)
    torch.distributed.barrier()
    state = dict(args=_namespace(kind, torch.distributed.get_world_size()), checkpoint_version=3.0,
                 iteration=ITERATION, model=model.sharded_state_dict())
    dist_checkpointing.save(state, iteration_dir)
    if torch.distributed.get_rank() == 0:
        with open(tracker, "w") as f:
            f.write(str(ITERATION))


def load(folder: str, ids_file: str, out: str) -> None:
    from megatron.core import dist_checkpointing
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt")) as f:
        iteration = f.read().strip()
    iteration_dir = os.path.join(folder, "release" if iteration == "release" else f"iter_{int(iteration):07d}")
    model = _model(vars(dist_checkpointing.load_common_state_dict(iteration_dir)["args"]), seed=2)
    state = dist_checkpointing.load(dict(model=model.sharded_state_dict()), iteration_dir)
    model.load_state_dict(state["model"])
    _logits(model, ids_file, out)


def _init(rank: int, world: int, port: int) -> None:
    from megatron.core import parallel_state
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    _cpu_only()


def _serve() -> None:
    """Requests from stdin until it closes (one process, tp 1)."""
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "save":
                save(request["kind"], request["dir"], request["ids"], request["logits"])
            else:
                load(request["dir"], request["ids"], request["logits"])
            reply = dict(ok=True)
        except Exception as err:  # noqa: BLE001 - reported to the test, which fails with it
            import traceback
            reply = dict(ok=False, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        print(json.dumps(reply), flush=True)


def _rank_main(rank: int, world: int, port: int, argv: list) -> None:
    _init(rank, world, port)
    {"save": save, "load": load}[argv[0]](*argv[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("request", nargs="*", help="op kind dir ids logits (with --tp > 1)")
    a = p.parse_args()
    import warnings
    warnings.simplefilter("ignore")
    if a.tp == 1:
        _init(0, 1, a.port)
        print(json.dumps(dict(ready=True, version=_version())), flush=True)
        _serve()
    else:
        import torch.multiprocessing as mp
        mp.spawn(_rank_main, args=(a.tp, a.port, a.request), nprocs=a.tp, join=True)


def _version() -> str:
    from importlib.metadata import version
    return version("megatron-core")


if __name__ == "__main__":
    main()
