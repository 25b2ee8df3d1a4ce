"""inspect, to-fp32, the one-line errors for bad input, and checkpoints of the previous pp = 1 layout.

- inspect prints the model, iteration, consumed samples, layout, ZeRO stage, precision, parameter count,
  every full shape and what each file holds, from metadata only (timed here and in bench/reshape_checkpoint.py);
- to-fp32 writes a state dict that the plain model at tp = 1 loads strictly, with the same logits;
- a missing or truncated shard, a `latest` naming a missing folder, a model type the tools do not handle:
  each one line naming the file or value, through the command line (exit status 2, no traceback);
- the save directory holds no copy of DeepSpeed's zero_to_fp32.py (it cannot read these checkpoints);
- a checkpoint of the previous pp = 1 layout (the module inside mp_rank_00_model_states.pt) reads the same.
"""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from megatron.checkpointing.consolidated import read_consolidated
from megatron.checkpointing.files import read_args, write_args
from megatron.checkpointing.manifest import write_manifest
from megatron.checkpointing.names import ModelTable
from megatron.errors import UserError
from tds.safe_load import load as safe_load
from tests.checkpoint.common import differences
from tools.convert_checkpoint import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_inspect_reports_the_checkpoint(gpt2_222, capsys):
    start = time.perf_counter()
    run(["inspect", gpt2_222["dir"]])
    seconds = time.perf_counter() - start
    out = capsys.readouterr().out
    for line in ("model            gpt: 2 layers, hidden 32, 4 heads, ffn 128, vocabulary 512", "iteration        10",
                 "consumed samples 80", "(tp, pp, dp)     (2, 2, 2)", "ZeRO stage       1 (DeepSpeed ran stage 1)",
                 "precision        fp32", "optimizer        ZeRO-1 flat fp32 partitions per dp rank"):
        assert line in out, line
    table = ModelTable(read_args(os.path.join(gpt2_222["dir"], "iter_0000010")))
    weights = read_consolidated(os.path.join(gpt2_222["dir"], "iter_0000010"), with_optimizer=False).weights
    assert f"parameters       {sum(w.numel() for w in weights.values()):,}" in out
    for p in table.params:
        assert f"  {p.name:60s} {tuple(weights[p.name].shape)}" in out
    assert "zero_pp_rank_1_mp_rank_03_optim_states.pt" in out and "pipeline layer 1, tp rank 1: layers.0*" in out
    print(f"inspect of the (2,2,2) test checkpoint: {seconds * 1e3:.0f} ms")


def test_inspect_on_cpu_prints_no_warning(gpt2_222):
    """Through the command line as a user runs it, DS_ACCELERATOR unset: DeepSpeed's 'Setting accelerator to CPU'
    warning (megatron names the accelerator where the machine has none) nor any other WARNING line."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    result = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "inspect", gpt2_222["dir"]], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and "iteration        10" in result.stdout, result.stderr[-2000:]
    assert "WARNING" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_to_fp32_loads_into_the_plain_model(gpt2_222, tmp_path):
    from megatron.checkpointing import load_model_weights, read_checkpoint_args
    from megatron.checkpointing.names import model_config
    from megatron.model import GPT2Model
    out = str(tmp_path / "model.pt")
    run(["to-fp32", "--load", gpt2_222["dir"], "--output", out])
    saved = read_checkpoint_args(gpt2_222["dir"])
    consolidated, reference = GPT2Model(model_config(saved)), GPT2Model(model_config(saved))
    consolidated.load_state_dict(torch.load(out, weights_only=True), strict=True)
    load_model_weights(reference, gpt2_222["dir"])
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(consolidated.eval()(ids), reference.eval()(ids))
    assert not os.path.exists(os.path.join(gpt2_222["dir"], "zero_to_fp32.py"))


def _copy(fixture: dict, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(fixture["dir"], dst)
    return dst


def _fails(argv, message: str) -> None:
    with pytest.raises(UserError) as err:
        run(argv)
    text = str(err.value)
    assert "\n" not in text and re.search(message, text), text


def test_bad_input_is_one_line(gpt2_222, tmp_path):
    ckpt = _copy(gpt2_222, tmp_path)
    folder = os.path.join(ckpt, "iter_0000010")
    os.remove(os.path.join(folder, "zero_pp_rank_1_mp_rank_02_optim_states.pt"))
    _fails(["reshape", "--load", ckpt, "--save", str(tmp_path / "r"), "--tensor-model-parallel-size", "1",
            "--pipe-parallel-size", "1"],
           r"zero_pp_rank_1_mp_rank_02_optim_states.pt \(optimizer partition of dp rank 1, pipeline stage 1, "
           r"tp rank 0\) is missing \(manifest.json lists it\); the newest complete checkpoint in .* is iteration 5")
    layer = os.path.join(folder, "layer_01-model_01-model_states.pt")
    with open(layer, "r+b") as f:
        f.truncate(os.path.getsize(layer) // 2)
    _fails(["to-fp32", "--load", ckpt, "--output", str(tmp_path / "x.pt")],
           "layer_01-model_01-model_states.pt \\(weights of pipeline layer 1, tp rank 1\\) is truncated: ")
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("iter_0000042")
    _fails(["export-hf", "--load", ckpt, "--output", str(tmp_path / "h")],
           "latest names 'iter_0000042', but folder .*iter_0000042 does not exist")
    bert = str(tmp_path / "bert" / "iter_0000005")
    shutil.copytree(gpt2_222["tag5"], bert)
    write_args(bert, {**read_args(gpt2_222["tag5"]), "model_type": "bert"})
    write_manifest(bert)  # a checkpoint saved as model_type 'bert' (an edit of the type alone is refused)
    _fails(["inspect", bert], "model_type 'bert' is not one this tool handles")
    assert not any(os.path.exists(tmp_path / n) for n in ("r", "x.pt", "h"))
    result = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "inspect", bert], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]


def _to_previous_layout(folder: str, plain_path: bool = False) -> None:
    """Rewrite a pp = 1 checkpoint as the previous layout wrote it: the module in mp_rank_00, no layer files;
    with `plain_path`, also without the later module_form and model / layout records (the plain-model path)."""
    args = read_args(folder)
    table = ModelTable(args)
    module = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("layer_"):
            layer = int(name[6:8])
            state = torch.load(os.path.join(folder, name), weights_only=True)
            module.update({table.by_location[(layer, local)].name: t for local, t in state.items()})
            os.remove(os.path.join(folder, name))
    path = os.path.join(folder, "mp_rank_00_model_states.pt")
    engine = safe_load(path)
    engine["module"] = {p.name: module[p.name] for p in table.params}
    torch.save(engine, path)
    os.remove(os.path.join(folder, "manifest.json"))  # the previous layout predates manifests
    if plain_path:
        write_args(folder, {k: v for k, v in args.items() if k not in ("module_form", "model", "layout")})


def test_previous_pp1_layout_reads_the_same(gpt2_222, tmp_path):
    new = str(tmp_path / "pp1")
    run(["reshape", "--load", gpt2_222["dir"], "--save", new, "--tensor-model-parallel-size", "1",
         "--pipe-parallel-size", "1", "--data-parallel-size", "2"])
    folder = os.path.join(new, "iter_0000010")
    before = read_consolidated(folder)
    _to_previous_layout(folder)
    assert not any(n.startswith("layer_") for n in os.listdir(folder))
    after = read_consolidated(folder)
    assert differences(vars(before), vars(after)) == []


@pytest.mark.slow
def test_previous_pp1_layout_resumes_exactly(data_prefix, tmp_path):
    """A (1, 1, 1) checkpoint rewritten in the previous layout resumes through pretrain() bit for bit."""
    from tests.checkpoint.common import train
    save = str(tmp_path / "ckpt")
    straight = train("gpt2", data_prefix, (1, 1, 1), 4)
    train("gpt2", data_prefix, (1, 1, 1), 2, ["--save", save])
    _to_previous_layout(os.path.join(save, "iter_0000002"), plain_path=True)
    assert train("gpt2", data_prefix, (1, 1, 1), 4, ["--load", save]) == straight[2:]


@pytest.mark.long
def test_checkpoint_of_the_earlier_plain_pp1_path_resumes_exactly(data_prefix, tmp_path):
    """Before one training path, pp = 1 ran the plain model under DeepSpeed's engine: in bf16 without ZeRO
    its optimizer state is DeepSpeed's unfused layout in the plain model's parameter order, and
    megatron_args.json has no module_form. Such a checkpoint loads through the reshape into the one-stage
    Pipe model (BF16_Optimizer's flat layout) and resumes bit for bit."""
    from megatron.checkpointing.layouts import write_layout
    from tests.checkpoint.common import train
    save, bf16 = str(tmp_path / "ckpt"), ["--bf16"]
    straight = train("gpt2", data_prefix, (1, 1, 1), 4, bf16)
    train("gpt2", data_prefix, (1, 1, 1), 2, ["--save", save, *bf16])
    folder = os.path.join(save, "iter_0000002")
    ck, args = read_consolidated(folder), read_args(folder)
    assert args.pop("module_form") == "pipe"
    shutil.rmtree(folder)
    os.makedirs(folder)
    write_layout(ck, folder, args)  # as the earlier path wrote it
    optimizer = safe_load(os.path.join(folder, "mp_rank_00_model_states.pt"))["optimizer"]
    assert "fp32_groups" in optimizer and not any("zero" in name for name in os.listdir(folder))
    plain = read_consolidated(folder)
    for part in ("weights", "optim", "hyper", "step", "engine", "rng"):  # args and loss-scale extras differ by form
        assert differences(getattr(plain, part), getattr(ck, part)) == [], part
    assert train("gpt2", data_prefix, (1, 1, 1), 4, ["--load", save, *bf16]) == straight[2:]
