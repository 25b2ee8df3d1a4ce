"""Hugging Face's mixtures of experts (megatron/checkpointing/hf/moe.py: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)
through `tools/convert_checkpoint.py import-hf` / `export-hf`, on small random models built with transformers (nothing
downloaded; the norms' weights drawn at random so that a misplaced one shows; the Llama-3-like test tokenizer in
the folder):

- Mixtral (4 experts, top-2, every layer MoE), Qwen2-MoE (4 experts, top-2, a gated shared expert, its first layer
  dense through mlp_only_layers, a qkv bias, the softmax over all experts), Qwen3-MoE (per-head query / key norms,
  head_dim 16 != hidden / heads, renormalized top-k, its first layer dense through decoder_sparse_step 2) and OLMoE
  (whole-projection query / key norms, the softmax over all experts), saved with `save_pretrained` (per-expert
  tensors), imported at (tp, pp) = (2, 2) and exported: every tensor bit-identical, and transformers loads the
  export as the same class;
- the same models saved in the fused layout newer checkpoints ship (`mlp.experts.gate_up_proj` (E, 2I, H),
  `down_proj` (E, H, I), the router as `mlp.gate`) import to the same weights, and export per expert again;
- the imported models' logits equal transformers' at tp 2 and tp 1 (fp32, relative error < 1e-5; one launch);
- greedy `tools/generate.py` text (its main, in this process) equals transformers' `generate`;
- a router with jitter noise (Mixtral) and OLMoE's clip_qkv are one line each.
"""
import os
import shutil

import pytest
import torch

from harness.dist import run_distributed
from megatron.errors import UserError
from tests.checkpoint.test_hf_llama import _logits_at_tp
from tests.checkpoint.test_hf_qwen3_olmo2 import assert_greedy_equals_transformers
from tools.convert_checkpoint import run

transformers = pytest.importorskip("transformers")
RTOL = 1e-5
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, initializer_range=0.3)
MODELS = {
    "mixtral": lambda **kw: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, **kw, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, **kw, intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=16, mlp_only_layers=[0])),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, **kw, intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        head_dim=16, norm_topk_prob=True, decoder_sparse_step=2)),
    "olmoe": lambda **kw: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **COMMON, **kw, intermediate_size=24, num_experts=4, num_experts_per_tok=2)),
}


def _build(kind: str, root: str, tokenizer, tok_dir: str) -> dict:
    torch.manual_seed(0)
    model = MODELS[kind](vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos,
                         eos_token_id=tokenizer.eos).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    folders = {n: os.path.join(root, n) for n in ("hf", "fused", "ckpt", "fused_ckpt", "out", "fused_out")}
    model.save_pretrained(folders["hf"])
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), folders["hf"])
    os.makedirs(folders["fused"])  # the in-memory names: fused experts, the router as mlp.gate
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(folders["fused"], "model.safetensors"))
    shutil.copy(os.path.join(folders["hf"], "config.json"), folders["fused"])
    for source, ckpt, out in (("hf", "ckpt", "out"), ("fused", "fused_ckpt", "fused_out")):
        run(["import-hf", "--input", folders[source], "--save", folders[ckpt], "--tensor-model-parallel-size", "2",
             "--pipe-parallel-size", "2"])
        run(["export-hf", "--load", folders[ckpt], "--output", folders[out]])
    return dict(model=model, tokenizer=tokenizer, root=root, **folders)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    from harness.corpus import make_llama_like
    from megatron.tokenizer import build_tokenizer
    tok_dir = make_llama_like(str(tmp_path_factory.mktemp("tokenizer")))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_dir)
    return {kind: _build(kind, str(tmp_path_factory.mktemp(kind)), tokenizer, tok_dir) for kind in MODELS}


@pytest.mark.parametrize("kind", list(MODELS))
def test_round_trips_bit_identical_from_either_layout(kind, families):
    from megatron.checkpointing.hf import load_hf_state
    family = families[kind]
    theirs = load_hf_state(family["hf"])
    assert any(".experts.0." in name for name in theirs), "save_pretrained should write per-expert tensors"
    for out in ("out", "fused_out"):
        ours = load_hf_state(family[out])
        assert sorted(ours) == sorted(theirs), out
        for name, tensor in theirs.items():
            assert torch.equal(ours[name], tensor), f"{kind} {out}: {name} changed"
    assert type(transformers.AutoModelForCausalLM.from_pretrained(family["out"])) is type(family["model"])
    from megatron.checkpointing import read_checkpoint_args
    from megatron.checkpointing.flags import model_flags
    saved = read_checkpoint_args(family["ckpt"])
    flags = model_flags(saved)  # what import-hf prints: a switch that is off is left out, never `False`
    assert "False" not in flags and "True" not in flags, flags
    assert ("--moe-router-pre-softmax" in flags) == bool(saved.get("moe_router_pre_softmax")), flags


def _logits(ckpts: list, ids: torch.Tensor) -> list:
    return [(_logits_at_tp(ckpt, 2, ids), _logits_at_tp(ckpt, 1, ids)) for ckpt in ckpts]


def test_logits_equal_transformers_at_tp2_and_tp1(families):
    kinds = list(families)
    vocab = families[kinds[0]]["tokenizer"].vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    got = run_distributed(_logits, 2, [families[k]["ckpt"] for k in kinds], ids)[0]
    for kind, logits in zip(kinds, got):
        with torch.no_grad():
            want = families[kind]["model"](ids).logits
        for tp, ours in zip((2, 1), logits):
            err = ((ours[..., :vocab] - want).abs().max() / want.abs().max()).item()
            assert err < RTOL, f"{kind} at tp {tp}: logits relative error {err:.2e}"


@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_generation_equals_transformers(kind, families):
    family = families[kind]
    assert_greedy_equals_transformers(family["ckpt"], family["out"], family["tokenizer"],
                                      os.path.join(family["root"], "gen.jsonl"), kind)


@pytest.mark.parametrize("kind, change, words", [
    ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise = 0.1 \(supported: 0\)"),
    ("olmoe", {"clip_qkv": 8.0}, r"clip_qkv = 8.0 \(supported: null\)")])
def test_what_the_layer_lacks_is_one_line(families, tmp_path, kind, change, words):
    import json
    hf = str(tmp_path / "hf")
    shutil.copytree(families[kind]["hf"], hf)
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump({**cfg, **change}, f)
    with pytest.raises(UserError, match=words):
        run(["import-hf", "--input", hf, "--save", str(tmp_path / "ckpt"), "--tensor-model-parallel-size", "1",
             "--pipe-parallel-size", "1"])


def test_the_planner_plans_experts(families, capsys):
    """tools/plan_layout.py ranks a Mixtral config.json (megatron/planning/moe.py counts its experts)."""
    from tools.plan_layout import main
    main(["--hf-config", os.path.join(families["mixtral"]["hf"], "config.json"), "--global-batch-size", "64",
          "--seq-length", "64", "--top", "3"])
    out = capsys.readouterr().out
    assert "layouts fit" in out and " yes " in out, out
