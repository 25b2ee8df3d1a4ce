"""`tools/convert_checkpoint.py import-megatron` / `export-megatron` on checkpoints written in the ancestors' layouts
as each release wrote them (tests/checkpoint/megatron_fixtures.py, from their source; transformers models are the
reference, nothing is downloaded), at tp 2 (and pp 2 where the release had pipeline parallelism). Megatron core's
own torch_dist files, from the releases that install here, are tests/checkpoint/test_megatron_core.py.

- Megatron-LM legacy: 2019's GPT2Model (no arguments, no checkpoint_version: QKV [3, np, hn], its flat state
  dict), release 1.0 (arguments, still no checkpoint_version, 'transformer', erf GELU), checkpoint_version 1.0
  ([np, hn, 3]) and 2.0 (main between 2020-09-29 and 2020-10-26, pp 1), release 2.0 (3.0, 'transformer', old
  names, pp 2), 3.0 with today's names (the fused bias-GELU, interleaved model0/model1 chunks) and a Llama-style
  GPT (rotary, RMSNorm, SwiGLU, grouped-query attention, untied head);
- Megatron core 0.19's torch_dist (the common state as a `common_state` item holding a list; no PyPI wheel), also
  of a Llama-style GPT with --qk-layernorm (core's q_layernorm / k_layernorm) against Qwen3;
- DeepSpeed pipeline files: Megatron-DeepSpeed GPTModelPipe, DeepSpeedExamples v1.1.5 / CPM-Pretrain
  GPT2ModelPipe (no arguments, no checkpoint_version), Megatron-DeepSpeed without a pipeline.

Each import's plain model gives the reference's logits (fp32, relative error < 1e-5); import -> export-megatron
-> import gives bit-identical tensors and the same model record. The QKV-order report names version 0's order
on a trained model written in it; bad input is one line naming the file.
"""
import os
import shutil

import pytest
import torch

from megatron.checkpointing.consolidated import layout_of, read_weights
from megatron.checkpointing.files import checkpoint_folder, read_args
from megatron.checkpointing.names import ModelTable
from megatron.errors import UserError
from tests.checkpoint import megatron_fixtures as fx
from tools.convert_checkpoint import run

pytest.importorskip("transformers")
RTOL = 1e-5
ERF = dict(openai_gelu=False, bias_gelu_fusion=False)
CASES = {  # name: (reference, writer, import flags, export layout); each as a release (or commit) wrote it
    "megatron_lm_2019": ("gpt2", lambda d, m: fx.write_legacy(d, m, 2, 1, None, style="old",
                                                             container="gpt2model_2019"),
                         ["--num-attention-heads", "4"], (4, 1)),
    "megatron_lm_1.0": ("gpt2_erf", lambda d, m: fx.write_legacy(d, m, 2, 1, None, style="old", container="transformer",
                                                                gelu=ERF), [], (1, 2)),
    "checkpoint_version_1.0": ("gpt2", lambda d, m: fx.write_legacy(d, m, 2, 1, 1.0, style="old",
                                                                   container="transformer"), [], (2, 2)),
    "checkpoint_version_2.0_erf": ("gpt2_erf", lambda d, m: fx.write_legacy(d, m, 2, 1, 2.0, style="old",
                                                                           container="transformer", gelu=ERF), [],
                                   (1, 2)),
    "megatron_lm_2.0": ("gpt2", lambda d, m: fx.write_legacy(d, m, 2, 2, 3.0, style="old", container="transformer"),
                        [], (2, 2)),
    "legacy_v3_fused_gelu": ("gpt2", lambda d, m: fx.write_legacy(d, m, 2, 2, 3.0, gelu=dict(bias_gelu_fusion=True)),
                             [], (2, 2)),
    "legacy_v3_interleaved": ("gpt2", lambda d, m: fx.write_legacy(d, m, 2, 2, 3.0, vpp=2), [], (2, 4)),
    "legacy_v3_llama": ("llama", lambda d, m: fx.write_legacy(d, m, 2, 2, 3.0), [], (2, 1)),
    "torch_dist_core_0.19": ("llama", lambda d, m: fx.write_torch_dist(d, m, 2, 2), [], (2, 2)),
    "megatron_deepspeed": ("gpt2", lambda d, m: fx.write_ds_pipe(d, m, 2, 2, "megatron-deepspeed"), [], (2, 2)),
    "megatron_deepspeed_no_pipe": ("gpt2", lambda d, m: fx.write_ds_pipe(d, m, 2, 1, "no-pipe"), [], (2, 2)),
    "deepspeed_examples_v115": ("gpt2", lambda d, m: fx.write_ds_pipe(d, m, 2, 2, "v1.1.5"),
                                ["--num-attention-heads", "4"], (2, 2)),
}


def _import(src: str, ckpt: str, extra=(), tp: int = 2, pp: int = 2) -> None:
    run(["import-megatron", "--input", src, "--save", ckpt, "--tensor-model-parallel-size", str(tp),
         "--pipe-parallel-size", str(pp), *extra])


def _logits(ckpt: str, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    from megatron.checkpointing import load_model_weights, read_checkpoint_args
    from megatron.checkpointing.names import model_config
    from megatron.model import GPT2Model
    model = GPT2Model(model_config(read_checkpoint_args(ckpt)))
    load_model_weights(model, ckpt)
    with torch.no_grad():
        return model.eval()(ids)[..., :vocab]


def _check_logits(ckpt: str, reference) -> None:
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
    got = _logits(ckpt, ids, reference.config.vocab_size)
    assert float((got - expected).abs().max() / expected.abs().max()) < RTOL


def _weights(ckpt: str):
    folder = checkpoint_folder(ckpt)
    args = read_args(folder)
    return args, read_weights(folder, ModelTable(args), layout_of(args)[0])


def _assert_same(a: str, b: str) -> None:
    (args_a, wa), (args_b, wb) = _weights(a), _weights(b)
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert wa[name].dtype == wb[name].dtype and torch.equal(wa[name], wb[name]), name
    assert args_a["model"] == args_b["model"]


@pytest.mark.parametrize("case", list(CASES))
def test_import_logits_and_export_round_trip(case, tmp_path, capsys):
    kind, write, flags, (tp, pp) = CASES[case]
    src, ckpt, exported, back = (str(tmp_path / n) for n in ("src", "ckpt", "mlm", "back"))
    reference = fx.reference(kind)
    os.makedirs(src)
    write(src, reference)
    _import(src, ckpt, flags)
    out = capsys.readouterr().out
    assert out.startswith("imported ") and "model flags: " in out
    _check_logits(ckpt, reference)
    run(["export-megatron", "--load", ckpt, "--output", exported, "--tensor-model-parallel-size", str(tp),
         "--pipe-parallel-size", str(pp)])
    _import(exported, back)
    _assert_same(ckpt, back)


def test_iteration_gelu_and_vocabulary(tmp_path, capsys):
    """A Megatron-LM run's position (iteration 120, 960 samples) resumes; its erf GELU is the model's (and
    --gelu erf a training flag); --vocab-size keeps the rows beyond as masked padding."""
    src, ckpt = str(tmp_path / "src"), str(tmp_path / "ckpt")
    os.makedirs(src)
    reference = fx.reference("gpt2_erf")
    fx.write_legacy(src, reference, 2, 2, 3.0, gelu=ERF)
    _import(src, ckpt, ["--vocab-size", "90"])
    out = capsys.readouterr().out
    assert "vocabulary: 90 ids (the source's table has 96 rows" in out
    ids = torch.randint(0, 90, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits[..., :90]
    assert float((_logits(ckpt, ids, 90) - expected).abs().max() / expected.abs().max()) < RTOL
    from megatron.checkpointing.names import model_config
    from harness.synthetic import resolved_args
    assert model_config(resolved_args("gpt2", (1, 1, 1), 96, extra=["--gelu", "erf"])).gelu == "erf"
    assert "GELU: erf" in out and "--gelu erf" in out
    assert "--load resumes at iteration 120, 960 consumed samples" in out and "optimizer state" in out
    from megatron.checkpointing.reading import load_file
    engine = load_file(os.path.join(ckpt, "iter_0000120", "mp_rank_00_model_states.pt"))
    position = (engine["iteration"], engine["consumed_train_samples"], engine["lr_scheduler"]["num_steps"])
    assert position == (120, 960, 120)
    assert read_args(checkpoint_folder(ckpt))["checkpoint_content"] == "no_optimizer"


def test_qkv_order_report_names_version_0(data_prefix, tmp_path, capsys):
    """DeepSpeedExamples v1.1.5 files (no checkpoint_version) whose QKV rows are in version 0's order: the loss under
    each order on the golden corpus names order 0, which the import then uses; --qkv-order forces another."""
    model = fx.trained_gpt2(data_prefix)
    src = str(tmp_path / "src")
    os.makedirs(src)
    fx.write_ds_pipe(src, model, 2, 2, "v1.1.5", order="0")
    _import(src, str(tmp_path / "ckpt"), ["--num-attention-heads", "4", "--data-path", data_prefix])
    out = capsys.readouterr().out
    assert "plausible: 0" in out and "QKV rows: order 0" in out, out
    _check_logits(str(tmp_path / "ckpt"), model)
    _import(src, str(tmp_path / "forced"), ["--num-attention-heads", "4", "--qkv-order", "2"])
    assert "QKV rows: order 2 ([np, 3, hn] / grouped, checkpoint_version 2.0 and 3.0): --qkv-order" in \
        capsys.readouterr().out
    with pytest.raises(AssertionError):
        _check_logits(str(tmp_path / "forced"), model)


def _one_line_error(argv, *needles) -> str:
    with pytest.raises(UserError) as err:
        run(argv)
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in needles), message
    return message


def _legacy(root: str, tp: int = 2, pp: int = 2) -> str:
    os.makedirs(root)
    fx.write_legacy(root, fx.reference("gpt2"), tp, pp, 3.0)
    return root


def test_bad_input_is_one_line(tmp_path):
    argv = ["import-megatron", "--save", str(tmp_path / "out"), "--tensor-model-parallel-size", "1",
            "--pipe-parallel-size", "1", "--input"]
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "notes.txt").write_text("hello")
    _one_line_error(argv + [str(unknown)], str(unknown), "no checkpoint format import-megatron knows")

    mixed = _legacy(str(tmp_path / "mixed"))  # tp 2 files plus the tp ranks 2, 3 of a tp 4 run
    other = _legacy(str(tmp_path / "tp4"), tp=4)
    for name in ("mp_rank_02_000", "mp_rank_03_000", "mp_rank_02_001", "mp_rank_03_001"):
        shutil.copytree(os.path.join(other, "iter_0000120", name), os.path.join(mixed, "iter_0000120", name))
    _one_line_error(argv + [mixed], "mp_rank_00_000/model_optim_rng.pt records (tp, pp) = (2, 2)",
                    "4 tp x 2 pp ranks")

    missing = _legacy(str(tmp_path / "missing"))
    shutil.rmtree(os.path.join(missing, "iter_0000120", "mp_rank_01_001"))
    _one_line_error(argv + [missing], os.path.join(missing, "iter_0000120", "mp_rank_01_001", "model_optim_rng.pt"),
                    "is missing")

    pipe = str(tmp_path / "pipe")
    os.makedirs(pipe)
    fx.write_ds_pipe(pipe, fx.reference("gpt2"), 2, 2, "v1.1.5")
    os.remove(os.path.join(pipe, "global_step40", "layer_03-model_01-model_states.pt"))
    _one_line_error(argv + [pipe, "--num-attention-heads", "4"], "layer_03-model_01-model_states.pt is missing")

    no_args = str(tmp_path / "no_args")
    os.makedirs(no_args)
    fx.write_ds_pipe(no_args, fx.reference("gpt2"), 2, 2, "v1.1.5")
    _one_line_error(argv + [no_args], "records no arguments", "--num-attention-heads")

    mlm_2019 = str(tmp_path / "mlm_2019")
    os.makedirs(mlm_2019)
    fx.write_legacy(mlm_2019, fx.reference("gpt2"), 1, 1, None, style="old", container="gpt2model_2019")
    _one_line_error(argv + [mlm_2019], "iter_0000120 records no arguments (2019's Megatron-LM",
                    "--num-attention-heads")


def test_unsupported_options_and_export_layouts_are_one_line(tmp_path):
    src = str(tmp_path / "moe")
    os.makedirs(src)
    fx.write_legacy(src, fx.reference("gpt2"), 1, 1, 3.0, extra_args=dict(num_experts=8, qk_l2_norm=True))
    _one_line_error(["import-megatron", "--input", src, "--save", str(tmp_path / "out"),
                     "--tensor-model-parallel-size", "1", "--pipe-parallel-size", "1"],
                    "mixture of experts (num_experts = 8); L2-normalised queries and keys", "does not implement")
    ckpt = str(tmp_path / "ckpt")
    _import(_legacy(str(tmp_path / "v3")), ckpt)
    _one_line_error(["export-megatron", "--load", ckpt, "--output", str(tmp_path / "mlm"),
                     "--tensor-model-parallel-size", "1", "--pipe-parallel-size", "3"],
                    "--pipe-parallel-size 3 does not divide the 4 layers")


def test_qk_layernorm_imports_as_qwen3s_layer(tmp_path):
    """Megatron core 0.19's torch_dist of a Llama-style GPT with --qk-layernorm (q_layernorm / k_layernorm, per head,
    replicated over tp) at (tp, pp) = (2, 2): imported as --qk-layernorm, its logits equal Qwen3's (the reference).
    Megatron-LM's legacy model has no such norms: export-megatron --ckpt-format torch refuses it in one line (core's
    own files, both ways: tests/checkpoint/test_megatron_core.py)."""
    from megatron.checkpointing import read_checkpoint_args
    src, ckpt = str(tmp_path / "src"), str(tmp_path / "ckpt")
    reference = fx.reference("qwen3")
    os.makedirs(src)
    fx.write_torch_dist(src, reference, 2, 2)
    _import(src, ckpt)
    assert read_checkpoint_args(ckpt)["qk_layernorm"]
    _check_logits(ckpt, reference)
    _one_line_error(["export-megatron", "--load", ckpt, "--output", str(tmp_path / "mlm"),
                     "--tensor-model-parallel-size", "1", "--pipe-parallel-size", "1"],
                    "holds a GPT with --qk-layernorm", "with --ckpt-format torch_dist")


def test_t5_is_refused_with_the_reason(tmp_path):
    """CPM-Pretrain's T5ModelPipe and Megatron-LM's T5 use learned absolute positions this project's T5 lacks; a
    Megatron core model in the legacy file layout (--ckpt-format torch: core's `decoder.layers`) is not a T5 and is
    named for what it is, with the conversion to torch_dist."""
    argv = ["import-megatron", "--save", str(tmp_path / "out"), "--tensor-model-parallel-size", "1",
            "--pipe-parallel-size", "1", "--input"]
    fx.write_cpm_t5_layer(str(tmp_path / "cpm"))
    _one_line_error(argv + [str(tmp_path / "cpm")], "layer_03-model_00-model_states.pt is a T5 decoder layer",
                    "learned absolute position table", "relative position bias")
    fx.write_legacy_t5(str(tmp_path / "mlm"))
    _one_line_error(argv + [str(tmp_path / "mlm")], "mp_rank_00/model_optim_rng.pt holds 'decoder.",
                    "learned absolute position table", "relative position bias")
    fx.write_core_torch_format(str(tmp_path / "core"))  # core's decoder.layers are a GPT's, not a T5 decoder
    _one_line_error(argv + [str(tmp_path / "core")], "model_optim_rng.pt holds 'decoder.layers.0.",
                    "a Megatron core model saved with --ckpt-format torch", "--ckpt-convert-format torch_dist")
