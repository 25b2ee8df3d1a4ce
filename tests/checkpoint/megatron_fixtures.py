"""Ancestor checkpoints written from their documented layouts (key names, shapes, QKV row orders; see
megatron/checkpointing/ancestors/ for the layouts), from a transformers model whose
logits are the reference. Nothing here calls the importer's code.

    reference(kind)                  GPT2LMHeadModel ('gpt2': tanh GELU, 'gpt2_erf': erf GELU) or LlamaForCausalLM
                                     with grouped-query attention and an untied head ('llama'), or the same as
                                     Qwen3ForCausalLM ('qwen3': Megatron's --qk-layernorm), tiny, seeded
    write_legacy(root, model, tp, pp, version, ...)   Megatron-LM legacy: tracker, iter_*/mp_rank_TT[_PPP]
    write_torch_dist(root, model, tp, pp, ...)        Megatron core torch_dist (PyTorch DCP, one process)
    write_ds_pipe(root, model, tp, pp, flavor, order) DeepSpeed pipeline layer files (Megatron-DeepSpeed,
                                                      DeepSpeedExamples v1.1.5 / CPM-Pretrain)
"""
from __future__ import annotations

import argparse
import contextlib
import enum
import io
import json
import os
import random
import sys
import types
from typing import Dict, List

import numpy as np
import torch

VOCAB, HIDDEN, HEADS, GROUPS, LAYERS, POSITIONS = 96, 32, 4, 2, 4, 64


def reference(kind: str, seed: int = 0) -> torch.nn.Module:
    import transformers
    torch.manual_seed(seed)
    if kind.startswith("gpt2"):
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS,
                                      n_head=HEADS, activation_function="gelu" if kind == "gpt2_erf" else "gelu_new",
                                      initializer_range=0.2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
        with torch.no_grad():  # non-trivial norms and biases
            for name, p in model.named_parameters():
                if "ln" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
        return model.eval()
    shape = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POSITIONS,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, head_dim=HIDDEN // HEADS))
        with torch.no_grad():  # query / key norms that matter
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
        return model.eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()


class Ref(dict):
    """Full (tp = 1) tensors in Megatron's names, q / k / v and gate / up kept apart, with the model's sizes."""

    def __init__(self, model):
        super().__init__(megatron_tensors(model))
        c = model.config
        self.vocab, self.hidden, self.heads, self.layers = c.vocab_size, c.hidden_size, c.num_attention_heads, \
            c.num_hidden_layers
        self.positions = c.max_position_embeddings
        self.hn = self.hidden // self.heads
        self.groups = self["0.k.weight"].size(0) // self.hn


def megatron_tensors(model) -> Dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    out = {}
    if "transformer.wte.weight" in sd:
        out["word"], out["pos"] = sd["transformer.wte.weight"], sd["transformer.wpe.weight"]
        for i in range(layers):
            p = f"transformer.h.{i}."
            w, b = sd[p + "attn.c_attn.weight"].t(), sd[p + "attn.c_attn.bias"]
            for j, n in enumerate("qkv"):
                rows = slice(j * hidden, (j + 1) * hidden)
                out[f"{i}.{n}.weight"], out[f"{i}.{n}.bias"] = w[rows], b[rows]
            for ours, theirs, transposed in (("ln1", "ln_1", False), ("dense", "attn.c_proj", True),
                                             ("ln2", "ln_2", False), ("fc1", "mlp.c_fc", True),
                                             ("fc2", "mlp.c_proj", True)):
                out[f"{i}.{ours}.weight"] = sd[p + theirs + ".weight"].t() if transposed else sd[p + theirs + ".weight"]
                out[f"{i}.{ours}.bias"] = sd[p + theirs + ".bias"]
        out["final.weight"], out["final.bias"] = sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]
        return out
    out["word"], out["head"] = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in "qkv":
            out[f"{i}.{n}.weight"] = sd[p + f"self_attn.{n}_proj.weight"]
        for ours, theirs in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"),
                             ("dense", "self_attn.o_proj"), ("fc2", "mlp.down_proj"), ("gate", "mlp.gate_proj"),
                             ("up", "mlp.up_proj")):
            out[f"{i}.{ours}.weight"] = sd[p + theirs + ".weight"]
        if p + "self_attn.q_norm.weight" in sd:  # Qwen3: Megatron's q_layernorm / k_layernorm
            out[f"{i}.qn.weight"], out[f"{i}.kn.weight"] = (sd[p + f"self_attn.{n}_norm.weight"] for n in "qk")
    out["final.weight"] = sd["model.norm.weight"]
    return out


def qkv_rows(t: Ref, layer: int, leaf: str, order: str, tp: int, r: int) -> torch.Tensor:
    """tp rank r's fused QKV rows of `layer` in `order` ('0' [3, np, hn], '1' [np, hn, 3], '2' grouped)."""
    hn = t.hn
    np_, ng = t.heads // tp, t.groups // tp
    q = t[f"{layer}.q.{leaf}"][r * np_ * hn:(r + 1) * np_ * hn]
    k, v = (t[f"{layer}.{n}.{leaf}"][r * ng * hn:(r + 1) * ng * hn] for n in "kv")
    rest = tuple(q.shape[1:])
    if order == "0":
        return torch.cat([q, k, v])
    if order == "1":
        return torch.stack([x.reshape(np_, hn, *rest) for x in (q, k, v)], dim=2).reshape(-1, *rest)
    per = np_ // ng
    blocks = [torch.cat([q.reshape(ng, per * hn, *rest)[g], k.reshape(ng, hn, *rest)[g], v.reshape(ng, hn, *rest)[g]])
              for g in range(ng)]
    return torch.cat(blocks)


def padded(rows: int, tp: int, divisible: int = 8) -> int:
    m = divisible * tp
    return -(-rows // m) * m


def rank_layer(t: Ref, i: int, tp: int, r: int, order: str) -> Dict[str, torch.Tensor]:
    """Layer i on tp rank r in Megatron-LM's legacy names (self_attention., input_layernorm, ...)."""
    def cols(x):
        return x.chunk(tp, dim=1)[r].clone()

    def rows(x):
        return x.chunk(tp, dim=0)[r].clone()
    out = {"input_layernorm.weight": t[f"{i}.ln1.weight"], "post_attention_layernorm.weight": t[f"{i}.ln2.weight"],
           "self_attention.query_key_value.weight": qkv_rows(t, i, "weight", order, tp, r),
           "self_attention.dense.weight": cols(t[f"{i}.dense.weight"]),
           "mlp.dense_4h_to_h.weight": cols(t[f"{i}.fc2.weight"])}
    if f"{i}.gate.weight" in t:  # SwiGLU: each rank holds [its gate rows; its up rows]
        out["mlp.dense_h_to_4h.weight"] = torch.cat([rows(t[f"{i}.gate.weight"]), rows(t[f"{i}.up.weight"])])
    else:
        out["mlp.dense_h_to_4h.weight"] = rows(t[f"{i}.fc1.weight"])
        out["mlp.dense_h_to_4h.bias"] = rows(t[f"{i}.fc1.bias"])
    if f"{i}.ln1.bias" in t:
        out.update({"input_layernorm.bias": t[f"{i}.ln1.bias"], "post_attention_layernorm.bias": t[f"{i}.ln2.bias"],
                    "self_attention.query_key_value.bias": qkv_rows(t, i, "bias", order, tp, r),
                    "self_attention.dense.bias": t[f"{i}.dense.bias"], "mlp.dense_4h_to_h.bias": t[f"{i}.fc2.bias"]})
    return out


def vocab_rows(x: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    full = torch.cat([x, x.new_zeros(padded(x.size(0), tp) - x.size(0), x.size(1))])
    return full.chunk(tp)[r].clone()


@contextlib.contextmanager
def megatron_classes():
    """Megatron-LM's own classes, as its files pickle them (an enum in args, the old fp16 loss scaler)."""
    enums, scaler = types.ModuleType("megatron.core.enums"), types.ModuleType("megatron.fp16.loss_scaler")

    class ModelType(enum.Enum):
        encoder_or_decoder = 1

    class DynamicLossScaler:
        def __init__(self):
            self.cur_scale, self.cur_iter = 65536.0, 10
    for module, cls in ((enums, ModelType), (scaler, DynamicLossScaler)):
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
        sys.modules[module.__name__] = module
    try:
        yield ModelType, DynamicLossScaler
    finally:
        for module in (enums, scaler):
            del sys.modules[module.__name__]


def _namespace(t: Ref, tp: int, pp: int, version, gelu: Dict, iteration: int) -> argparse.Namespace:
    llama = "head" in t
    ns = dict(num_layers=t.layers, hidden_size=t.hidden, num_attention_heads=t.heads, kv_channels=t.hn,
              ffn_hidden_size=t["0.fc2.weight"].size(1), max_position_embeddings=t.positions, seq_length=t.positions,
              padded_vocab_size=padded(t.vocab, tp), make_vocab_size_divisible_by=8, layernorm_epsilon=1e-5,
              hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, iteration=iteration,
              consumed_train_samples=iteration * 8, train_iters=1000, lr=3e-4, min_lr=3e-5, lr_decay_style="cosine",
              lr_warmup_iters=10, lr_decay_iters=1000, tokenizer_type="GPT2BPETokenizer", fp16=True, **gelu)
    if version is not None and version >= 3:
        ns.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    else:
        ns.update(model_parallel_size=tp)
    if llama:
        ns.update(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  group_query_attention=True, num_query_groups=t.groups, untie_embeddings_and_output_weights=True,
                  norm_epsilon=1e-5, layernorm_epsilon=None, rotary_base=10000, rotary_percent=1.0,
                  qk_layernorm="0.qn.weight" in t)
    return argparse.Namespace(**ns)


STYLES = {  # legacy key spellings: attention module, layer norms, final norm
    "old": dict(attention="attention", ln1="input_layernorm", ln2="post_attention_layernorm", final="final_layernorm"),
    "new": dict(attention="self_attention", ln1="input_norm", ln2="post_attention_norm", final="final_norm")}


def _styled(layer: Dict[str, torch.Tensor], style: str) -> Dict[str, torch.Tensor]:
    s = STYLES[style]
    return {k.replace("self_attention.", s["attention"] + ".").replace("input_layernorm", s["ln1"])
            .replace("post_attention_layernorm", s["ln2"]): v for k, v in layer.items()}


def write_legacy(root: str, model, tp: int, pp: int, version, style: str = "new", container: str = "encoder",
                 vpp: int = 1, iteration: int = 120, gelu: Dict = None, extra_args: Dict = None) -> None:
    """Megatron-LM legacy files (megatron/checkpointing.py's save_checkpoint of each release); `container`:
    'encoder' (2.5 and later), 'transformer' (1.0 to 2.4) or 'gpt2model_2019' (the GPT2Model of July 2019,
    abe36e2e5f: its flat state dict, no args); `version` None writes no checkpoint_version (version 0)."""
    t = Ref(model)
    order = {None: "0", 1.0: "1"}.get(version, "2")
    gelu = gelu if gelu is not None else dict(openai_gelu=True)
    folder = os.path.join(root, f"iter_{iteration:07d}")
    per_chunk = t.layers // (pp * vpp)
    with megatron_classes() as (model_type, scaler):
        for s in range(pp):
            for r in range(tp):
                chunks = []
                for c in range(vpp):
                    first = (c * pp + s) * per_chunk
                    encoder = {}
                    for j in range(per_chunk):
                        encoder.update({f"layers.{j}.{k}": v for k, v in
                                        _styled(rank_layer(t, first + j, tp, r, order), style).items()})
                    lm = {}
                    if s == 0 and c == 0:
                        lm["embedding"] = {"word_embeddings": {"weight": vocab_rows(t["word"], tp, r)}}
                        if "pos" in t:
                            lm["embedding"]["position_embeddings"] = {"weight": t["pos"]}
                    last = s == pp - 1 and c == vpp - 1
                    if last:
                        encoder.update({f"{STYLES[style]['final']}.{k}": t[f"final.{k}"] for k in ("weight", "bias")
                                        if f"final.{k}" in t})
                    if container == "gpt2model_2019":
                        chunks.append({"word_embeddings.weight": lm["embedding"]["word_embeddings"]["weight"],
                                       "position_embeddings.weight": t["pos"],
                                       **{f"transformer.{k}": v for k, v in encoder.items()}})
                        continue
                    lm[container] = encoder
                    chunk = {"language_model": lm}
                    if last and "head" in t:
                        lm["output_layer"] = {"weight": vocab_rows(t["head"], tp, r)}
                    elif last and pp > 1:
                        chunk["word_embeddings_for_head"] = {"weight": vocab_rows(t["word"], tp, r)}
                    chunks.append(chunk)
                state = dict(iteration=iteration,
                             optimizer={"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []},
                                        "loss_scaler": scaler()},
                             random_rng_state=random.getstate(), np_rng_state=np.random.get_state(),
                             torch_rng_state=torch.get_rng_state())
                if container != "gpt2model_2019":
                    state["args"] = _namespace(t, tp, pp, version, gelu, iteration)
                    state["args"].model_type = model_type.encoder_or_decoder
                    vars(state["args"]).update(extra_args or {})
                if vpp > 1:
                    state.update({f"model{c}": m for c, m in enumerate(chunks)})
                else:
                    state["model"] = chunks[0]
                if version is not None:
                    state["checkpoint_version"] = version
                rank_dir = os.path.join(folder, f"mp_rank_{r:02d}" + (f"_{s:03d}" if pp > 1 else ""))
                os.makedirs(rank_dir)
                torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def write_ds_pipe(root: str, model, tp: int, pp: int, flavor: str, order: str = "2", iteration: int = 40) -> None:
    """DeepSpeed pipeline files: flavor 'megatron-deepspeed' (GPTModelPipe: embedding at spec index 1, layers
    2 .. L+1, final norm L+2, args and checkpoint_version 3.0 in the mp_rank files), 'v1.1.5' (GPT2ModelPipe of
    DeepSpeedExamples / CPM-Pretrain: embedding 0, layers 2 .. L+1 with `attention.` keys, final norm L+3,
    iteration only) or 'no-pipe' (Megatron-DeepSpeed without a pipeline: the GPTModel's state dict as the
    mp_rank file's module, one per tp rank)."""
    t = Ref(model)
    folder = os.path.join(root, f"global_step{iteration}")
    os.makedirs(folder)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(f"global_step{iteration}")
    if flavor == "no-pipe":
        for r in range(tp):
            module = {"language_model.embedding.word_embeddings.weight": vocab_rows(t["word"], tp, r),
                      "language_model.embedding.position_embeddings.weight": t["pos"],
                      "language_model.encoder.final_layernorm.weight": t["final.weight"],
                      "language_model.encoder.final_layernorm.bias": t["final.bias"]}
            for i in range(t.layers):
                layer = rank_layer(t, i, tp, r, order)
                module.update({f"language_model.encoder.layers.{i}.{k}": v for k, v in layer.items()})
            torch.save(dict(module=module, args=_namespace(t, tp, 1, 3.0, dict(openai_gelu=True), iteration),
                            checkpoint_version=3.0, iteration=iteration),
                       os.path.join(folder, f"mp_rank_{r:02d}_model_states.pt"))
        return
    mds = flavor == "megatron-deepspeed"
    embed, first_layer, final = (1, 2, t.layers + 2) if mds else (0, 2, t.layers + 3)
    for r in range(tp):
        def save(index, state):
            torch.save(state, os.path.join(folder, f"layer_{index:02d}-model_{r:02d}-model_states.pt"))
        save(embed, {"word_embeddings.weight": vocab_rows(t["word"], tp, r), "position_embeddings.weight": t["pos"]})
        for i in range(t.layers):
            layer = rank_layer(t, i, tp, r, order)
            save(first_layer + i, layer if mds else _styled(layer, "old"))
        save(final, {"weight": t["final.weight"], "bias": t["final.bias"]})
    gelu = dict(openai_gelu=True)
    with megatron_classes() as (model_type, _):
        for mp in range(tp * pp):
            state = dict(module=None, buffer_names=[], optimizer=None, lr_scheduler={"num_steps": iteration * 8},
                         global_steps=iteration, global_samples=iteration * 8, dp_world_size=1, mp_world_size=tp * pp,
                         ds_config={"train_batch_size": 8}, ds_version="0.3.13", iteration=iteration,
                         random_rng_state=random.getstate(), np_rng_state=np.random.get_state(),
                         torch_rng_state=torch.get_rng_state())
            if mds:
                args = _namespace(t, tp, pp, 3.0, gelu, iteration)
                args.model_type = model_type.encoder_or_decoder
                state.update(args=args, checkpoint_version=3.0, tokens=iteration * 8 * t.positions)
            torch.save(state, os.path.join(folder, f"mp_rank_{mp:02d}_model_states.pt"))


def write_cpm_t5_layer(root: str) -> None:
    """A CPM-Pretrain T5ModelPipe folder: one decoder layer file (cross-attention) beside the engine file."""
    folder = os.path.join(root, "global_step1")
    os.makedirs(folder)
    torch.save({"word_embeddings.weight": torch.zeros(8, 4), "position_embeddings.weight": torch.zeros(8, 4)},
               os.path.join(folder, "layer_00-model_00-model_states.pt"))
    torch.save({"attention.query_key_value.weight": torch.zeros(12, 4), "cross_attention.only_query.weight":
                torch.zeros(4, 4), "cross_attention.key_value.weight": torch.zeros(8, 4)},
               os.path.join(folder, "layer_03-model_00-model_states.pt"))
    torch.save({"module": None, "iteration": 1}, os.path.join(folder, "mp_rank_00_model_states.pt"))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("global_step1")


def write_legacy_t5(root: str) -> None:
    """Megatron-LM's T5 in the legacy format: an encoder, a decoder and an LM head (tiny, tp = pp = 1)."""
    layer = {"layers.0.input_norm.weight": torch.ones(4), "layers.0.self_attention.query_key_value.weight":
             torch.zeros(12, 4)}
    model = {"language_model": {"embedding": {"word_embeddings": {"weight": torch.zeros(8, 4)},
                                              "position_embeddings": {"weight": torch.zeros(8, 4)}},
                                "encoder": dict(layer), "decoder": dict(layer)}, "lm_head": {"bias": torch.zeros(8)}}
    os.makedirs(os.path.join(root, "iter_0000001", "mp_rank_00"))
    torch.save({"model": model, "checkpoint_version": 3.0, "iteration": 1},
               os.path.join(root, "iter_0000001", "mp_rank_00", "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")


def write_core_torch_format(root: str) -> None:
    """Megatron core's GPTModel saved by Megatron-LM with --ckpt-format torch: the legacy file layout holding core's
    module tree (embedding, decoder.layers.N with Transformer Engine's fused norms, output_layer; tiny)."""
    layer = {"self_attention": {"linear_qkv": {"weight": torch.zeros(12, 4), "layer_norm_weight": torch.ones(4)},
                                "linear_proj": {"weight": torch.zeros(4, 4)}},
             "mlp": {"linear_fc1": {"weight": torch.zeros(16, 4), "layer_norm_weight": torch.ones(4)},
                     "linear_fc2": {"weight": torch.zeros(4, 16)}}}
    model = {"embedding": {"word_embeddings": {"weight": torch.zeros(8, 4)}},
             "decoder": {"layers": {"0": layer}, "final_layernorm": {"weight": torch.ones(4)}},
             "output_layer": {"weight": torch.zeros(8, 4)}}
    os.makedirs(os.path.join(root, "iter_0000001", "mp_rank_00"))
    torch.save({"model": model, "checkpoint_version": 3.0, "iteration": 1},
               os.path.join(root, "iter_0000001", "mp_rank_00", "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")


class _Chunked:
    """A global tensor that a distributed checkpoint stores as chunks [(offsets, tensor)] (what tp x pp ranks write)."""

    def __init__(self, chunks: List):
        self.chunks = chunks
        dims = len(chunks[0][1].shape)
        self.size = torch.Size(max(off[d] + x.size(d) for off, x in chunks) for d in range(dims))

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(off), x.shape),
                                                      TensorProperties.create_from_tensor(x), self.size))
                for off, x in self.chunks]


def _planner():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def lookup_object(self, index):
            obj = self.state_dict[index.fqn]
            if isinstance(obj, _Chunked):
                return next(x for off, x in obj.chunks if tuple(off) == tuple(index.offset))
            return super().lookup_object(index)
    return Planner(flatten_state_dict=False)  # a list item stays one item, as in core's files


def _stacked(per_layer, layers: int, tp: int, pp: int, dim) -> _Chunked:
    """[L, ...] over pp stages (layer axis) and tp ranks (`dim` of a layer's tensor, None: replicated):
    per_layer(i, r) is rank r's part of layer i."""
    chunks, per_stage = [], layers // pp
    for s in range(pp):
        for r in range(tp if dim is not None else 1):
            x = torch.stack([per_layer(s * per_stage + j, r) for j in range(per_stage)])
            off = [s * per_stage] + [0] * (x.dim() - 1)
            if dim is not None:
                off[1 + dim] = r * x.size(1 + dim)
            chunks.append((off, x))
    return _Chunked(chunks)


def write_torch_dist(root: str, model, tp: int, pp: int, iteration: int = 300, common_extra: Dict = None) -> None:
    """Megatron core 0.19's torch_dist folder (core_v0.19.0, which does not install from PyPI here; the releases
    that do are tested as themselves, tests/checkpoint/test_megatron_core.py): metadata.json, the DCP files
    (global tensors written as the (tp, pp) ranks' chunks, layers stacked on a leading axis, the norms under
    Transformer Engine's names), and no common.pt: the common state is the item `common_state/shard_0_1`, which
    dist_checkpointing/serialization.py's save adds as a ShardedObject and strategies/torch.py's
    `_mcore_to_torch_sharded_object` stores as every ShardedObject, torch.save([data of each rank]); the same
    for Transformer Engine's `_extra_state` (a BytesIO)."""
    import torch.distributed.checkpoint as dcp
    t = Ref(model)
    word = torch.cat([t["word"], t["word"].new_zeros(padded(t.vocab, tp) - t.vocab, t.hidden)])
    sd = {"embedding.word_embeddings.weight": _Chunked([((r * x.size(0), 0), x) for r, x in enumerate(word.chunk(tp))])}
    if "pos" in t:
        sd["embedding.position_embeddings.weight"] = t["pos"]
    f = t["0.fc2.weight"].size(1)
    fused = [("self_attention.linear_qkv.weight", lambda i, r: qkv_rows(t, i, "weight", "2", tp, r), 0),
             ("self_attention.linear_proj.weight", lambda i, r: t[f"{i}.dense.weight"].chunk(tp, 1)[r], 1),
             ("mlp.linear_fc2.weight", lambda i, r: t[f"{i}.fc2.weight"].chunk(tp, 1)[r], 1)]
    norm_names = ("self_attention.linear_qkv.layer_norm_", "mlp.linear_fc1.layer_norm_")
    for leaf in ("weight", "bias"):
        if f"0.ln1.{leaf}" in t:
            fused += [(norm_names[0] + leaf, lambda i, r, lf=leaf: t[f"{i}.ln1.{lf}"], None),
                      (norm_names[1] + leaf, lambda i, r, lf=leaf: t[f"{i}.ln2.{lf}"], None)]
    if "0.qn.weight" in t:  # core's q_layernorm / k_layernorm: one (hn) weight per layer, replicated over tp
        fused += [("self_attention.q_layernorm.weight", lambda i, r: t[f"{i}.qn.weight"], None),
                  ("self_attention.k_layernorm.weight", lambda i, r: t[f"{i}.kn.weight"], None)]
    if "0.ln1.bias" in t:
        fused += [("self_attention.linear_qkv.bias", lambda i, r: qkv_rows(t, i, "bias", "2", tp, r), 0),
                  ("self_attention.linear_proj.bias", lambda i, r: t[f"{i}.dense.bias"], None),
                  ("mlp.linear_fc1.weight", lambda i, r: t[f"{i}.fc1.weight"].chunk(tp)[r], 0),
                  ("mlp.linear_fc1.bias", lambda i, r: t[f"{i}.fc1.bias"].chunk(tp)[r], 0),
                  ("mlp.linear_fc2.bias", lambda i, r: t[f"{i}.fc2.bias"], None)]
    for name, fn, dim in fused:
        sd[f"decoder.layers.{name}"] = _stacked(fn, t.layers, tp, pp, dim)
    if "0.gate.weight" in t:  # core's swiglu factory: rank r's gate rows at r f / tp, its up rows at f + r f / tp
        gate = _stacked(lambda i, r: t[f"{i}.gate.weight"].chunk(tp)[r], t.layers, tp, pp, 0)
        up = _stacked(lambda i, r: t[f"{i}.up.weight"].chunk(tp)[r], t.layers, tp, pp, 0)
        sd["decoder.layers.mlp.linear_fc1.weight"] = _Chunked(
            gate.chunks + [((off[0], f + off[1], 0), x) for off, x in up.chunks])
    sd.update({f"decoder.final_layernorm.{k}": t[f"final.{k}"] for k in ("weight", "bias") if f"final.{k}" in t})
    if "head" in t:
        sd["output_layer.weight"] = _Chunked([((r * x.size(0), 0), x) for r, x in enumerate(
            torch.cat([t["head"], t["head"].new_zeros(padded(t.vocab, tp) - t.vocab, t.hidden)]).chunk(tp))])
    sd["optimizer.state.exp_avg.decoder.final_layernorm.weight"] = torch.zeros(t.hidden)
    sd["decoder.layers.self_attention.linear_qkv._extra_state/shard_0_1"] = [io.BytesIO(b"te fp8 metadata")]
    folder = os.path.join(root, f"iter_{iteration:07d}")
    with megatron_classes() as (model_type, _):
        args = _namespace(t, tp, pp, 3.0, dict(openai_gelu=False, bias_gelu_fusion=True), iteration)
        args.model_type = model_type.encoder_or_decoder
        common = dict(args=args, checkpoint_version=3.0, iteration=iteration, **(common_extra or {}))
        sd["common_state/shard_0_1"] = [common]  # torch.save'd by DCP's planner as core's planner stores it
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... a single process"
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(folder), planner=_planner(), no_dist=True)
    with open(os.path.join(folder, "metadata.json"), "w") as fh:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}, fh)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))


def trained_gpt2(prefix: str, steps: int = 150) -> torch.nn.Module:
    """A GPT2LMHeadModel (vocabulary 512, 2 layers) trained briefly on the dataset at `prefix`: attention that
    matters, so a wrong QKV order costs loss (0.6 nats more; about 3 s on one thread)."""
    import transformers
    from megatron.data.indexed_dataset import MMapIndexedDataset
    data = MMapIndexedDataset(prefix)
    tokens = torch.from_numpy(np.concatenate([np.asarray(data[i], dtype=np.int64) for i in range(len(data))]))
    seq = 64  # transformers shifts the labels itself
    n = len(tokens) // seq
    samples = tokens[:n * seq].view(n, seq)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        bos_token_id=0, eos_token_id=0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = samples[torch.randint(0, n, (16,), generator=g)]
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()
