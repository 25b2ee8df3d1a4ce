"""`pretrain_gpt2.py --dry-run`: the prediction per stage without building the model, and the one-line refusal
of a layout that cannot fit (naming the overflowing part and the planner's best alternative)."""
import contextlib
import io

import pytest

from megatron.errors import UserError
from megatron.model.specs import spec_for
from megatron.training.pretrain import run
from pretrain_gpt2 import DEFAULTS
from harness.example_data import build_data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_data(str(tmp_path_factory.mktemp("plan_data")), max_mb=0.05, vocab_size=300)


def _argv(data, *extra):
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--train-iters", "10", "--data-path", data["data_prefix"],
            "--vocab-file", data["vocab"], "--merge-file", data["merges"], "--dry-run", *extra]


def test_dry_run_prints_each_stage(data, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    state = run(_argv(data, "--pipe-parallel-size", "2", "--gas", "4"), spec_for("gpt"), DEFAULTS)
    out = capsys.readouterr().out
    assert state.iteration == 0
    assert "predicted for tp1 pp2 dp1" in out and "stage 0: peak" in out and "stage 1: peak" in out
    # CPU processes: no step time (the GPU model said 0.06 ms for the main job's ~300 ms, issue 33)
    assert "step time: not predicted for CPU processes" in out and " ms = compute" not in out, out


def test_dry_run_refuses_a_layout_that_cannot_fit(data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    # 48 x 2048 on one stage with fp32 Adam needs ~40 GB per rank; 8 GPUs of 16 GB fit it only split
    argv = _argv(data, "--num-layers", "48", "--hidden-size", "2048", "--num-attention-heads", "16", "--gas", "8",
                 "--micro-batch-size", "1", "--zero-stage", "0", "--gpu-memory-gb", "16")
    with pytest.raises(UserError) as err:
        run(argv, spec_for("gpt"), DEFAULTS)
    line = str(err.value)
    assert "\n" not in line and "does not fit" in line and "the largest part is" in line
    assert "best layout that fits: tp" in line


def test_dry_run_with_gpu_memory_plans_for_gpus_on_a_cpu_machine(data, monkeypatch, capsys):
    """A login node has no GPU: --gpu-memory-gb names one, so the prediction is the fused-attention one."""
    from megatron.config.arguments import parse_args
    from megatron.planning.report import size
    from megatron.planning.search import plan_for_args
    from megatron.training.pretrain import build_tokenizer_from_args
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = _argv(data, "--gpu-memory-gb", "24")
    run(argv, spec_for("gpt"), DEFAULTS)
    out = capsys.readouterr().out
    args = parse_args(argv, defaults=DEFAULTS, world_size=1)
    vocab = build_tokenizer_from_args(args).vocab_size
    gpu, cpu = (plan_for_args(args, vocab, 24, attention=a)[0].stages[0].peak for a in ("fused", "math"))
    assert gpu != cpu
    assert f"peak {size(gpu)} per rank" in out and f"peak {size(cpu)} per rank" not in out, out
    assert "= compute" in out and "bubble" in out  # planned for a GPU: with its step time


def _printed_by_training(argv, world_size):
    """Train on this rank; what it printed (captured here: a forkserver child's stdout is the fd the server
    inherited when an earlier test started it, which pytest's capture of this test never sees)."""
    from tests.training.runner import train_state
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_state(argv, world_size, spec_for("gpt"), DEFAULTS)
    return out.getvalue()


def test_log_memory_prints_one_line_per_rank(data):
    from harness.dist import run_distributed
    argv = [a for a in _argv(data, "--gas", "2", "--train-iters", "2", "--eval-iters", "0", "--num-workers", "0",
                             "--log-memory", "--zero-stage", "0") if a != "--dry-run"]
    out = run_distributed(_printed_by_training, 1, argv, 1, timeout=600)[0]
    lines = [line for line in out.splitlines() if line.startswith("memory iteration 2 rank")]
    assert len(lines) == 1 and "predicted" in lines[0], out[-2000:]


LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


def _built_stage_parameters(cfg) -> tuple:
    """(pp rank, parameters of this rank's stage) of the GPT Pipe model of `cfg` at (tp, pp) = (2, 2)."""
    from megatron import mpu
    from megatron.model.gpt2_pipe import GPT2ModelPipe
    state = mpu.initialize_model_parallel(2, 2)
    module = GPT2ModelPipe(cfg, parallel_state=state)
    return state.pp_rank, sum(p.numel() for p in module.parameters())


def test_dry_run_with_the_llama_layer_at_tp2_pp2(data, monkeypatch, capsys):
    """The Llama family's layer: each stage's line, and the planner's parameters per rank equal those of the Pipe
    model these flags build (the untied head on the last stage, no position table)."""
    from megatron.config.arguments import parse_args
    from megatron.config.resolution import with_vocabulary
    from megatron.planning.model_shape import ModelShape
    from megatron.planning.search import plan_for_args
    from megatron.training.pretrain import build_tokenizer_from_args
    from harness.dist import run_distributed
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = _argv(data, "--tensor-model-parallel-size", "2", "--pipe-parallel-size", "2", "--gas", "4", *LLAMA)
    run(argv, spec_for("gpt"), DEFAULTS)
    out = capsys.readouterr().out
    assert "predicted for tp2 pp2 dp1" in out and "stage 0: peak" in out and "stage 1: peak" in out, out
    args = parse_args(argv, defaults=DEFAULTS, world_size=4)
    vocab = build_tokenizer_from_args(args).vocab_size
    own, _ = plan_for_args(args, vocab, 80.0, attention="math")
    cfg = spec_for("gpt").config(with_vocabulary(args, vocab))
    assert ModelShape.from_args(args, vocab) == ModelShape.of(cfg)
    assert (cfg.swiglu, cfg.num_query_groups, cfg.tie_word_embeddings) == (True, 2, False)
    for stage in own.stages:
        assert f"stage {stage.stage}: peak" in out and f"{stage.params / 1e6:.2f} M parameters" in out
    built = dict(run_distributed(_built_stage_parameters, 4, cfg, timeout=300))
    assert {pp: own.stages[pp].params for pp in built} == built, built


MOE = [*LLAMA, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "2"]


def test_dry_run_and_log_memory_predict_a_mixture_of_experts(data, monkeypatch, capsys):
    """--dry-run plans a MoE model at its expert-parallel size (from the flags); --log-memory's line and the
    start-up line carry the prediction."""
    from harness.dist import run_distributed
    monkeypatch.setenv("WORLD_SIZE", "2")
    run(_argv(data, "--gas", "2", "--zero-stage", "0", "--expert-model-parallel-size", "2", *MOE), spec_for("gpt"),
        DEFAULTS)
    out = capsys.readouterr().out
    assert "predicted for tp1 pp1 dp2 ep2" in out and "stage 0: peak" in out, out
    argv = [a for a in _argv(data, "--gas", "2", "--train-iters", "2", "--eval-iters", "0", "--num-workers", "0",
                             "--log-memory", "--zero-stage", "0", *MOE) if a != "--dry-run"]
    out = run_distributed(_printed_by_training, 1, argv, 1, timeout=600)[0]
    lines = [line for line in out.splitlines() if line.startswith("memory iteration 2 rank")]
    assert len(lines) == 1 and "predicted" in lines[0], out[-2000:]
    assert "no memory prediction" not in out
