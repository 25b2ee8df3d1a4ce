"""Megatron core itself as the peer of `import-megatron` and `export-megatron --ckpt-format torch_dist`: each
megatron-core release from 0.15 on that installs here (tests/checkpoint/mcore_peer.py: PyPI's wheel in a folder of
its own, run in a subprocess) builds its own GPTModel on the CPU, a GPT-2-style one (LayerNorm, biases, the fused
bias-GELU, learned positions, tied head), a Llama-style one (RMSNorm, SwiGLU, grouped-query attention, rotary,
untied head) and that one with --qk-layernorm (core's q_layernorm / k_layernorm: Qwen3's layer), and writes it
with `dist_checkpointing.save`:

- import-megatron reads it (resharded to tp 2) and the imported model's logits equal core's forward (fp32,
  relative error < 1e-5);
- export-megatron --ckpt-format torch_dist writes it back, core's `dist_checkpointing.load` reads that into a
  fresh GPTModel built from the arguments the export records, and core's logits equal the first ones;
- import-megatron of the export gives the first import's tensors bit for bit;
- a mixture of experts (the Llama-style layer, layer 1 dense, layers 2 and 3 core's MoELayer: 4 SequentialMLP
  SwiGLU experts, top-2, a shared expert, gated from 0.16) imports at tp 1 and tp 2 with equal logits (export-megatron
  refuses MoE in one line);
- in the newest release, a checkpoint written by two gloo processes of core at tensor parallelism 2 imports with
  equal logits (`long`).
"""
import pytest
import torch

from megatron.errors import UserError
from tests.checkpoint.mcore_peer import VERSIONS, Peer, ids_file, save_tp
from tests.checkpoint.mcore_peer_script import VOCAB
from tests.checkpoint.test_megatron_import import _assert_same, _logits
from tools.convert_checkpoint import run

RTOL = 1e-5


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.shape == expected.shape and expected.abs().max() > 0, (got.shape, expected.shape)
    return float((got - expected).abs().max() / expected.abs().max())


def _import(src: str, ckpt: str, tp: int) -> None:
    run(["import-megatron", "--input", src, "--save", ckpt, "--tensor-model-parallel-size", str(tp),
         "--pipe-parallel-size", "1"])


@pytest.mark.parametrize("version", VERSIONS)
def test_core_writes_we_import_we_export_core_reads(version, tmp_path, capsys):
    work = str(tmp_path)
    ids = torch.load(ids_file(work), weights_only=True)
    with Peer(version, work) as peer:
        for kind in ("gpt2", "llama", "qwen3"):
            src, ours, exported, back = (str(tmp_path / f"{kind}_{n}") for n in ("core", "ours", "export", "back"))
            expected = peer.save(kind, src)  # (b, s, v)
            _import(src, ours, tp=2)
            assert "imported Megatron core torch_dist checkpoint (checkpoint_version 3.0, written at tp 1" in \
                capsys.readouterr().out
            assert _rel(_logits(ours, ids, VOCAB), expected) < RTOL, kind
            run(["export-megatron", "--load", ours, "--output", exported, "--tensor-model-parallel-size", "1",
                 "--pipe-parallel-size", "1", "--ckpt-format", "torch_dist"])
            assert "--ckpt-format torch_dist --use-checkpoint-args" in capsys.readouterr().out
            assert _rel(peer.load(exported)[..., :VOCAB], expected) < RTOL, kind
            _import(exported, back, tp=2)
            _assert_same(ours, back)
        expected = peer.save("moe", str(tmp_path / "moe_core"))
        for tp in (1, 2):
            _import(str(tmp_path / "moe_core"), str(tmp_path / f"moe_ours_{tp}"), tp=tp)
            assert "--num-experts 4 --moe-ffn-hidden-size 24 --moe-layer-freq [0,1,1] --moe-router-topk 2" in \
                capsys.readouterr().out
            assert _rel(_logits(str(tmp_path / f"moe_ours_{tp}"), ids, VOCAB), expected) < RTOL, tp
        with pytest.raises(UserError, match="mixture of experts"):
            run(["export-megatron", "--load", str(tmp_path / "moe_ours_1"), "--output", str(tmp_path / "moe_export"),
                 "--tensor-model-parallel-size", "1", "--pipe-parallel-size", "1", "--ckpt-format", "torch_dist"])


@pytest.mark.long
def test_core_at_tensor_parallel_2_imports(tmp_path):
    work = str(tmp_path)
    expected = save_tp(VERSIONS[-1], 2, "llama", str(tmp_path / "core"), work)
    _import(str(tmp_path / "core"), str(tmp_path / "ours"), tp=1)
    ids = torch.load(ids_file(work), weights_only=True)
    assert _rel(_logits(str(tmp_path / "ours"), ids, VOCAB), expected) < RTOL
