"""--use-checkpoint-args (Megatron-LM's option): the model's architecture comes from the checkpoint of --load, or of
--pretrained-checkpoint while --load holds none. A Llama-style GPT with a tied head resolves from its saved
arguments alone; a model flag given as well must agree (one line naming the flag and both values); the sequence
length is the run's; no checkpoint, or another model type, is one line. The preflight reads the arguments without
importing torch."""
import json
import os
import subprocess
import sys

import pytest

from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
from megatron.errors import UserError
from harness.synthetic import resolved_args
from tests.training.golden_cases import DATA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = ["--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear", "--ffn-hidden-size", "96"]


def _checkpoint(root, model: str = "gpt2", extra=()) -> str:
    """A folder whose `latest` names a tag holding only the megatron_args.json of a (1, 1, 1) run."""
    saved = resolved_args(model, (1, 1, 1), 256, layers=3, hidden=64, heads=4, extra=list(extra))
    folder = os.path.join(root, "iter_0000000")
    os.makedirs(folder)
    with open(os.path.join(folder, "megatron_args.json"), "w") as f:
        json.dump(saved, f)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("iter_0000000")
    return str(root)


def _argv(*extra) -> list:
    return ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3",
            "--seq-length", "24", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            os.path.join(DATA, "vocab.json"), "--merge-file", os.path.join(DATA, "merges.txt"), *extra]


def _parse(*extra):
    return parse_args(_argv(*extra), defaults=ENTRY_DEFAULTS["gpt"], world_size=1)


def test_the_model_comes_from_the_checkpoint(tmp_path):
    pretrained = _checkpoint(tmp_path / "imported", extra=LLAMA)
    args = _parse("--pretrained-checkpoint", pretrained, "--use-checkpoint-args")
    got = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                         "position_embedding_type", "rotary_base", "normalization", "swiglu",
                                         "num_query_groups", "disable_bias_linear",
                                         "untie_embeddings_and_output_weights", "seq_length")}
    assert got == dict(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                       position_embedding_type="rope", rotary_base=500000.0, normalization="RMSNorm", swiglu=True,
                       num_query_groups=2, disable_bias_linear=True, untie_embeddings_and_output_weights=False,
                       seq_length=24)  # tied as saved; the sequence length is the run's
    agreeing = _parse("--pretrained-checkpoint", pretrained, "--use-checkpoint-args", "--hidden-size", "64",
                      "--swiglu")
    assert agreeing.hidden_size == 64
    own = _checkpoint(tmp_path / "own")  # a GPT-2 under --load wins over --pretrained-checkpoint
    resumed = _parse("--load", own, "--pretrained-checkpoint", pretrained, "--use-checkpoint-args")
    assert resumed.position_embedding_type == "learned_absolute" and not resumed.swiglu


@pytest.mark.parametrize("flag, shown, field", [
    (["--hidden-size", "32"], "--hidden-size 32", "hidden_size = 64"),
    (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights contradicts",
     "untie_embeddings_and_output_weights = False"),
    (["--rotary-base", "10000"], "--rotary-base 10000.0", "rotary_base = 500000.0"),
])
def test_a_contradicting_flag_is_one_line(tmp_path, flag, shown, field):
    pretrained = _checkpoint(tmp_path / "imported", extra=LLAMA)
    with pytest.raises(UserError) as err:
        _parse("--pretrained-checkpoint", pretrained, "--use-checkpoint-args", *flag)
    message = str(err.value)
    assert "\n" not in message and shown in message and field in message and "iter_0000000" in message, message


def test_no_checkpoint_or_another_model_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"--load .* holds none and no --pretrained-checkpoint"):
        _parse("--load", str(tmp_path / "empty"), "--use-checkpoint-args")
    t5 = _checkpoint(tmp_path / "t5", model="t5")
    with pytest.raises(UserError, match=r"holds a t5 model, this script trains gpt"):
        _parse("--pretrained-checkpoint", t5, "--use-checkpoint-args")


def test_the_preflight_reads_it_without_torch(tmp_path):
    """python -m megatron.config.preflight (the example scripts' check): one error line, exit 2, and torch is never
    imported on the way."""
    pretrained = _checkpoint(tmp_path / "imported", extra=LLAMA)
    code = ("import sys, runpy; sys.argv = ['preflight', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('megatron.config.preflight', run_name='__main__')\n"
            "finally:\n    print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, "gpt", "--world-size", "1", "--args-only",
                           *_argv("--pretrained-checkpoint", pretrained, "--use-checkpoint-args", "--hidden-size",
                                  "32")], capture_output=True, text=True, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1] == "no torch", proc.stderr
    assert len(lines) == 2 and lines[0].startswith("error: --use-checkpoint-args: --hidden-size 32 contradicts "
                                                   "hidden_size = 64"), proc.stderr
