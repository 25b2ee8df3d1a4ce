"""Hugging Face's Qwen3 and OLMo-2 (megatron/checkpointing/hf/qwen3.py, olmo2.py) through `tools/convert_checkpoint.py import-hf` /
`export-hf`, as tests/checkpoint/test_hf_llama.py does for the Llama family (nothing downloaded: small random
models built with transformers and saved with `save_pretrained`, their norm weights drawn at random so that a
swapped or misplaced norm shows).

- One model per family, built once (module fixture) with the Llama-3-like test tokenizer: Qwen3 with 2 groups of
  4 heads, head_dim 16 != hidden / heads, untied head; OLMo-2 with 2 groups of 4 heads (its q_norm over 8 x 8
  channels, k_norm over 2 x 8, split over tp with the heads), untied head. Import at (tp, pp) = (2, 2), then export, gives every HF
  tensor bit-identical and transformers loads the exported folder as the same architecture; the imported model's
  logits equal transformers' (fp32, relative error < 1e-5) built at tp = 2 and tp = 1 (one launch of 2 ranks for
  every family); greedy `tools/generate.py` text (its main, in this process) equals transformers' generate from
  the exported folder.
- A tied Qwen3 (no lm_head) round-trips bit-identical too, and export-hf --verify compares its logits.
- What the layer does not implement is one line naming the field (a sliding window shorter than the positions,
  attention biases); an OLMo-2 layer exported from a checkpoint trained here (not imported) is an Olmo2ForCausalLM.
"""
import json
import os
import shutil

import pytest
import torch

from megatron.errors import UserError
from harness.dist import run_distributed
from tests.checkpoint.test_hf_llama import _logits_at_tp
from tools.convert_checkpoint import run

transformers = pytest.importorskip("transformers")
RTOL = 1e-5
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
             max_position_embeddings=64, initializer_range=0.5)
CONFIGS = {"qwen3": lambda **kw: transformers.Qwen3Config(**SHAPE, head_dim=16, **kw),
           "olmo2": lambda **kw: transformers.Olmo2Config(**SHAPE, **kw)}
CLASSES = {"qwen3": lambda: transformers.Qwen3ForCausalLM, "olmo2": lambda: transformers.Olmo2ForCausalLM}
PROMPT = "the model data parallel"


def _build(kind: str, out: str, **config) -> torch.nn.Module:
    """A random `kind` model saved to `out`, its norms' weights drawn from U(0.5, 1.5) (transformers makes them 1)."""
    torch.manual_seed(0)
    model = CLASSES[kind]()(CONFIGS[kind](**config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return model


def _import(hf_dir: str, ckpt: str, tp: int = 2, pp: int = 2) -> None:
    run(["import-hf", "--input", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", str(tp),
         "--pipe-parallel-size", str(pp)])


def _assert_round_trip(hf_dir: str, out: str, kind: str) -> None:
    from megatron.checkpointing.hf import load_hf_state
    theirs, ours = load_hf_state(hf_dir), load_hf_state(out)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), f"{kind}: {name} changed in the round trip"


def _family(kind: str, root) -> dict:
    """A `kind` folder with the Llama-3-like tokenizer, imported at (2, 2) and exported again."""
    from megatron.tokenizer import build_tokenizer
    from harness.corpus import make_llama_like
    tok_dir = make_llama_like(str(root))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_dir)
    hf_dir, ckpt, out = (str(root / n) for n in ("hf", "ckpt", "out"))
    model = _build(kind, hf_dir, vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos,
                   eos_token_id=tokenizer.eos)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), hf_dir)
    _import(hf_dir, ckpt)
    run(["export-hf", "--load", ckpt, "--output", out])
    return dict(kind=kind, hf=model, hf_dir=hf_dir, ckpt=ckpt, out=out, tokenizer=tokenizer, root=root)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    """{kind: its model, folders and tokenizer}, built once for every check of this file."""
    return {kind: _family(kind, tmp_path_factory.mktemp(kind)) for kind in CONFIGS}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_import_export_round_trip(kind, families):
    family = families[kind]
    _assert_round_trip(family["hf_dir"], family["out"], family["kind"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(family["out"])
    assert type(reloaded) is type(family["hf"])


def _logits_at_tp2_and_tp1(ckpts: list, ids: torch.Tensor) -> list:
    return [(_logits_at_tp(ckpt, 2, ids), _logits_at_tp(ckpt, 1, ids)) for ckpt in ckpts]


def test_logits_equal_transformers_at_tp1_and_tp2(families):
    """Every family's imported model at tp 2 and tp 1, in one launch of 2 ranks."""
    kinds = list(families)
    vocab = families[kinds[0]]["tokenizer"].vocab_size
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    got = run_distributed(_logits_at_tp2_and_tp1, 2, [families[k]["ckpt"] for k in kinds], ids)[0]
    for kind, logits in zip(kinds, got):
        with torch.no_grad():
            want = families[kind]["hf"](ids).logits
        for tp, ours in zip((2, 1), logits):
            err = ((ours[..., :vocab] - want).abs().max() / want.abs().max()).item()
            assert err < RTOL, f"{kind} at tp {tp}: logits relative error {err:.2e}"


def assert_greedy_equals_transformers(ckpt: str, out: str, tokenizer, gen: str, kind: str) -> None:
    """tools/generate.py's main, in this process (one process: no process group), on the checkpoint `ckpt`: its
    greedy text equals transformers' `generate` from `out`, the checkpoint's export."""
    from tools.generate import main
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = hf_tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == tokenizer.tokenize(PROMPT)
    main(["--load", ckpt, "--prompt", PROMPT, "--max-new-tokens", "10", "--output", gen])
    with open(gen) as f:
        ours = json.loads(f.readline())["completion"]
    with torch.no_grad():
        new = transformers.AutoModelForCausalLM.from_pretrained(out).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
            eos_token_id=tokenizer.eos, pad_token_id=tokenizer.eos)[0, ids.size(1):].tolist()
    new = new[:new.index(tokenizer.eos)] if tokenizer.eos in new else new
    assert len(set(new)) > 2, "greedy text should not be degenerate"
    assert ours == hf_tok.decode(new), f"{kind}: ours {ours!r} vs transformers {hf_tok.decode(new)!r}"


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_generation_equals_transformers(kind, families):
    family = families[kind]
    assert_greedy_equals_transformers(family["ckpt"], family["out"], family["tokenizer"],
                                      str(family["root"] / "gen.jsonl"), kind)


def test_tied_qwen3_round_trips_and_verifies(tmp_path, capsys):
    hf_dir, ckpt, out = (str(tmp_path / n) for n in ("hf", "ckpt", "out"))
    _build("qwen3", hf_dir, vocab_size=100, tie_word_embeddings=True)
    _import(hf_dir, ckpt)
    run(["export-hf", "--load", ckpt, "--output", out, "--verify"])
    difference = float(capsys.readouterr().out.split("logits max relative difference ")[1].split()[0])
    assert difference < RTOL
    _assert_round_trip(hf_dir, out, "tied qwen3")
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] and config["architectures"] == ["Qwen3ForCausalLM"]


@pytest.mark.parametrize("kind, change, words", [
    ("qwen3", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1, layer_types=None),
     "sliding_window = 32 is shorter than max_position_embeddings 64"),
    ("qwen3", dict(attention_bias=True), "attention_bias = true (supported: false)"),
    ("olmo2", dict(attention_bias=True), "attention_bias = true (supported: false)"),
    ("olmo2", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0)),
     "rope type 'yarn' (supported: default, llama3)"),
])
def test_unsupported_options_are_one_line(kind, change, words, tmp_path):
    hf_dir = str(tmp_path / "hf")
    _build(kind, hf_dir, vocab_size=100)
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(change)
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _import(hf_dir, str(tmp_path / "ckpt"), 1, 1)
    assert not os.path.exists(tmp_path / "ckpt")


def test_export_picks_olmo2_for_its_layer():
    """A GPT trained here with the Llama layer, --qk-layernorm-full and --post-sublayer-norm is an OLMo-2."""
    from megatron.checkpointing.hf import ADAPTERS, exporter
    from megatron.model.config import GPTConfig
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                       position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                       tie_word_embeddings=False, qk_layernorm_full=True, post_sublayer_norm=True)
    assert exporter(dict(model_type="gpt"), config).architecture == "Olmo2ForCausalLM"
    assert "qk_layernorm_full = True (reads back as False)" in ADAPTERS["qwen3"].cannot_hold(config)
