"""reshape through the command line, offline (no processes), on checkpoints written by `pretrain()` at (2, 2, 2).

- identity: reshaping to the saved layout rewrites every file bit for bit (layer files, engine files, ZeRO-1
  partitions, megatron_args.json), except the optimizer ranges of the unused copy that DeepSpeed keeps on
  the last stage (GPT-2's position table: `ModelTable.unused_copies`), which a reshape does not carry;
- round trip (2,2,2) -> (1,1,1) -> (4,1,2) -> (1,4,1) -> (2,2,2): bit-identical weights and optimizer state
  (fp32 master weights, Adam moments, steps, hyper-parameters) to the original, GPT-2 and T5, and through
  (2,1,4) for the Llama-style GPT (grouped QKV re-cut over tp); only the RNG states are gone (tp and pp changed
  on the way, see megatron/checkpointing/layouts.py);
- the GPT layer's norm options (Qwen3's per-head query / key norms, replicated over tp; OLMo-2's over all heads,
  split over tp with them, and its norms after the sublayers), on synthetic checkpoints
  (weights as initialised, random optimizer state) written at (2, 2, 2): the Llama chain back to bit-identical
  files, and the same logits from the first and the last;
- vocabulary padding recomputed for each tp: real rows bit-identical, padding rows zero, same logits;
- one-line errors: tp that does not divide the heads or the query groups, pp larger than the pipeline, an existing
  output.
"""
import os

import pytest
import torch

from megatron.checkpointing.consolidated import read_consolidated
from megatron.checkpointing.files import read_args
from megatron.errors import UserError
from tests.checkpoint.common import differences, load_all, mask_unused_copies
from harness.synthetic import TAG, resolved_args, write_synthetic
from tests.training.golden_cases import OLMO2, QWEN3
from tools.convert_checkpoint import run

CHAIN = [(1, 1, 1), (4, 1, 2), (1, 4, 1), (2, 2, 2)]
LLAMA_CHAIN = [(1, 1, 1), (2, 1, 4), (1, 4, 1), (2, 2, 2)]  # its 2 query groups do not split over tp 4
NORM_OPTIONS = {"qwen3": QWEN3, "olmo2": OLMO2}


def reshape(src: str, dst: str, layout, *extra: str) -> str:
    tp, pp, dp = layout
    run(["reshape", "--load", src, "--save", dst, "--tensor-model-parallel-size", str(tp), "--pipe-parallel-size",
         str(pp), "--data-parallel-size", str(dp), *extra])
    return dst


def _tag_folder(d: str) -> str:
    with open(os.path.join(d, "latest")) as f:
        return os.path.join(d, f.read().strip())


def _without_rng(files):
    for content in files.values():
        if isinstance(content, dict):
            content.pop("rng_states", None)
    return files


def test_identity_reshape_is_bit_exact(gpt2_222, tmp_path):
    out = reshape(gpt2_222["dir"], str(tmp_path / "same"), (2, 2, 2))
    original, rewritten = load_all(_tag_folder(gpt2_222["dir"])), load_all(_tag_folder(out))
    args = read_args(_tag_folder(gpt2_222["dir"]))
    mask_unused_copies(original, args)
    mask_unused_copies(rewritten, args)
    assert sorted(original) == sorted(rewritten)
    assert differences(original, rewritten) == []


@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5"])
def test_round_trip_chain_is_bit_identical(kind, request, tmp_path):
    source = request.getfixturevalue(f"{kind}_222")["dir"]
    current = source
    for i, layout in enumerate(LLAMA_CHAIN if kind == "llama" else CHAIN):
        current = reshape(current, str(tmp_path / f"step{i}"), layout)
        assert read_args(_tag_folder(current))["tensor_model_parallel_size"] == layout[0]
    original, back = load_all(_tag_folder(source)), load_all(_tag_folder(current))
    args = read_args(_tag_folder(source))
    mask_unused_copies(original, args)
    mask_unused_copies(back, args)
    assert sorted(original) == sorted(back)
    assert differences(_without_rng(original), back) == []


@pytest.mark.parametrize("name", NORM_OPTIONS)
def test_norm_options_round_trip_is_bit_identical(name, tmp_path):
    args = resolved_args("gpt2", (2, 2, 2), 500, extra=NORM_OPTIONS[name])
    written = write_synthetic(str(tmp_path / "written"), args)
    source = current = reshape(written, str(tmp_path / "source"), (2, 2, 2))  # as a reshape writes it
    for i, layout in enumerate(LLAMA_CHAIN):
        current = reshape(current, str(tmp_path / f"step{i}"), layout)
    original, back = load_all(_tag_folder(source)), load_all(_tag_folder(current))
    assert sorted(original) == sorted(back)
    assert differences(_without_rng(original), back) == []
    torch.testing.assert_close(_logits(current), _logits(source), rtol=0, atol=0)


def _logits(load_dir: str) -> torch.Tensor:
    from megatron.checkpointing import load_model_weights, read_checkpoint_args
    from megatron.checkpointing.names import model_config
    from megatron.model import GPT2Model
    saved = read_checkpoint_args(load_dir)
    model = GPT2Model(model_config(saved))  # tp = 1: pads the vocabulary for tp 1
    load_model_weights(model, load_dir)
    ids = torch.randint(0, saved["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(ids)[..., :saved["vocab_size"]]


def test_vocabulary_padding_follows_tp(tmp_path):
    """Vocabulary 520, divisor 8: padded 528 at tp 2, 544 at tp 4, 520 at tp 1."""
    src = write_synthetic(str(tmp_path / "tp2"), resolved_args("gpt2", (2, 1, 1), vocab_size=520))
    original = read_consolidated(_tag_folder(src))
    reference = _logits(src)
    current = src
    for layout, padded in (((4, 1, 1), 544), ((1, 1, 1), 520), ((2, 1, 1), 528)):
        current = reshape(current, str(tmp_path / f"tp{layout[0]}_{padded}"), layout)
        ck = read_consolidated(_tag_folder(current))
        assert ck.args["padded_vocab_size"] == padded
        table = [ck.weights["embedding.word_embeddings.weight"]] + list(
            ck.optim["embedding.word_embeddings.weight"].values())
        before = [original.weights["embedding.word_embeddings.weight"]] + list(
            original.optim["embedding.word_embeddings.weight"].values())
        for new, old in zip(table, before):
            assert new.shape[0] == padded
            assert torch.equal(new[:520], old[:520]) and not new[520:].any()
        torch.testing.assert_close(_logits(current), reference, rtol=0, atol=0)


def test_layout_errors_are_one_line(gpt2_222, tmp_path):
    src = gpt2_222["dir"]
    with pytest.raises(UserError, match="tensor-model-parallel size 3 does not divide num_attention_heads = 4"):
        reshape(src, str(tmp_path / "a"), (3, 1, 1))
    with pytest.raises(UserError, match="pipe-parallel size 9 is larger than the 5 pipeline layers"):
        reshape(src, str(tmp_path / "b"), (1, 9, 1))
    os.makedirs(tmp_path / "exists")
    with pytest.raises(UserError, match="already exists"):
        reshape(src, str(tmp_path / "exists"), (1, 1, 1))
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
    assert TAG.startswith("iter_")


def test_query_groups_tp_does_not_divide_is_one_line(llama_222, tmp_path):
    with pytest.raises(UserError, match="tensor-model-parallel size 4 does not divide num_query_groups = 2"):
        reshape(llama_222["dir"], str(tmp_path / "a"), (4, 1, 1))
    assert not os.path.exists(tmp_path / "a")


def test_no_optimizer_keeps_weights_and_engine_state(gpt2_222, tmp_path):
    full = reshape(gpt2_222["dir"], str(tmp_path / "full"), (1, 2, 2))
    lean = reshape(gpt2_222["dir"], str(tmp_path / "lean"), (1, 2, 2), "--no-optimizer")
    files, lean_files = load_all(_tag_folder(full)), load_all(_tag_folder(lean))
    assert sorted(lean_files) == sorted(n for n in files if "zero_pp_rank" not in n)
    assert lean_files["megatron_args.json"]["checkpoint_content"] == "no_optimizer"
    for name, content in lean_files.items():
        if name.startswith("layer_"):
            assert differences(content, files[name]) == []
        elif name.startswith("mp_rank_"):
            assert content["optimizer"] is None and content["param_shapes"] is None
            assert (content["iteration"], content["lr_scheduler"]) == (files[name]["iteration"],
                                                                      files[name]["lr_scheduler"])
