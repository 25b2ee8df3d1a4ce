"""The loading contract other tools build on: `read_checkpoint_args` and `load_model_weights` load a (2, 2, 2)
checkpoint into plain GPT2Model / T5Model built at tp 1, 2 and 4.

- at tp = 2 every rank's parameters equal the checkpoint's layer files of its tp rank bit for bit (the files
  DeepSpeed's pipeline engine wrote), with the pipeline's layer index mapped to the plain model's name;
- the logits on random ids agree between tp 1, 2 and 4 (fp32, rel err < 1e-5);
- a model built with another hidden size gets one line naming the field; a missing folder one line too.
"""
import dataclasses
import os

import pytest
import torch

from megatron.checkpointing import CheckpointMismatchError, load_model_weights, read_checkpoint_args
from megatron.checkpointing.names import ModelTable, model_config
from megatron.errors import UserError
from harness.dist import run_distributed

RTOL = 1e-5


def _model(saved):
    from megatron.model import GPT2Model, T5Model
    return (GPT2Model if saved["model_type"] == "gpt" else T5Model)(model_config(saved))


def _inputs(saved, g):
    v = saved["vocab_size"]
    if saved["model_type"] == "gpt":
        return (torch.randint(0, v, (2, 16), generator=g),)
    enc, dec = torch.randint(0, v, (2, 16), generator=g), torch.randint(0, v, (2, 8), generator=g)
    causal = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1).expand(2, 1, 8, 8)
    return enc, dec, torch.zeros(2, 1, 16, 16, dtype=torch.bool), causal, torch.zeros(2, 1, 8, 16, dtype=torch.bool)


def _logits_and_files_check(load_dir: str, tp: int):
    from megatron import mpu
    if tp > 1:
        mpu.initialize_model_parallel(tp, 1)
    saved = read_checkpoint_args(load_dir)
    model = _model(saved)
    assert load_model_weights(model, load_dir) == saved
    if tp == saved["tensor_model_parallel_size"]:
        _check_against_layer_files(model, load_dir, saved)
    model.eval()
    with torch.no_grad():
        logits = model(*_inputs(saved, torch.Generator().manual_seed(0)))
    return mpu.gather_from_tensor_model_parallel_region(logits)[..., :saved["vocab_size"]]


def _check_against_layer_files(model, load_dir, saved):
    import torch.distributed as dist
    from megatron.checkpointing.files import layer_file, read_latest
    table, tp_rank = ModelTable(saved), dist.get_rank(model.tp_group)
    folder = os.path.join(load_dir, read_latest(load_dir))
    for name, param in model.named_parameters():
        info = table.by_name[name]
        stored = torch.load(os.path.join(folder, layer_file(info.layer, tp_rank)), weights_only=True)[info.local]
        assert torch.equal(param.detach(), stored), name


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_load_model_weights_any_tp(kind, request):
    ckpt = request.getfixturevalue(f"{kind}_222")["dir"]
    saved = read_checkpoint_args(ckpt)
    assert (saved["tensor_model_parallel_size"], saved["pipe_parallel_size"], saved["data_parallel_size"]) == (2, 2, 2)
    one = run_distributed(_logits_and_files_check, 1, ckpt, 1)[0]
    for tp in (2, 4):
        other = run_distributed(_logits_and_files_check, tp, ckpt, tp)[0]
        torch.testing.assert_close(other, one, rtol=RTOL, atol=RTOL * one.abs().max().item())


def test_mismatch_and_missing_are_one_line(gpt2_222, tmp_path):
    saved = read_checkpoint_args(gpt2_222["dir"])
    from megatron.model import GPT2Model
    wider = GPT2Model(dataclasses.replace(model_config(saved), hidden_size=64))
    with pytest.raises(CheckpointMismatchError, match="hidden_size = 32 but the model has 64"):
        load_model_weights(wider, gpt2_222["dir"])
    with pytest.raises(UserError, match="does not exist"):
        read_checkpoint_args(str(tmp_path / "nowhere"))
    (tmp_path / "latest").write_text("iter_0000099")
    with pytest.raises(UserError, match="names 'iter_0000099'.*does not exist"):
        read_checkpoint_args(str(tmp_path))
