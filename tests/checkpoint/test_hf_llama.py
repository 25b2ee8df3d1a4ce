"""Hugging Face's Llama family through `tools/convert_checkpoint.py import-hf` / `export-hf` (nothing downloaded:
small random models built with transformers and saved with `save_pretrained`).

- Llama with grouped-query attention (2 groups of 8 heads, and one group per head), head_dim 16 != hidden /
  heads, llama3 rope scaling, untied head; Mistral (no sliding window); Qwen2 (qkv biases, tied head), saved
  in shards with an index: import at (tp, pp) = (2, 2), then export, gives every HF tensor bit-identical, and
  transformers loads the exported folder; the imported model's logits equal transformers' (fp32, relative error
  < 1e-5) built at tp = 1 and at tp = 2.
- What the layer does not implement is refused in one line naming the field: a sliding window shorter than the
  positions, another rope type, attention biases in a Llama, partial rotary, missing sizes; and what the exported
  architectures do not have is refused by export-hf (OLMo-2's norm options one at a time); a model with the
  per-head query / key norms exports as Qwen3 (tests/checkpoint/test_hf_qwen3_olmo2.py).
"""
import json
import os

import pytest
import torch

from megatron.errors import UserError
from harness.dist import run_distributed
from tools.convert_checkpoint import run

transformers = pytest.importorskip("transformers")
RTOL = 1e-5
COMMON = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              max_position_embeddings=64, initializer_range=0.5)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
MODELS = {
    "llama_gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, rope_scaling=LLAMA3)),
    "llama_mha": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_key_value_heads=8)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **COMMON, num_key_value_heads=4, sliding_window=None)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=True)),
}


def _save(kind: str, out: str, shards: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    model.save_pretrained(out, max_shard_size="100KB" if shards else "5GB")
    return model


def _import(hf_dir: str, ckpt: str, tp: int = 2, pp: int = 2) -> None:
    run(["import-hf", "--input", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", str(tp),
         "--pipe-parallel-size", str(pp)])


def _hf_tensors(folder: str) -> dict:
    from megatron.checkpointing.hf import load_hf_state
    return load_hf_state(folder)


def _logits_at_tp(ckpt: str, tp: int, ids: torch.Tensor) -> torch.Tensor:
    """The imported checkpoint's plain model built at `tp`, its logits gathered over the vocabulary."""
    from megatron import mpu
    from megatron.checkpointing import load_model_weights, read_checkpoint_args
    from megatron.checkpointing.names import model_config
    from megatron.model import GPTModel
    mpu.initialize_model_parallel(tp, 1)
    try:
        model = GPTModel(model_config(read_checkpoint_args(ckpt)))
        load_model_weights(model, ckpt)
        with torch.no_grad():
            logits = model.eval()(ids)
        return mpu.gather_from_tensor_model_parallel_region(logits) if tp > 1 else logits
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.parametrize("kind", list(MODELS))
def test_import_export_round_trip_and_logits(kind, tmp_path, capsys):
    hf_dir, ckpt, out = (str(tmp_path / n) for n in ("hf", "ckpt", "out"))
    hf = _save(kind, hf_dir, shards=kind == "qwen2")
    if kind == "qwen2":
        assert os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json"))
    _import(hf_dir, ckpt)
    assert "imported gpt" in capsys.readouterr().out
    run(["export-hf", "--load", ckpt, "--output", out])
    theirs, ours = _hf_tensors(hf_dir), _hf_tensors(out)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), f"{kind}: {name} changed in the round trip"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        assert torch.equal(reloaded(ids).logits, want)
    for tp in (1, 2):
        got = run_distributed(_logits_at_tp, tp, ckpt, tp, ids)[0][..., :COMMON["vocab_size"]]
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < RTOL, f"{kind} at tp {tp}: logits relative error {err:.2e}"


@pytest.mark.parametrize("change, words", [
    (dict(sliding_window=32), "sliding_window = 32 is shorter than max_position_embeddings 64"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "rope type 'yarn' (supported: default, llama3)"),
    (dict(attention_bias=True), "attention_bias = true (supported: false)"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor != 1"),
    (dict(hidden_size=None), "no positive integer hidden_size"),
])
def test_unsupported_options_are_one_line(change, words, tmp_path):
    hf_dir = str(tmp_path / "hf")
    _save("llama_mha", hf_dir)
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(change)
    if "rope_scaling" in change:
        config.pop("rope_parameters", None)
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _import(hf_dir, str(tmp_path / "ckpt"), 1, 1)
    assert not os.path.exists(tmp_path / "ckpt")


def test_training_continues_from_imported_llama(tmp_path, data_prefix):
    """A Llama folder with the test BPE tokenizer, imported at (2, 2), trained through pretrain_gpt2.py with
    --pretrained-checkpoint: the first loss is transformers' loss on that batch; a second launch with the same
    command resumes from the run's own checkpoint, not from the import."""
    import shutil
    from tests.checkpoint.common import argv, train
    from tests.checkpoint.test_hf import hf_first_loss
    from tests.training.golden_cases import DATA, LLAMA
    hf_dir, ckpt, save = (str(tmp_path / n) for n in ("hf", "imported", "run"))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)).save_pretrained(hf_dir)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(os.path.join(DATA, name), hf_dir)
    _import(hf_dir, ckpt)
    from megatron.checkpointing import read_checkpoint_args
    from megatron.checkpointing.flags import model_flags
    flags = model_flags(read_checkpoint_args(ckpt))  # what import-hf prints
    assert set(LLAMA) - {"2"} <= set(flags) and "--norm-epsilon" in flags
    extra = [*flags, "--pretrained-checkpoint", ckpt, "--save", save, "--load", save, "--save-interval", "2"]
    losses = train("llama", data_prefix, (2, 2, 1), 2, extra)
    assert len(losses) == 2  # started at iteration 0, from the imported weights
    reference = run_distributed(hf_first_loss, 1, hf_dir, argv("llama", data_prefix, 1, 1, 2, extra[:-6]))[0]
    assert abs(losses[0] - reference) <= RTOL * abs(reference), f"first loss {losses[0]} vs transformers {reference}"
    again = train("llama", data_prefix, (2, 2, 1), 3, extra)
    assert len(again) == 1  # resumed at iteration 2 from --load, the import left alone


def test_a_different_rotary_base_is_refused_unless_finetuning(tmp_path):
    """Weights of the same shapes do not make the same model: a weights-only load into a model with another
    rotary base (or norm epsilon) is one line naming the field; --finetune (function=False) allows it."""
    import dataclasses
    from megatron.checkpointing.files import CheckpointMismatchError
    from megatron.checkpointing.names import model_config
    from megatron.checkpointing.weights import load_weights_into
    from megatron.model import GPTModel
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    _save("llama_gqa", hf_dir)
    _import(hf_dir, ckpt, 1, 1)
    folder = os.path.join(ckpt, "iter_0000000")
    from megatron.checkpointing.files import read_args
    saved = read_args(folder)
    other = GPTModel(dataclasses.replace(model_config(saved), rotary_base=5e5))
    with pytest.raises(CheckpointMismatchError, match="has rotary_base = 10000.0 but the model has 500000.0"):
        load_weights_into(other, folder, saved)
    load_weights_into(other, folder, saved, function=False)


def test_hub_tokenizer_json_imports_exports_and_generates_as_transformers(tmp_path):
    """A Llama folder as the hub ships it: weights, config.json, tokenizer.json with a BOS-adding post-processor and
    tokenizer_config.json naming eos and bos. import-hf takes the tokenizer as HuggingFaceTokenizer; greedy
    `tools/generate.py` text equals transformers' generate from the exported folder, whose AutoTokenizer encodes as
    the imported one does."""
    import shutil
    import subprocess
    import sys
    from megatron.checkpointing import read_checkpoint_args
    from megatron.tokenizer import build_tokenizer
    from harness.corpus import make_llama_like
    from tests.inference.common import ROOT
    tok_dir = make_llama_like(str(tmp_path))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_dir)
    hf_dir, ckpt, out = (str(tmp_path / n) for n in ("hf", "ckpt", "out"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=1.0,
        bos_token_id=tokenizer.bos, eos_token_id=tokenizer.eos)).eval()
    model.save_pretrained(hf_dir)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), hf_dir)
    _import(hf_dir, ckpt, 2, 1)
    assert read_checkpoint_args(ckpt)["tokenizer_type"] == "HuggingFaceTokenizer"
    run(["export-hf", "--load", ckpt, "--output", out])
    prompt = "the model data parallel"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == tokenizer.tokenize(prompt) and ids[0, 0] == tokenizer.bos
    result = subprocess.run([sys.executable, "tools/generate.py", "--load", ckpt, "--prompt", prompt,
                             "--max-new-tokens", "10", "--output", str(tmp_path / "gen.jsonl")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "gen.jsonl") as f:
        ours = json.loads(f.readline())["completion"]
    with torch.no_grad():
        new = transformers.AutoModelForCausalLM.from_pretrained(out).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
            eos_token_id=tokenizer.eos, pad_token_id=tokenizer.eos)[0, ids.size(1):].tolist()
    new = new[:new.index(tokenizer.eos)] if tokenizer.eos in new else new
    assert len(set(new)) > 2, "greedy text should not be degenerate"
    assert ours == hf_tok.decode(new), f"ours {ours!r} vs transformers {hf_tok.decode(new)!r}"


def _norm_option_config(**switches):
    from megatron.model.config import GPTConfig
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                     position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                     tie_word_embeddings=False, **switches)


@pytest.mark.parametrize("switch", ["qk_layernorm_full", "post_sublayer_norm"])
def test_export_refuses_layer_options_the_architectures_lack(switch):
    """OLMo-2's two options alone: no architecture has one without the other."""
    from megatron.checkpointing.hf import ADAPTERS, exporter
    config = _norm_option_config(**{switch: True})
    field = f"{switch} = True (reads back as False)"
    with pytest.raises(UserError, match=r"export-hf: no Hugging Face architecture holds this gpt model \(GPT2LMHeadModel"):
        exporter(dict(model_type="gpt"), config)
    for kind in ("gpt2", "llama", "qwen2", "qwen3"):
        assert field in ADAPTERS[kind].cannot_hold(config), kind
    other = ({"qk_layernorm_full", "post_sublayer_norm"} - {switch}).pop()
    assert f"{other} = False (reads back as True)" in ADAPTERS["olmo2"].cannot_hold(config)


def test_export_picks_qwen3_for_the_query_key_norms():
    """A GPT trained here with the Llama layer and --qk-layernorm is a Qwen3 (not held by Llama or Qwen2)."""
    from megatron.checkpointing.hf import ADAPTERS, exporter
    config = _norm_option_config(qk_layernorm=True)
    assert exporter(dict(model_type="gpt"), config).architecture == "Qwen3ForCausalLM"
    for kind in ("llama", "qwen2"):
        assert "qk_layernorm = True (reads back as False)" in ADAPTERS[kind].cannot_hold(config), kind
