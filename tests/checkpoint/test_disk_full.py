"""The tools' outputs on a file system that is too small (a tmpfs mounted here as root; skipped where the tests
do not run as root, failed where root cannot mount: tests/faults/tmpfs.py): `reshape`, `export-hf`,
`import-megatron` and `import-hf` stop with one line naming the output, the bytes it needs and those free,
and leave nothing behind; the check before writing, and a file system that fills while they write (another
writer took the space after the check: the check is skipped here). The training saves: tests/faults."""
import os

import pytest

from megatron.checkpointing import space
from megatron.checkpointing.space import DiskFullError
from harness.synthetic import resolved_args, write_synthetic
from tests.faults.tmpfs import small_tmpfs
from tools.convert_checkpoint import run

LAYOUT = ["--tensor-model-parallel-size", "2", "--pipe-parallel-size", "1"]
TOOLS = {"reshape": lambda src, out: ["reshape", "--load", src["ckpt"], "--save", out, *LAYOUT],
         "export-hf": lambda src, out: ["export-hf", "--load", src["ckpt"], "--output", out],
         "import-megatron": lambda src, out: ["import-megatron", "--input", src["megatron"], "--save", out, *LAYOUT],
         "import-hf": lambda src, out: ["import-hf", "--input", src["hf"], "--save", out, *LAYOUT]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict:
    """A (1, 1, 1) GPT-2 checkpoint of about 0.6 MB (weights 0.2 MB, the rest optimizer state), a Megatron-LM
    checkpoint made from it, and a transformers folder of 0.6 MB (a wider GPT-2 whose vocabulary is its
    tokenizer's)."""
    root = tmp_path_factory.mktemp("ckpt")
    ckpt = write_synthetic(str(root / "ckpt"), resolved_args("gpt2", (1, 1, 1), 500))
    run(["export-megatron", "--load", ckpt, "--output", str(root / "megatron"), "--tensor-model-parallel-size", "1",
         "--pipe-parallel-size", "1"])
    wide = write_synthetic(str(root / "wide"), resolved_args("gpt2", (1, 1, 1), 512, hidden=64))  # 0.6 MB in HF
    run(["export-hf", "--load", wide, "--output", str(root / "hf")])
    return dict(ckpt=ckpt, megatron=str(root / "megatron"), hf=str(root / "hf"))


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("when", ["before", "while writing"])
def test_a_full_file_system_is_one_line_and_leaves_nothing(ckpt, tmp_path, monkeypatch, tool, when):
    with small_tmpfs(str(tmp_path / "small"), 160 << 10) as small:
        if when == "while writing":
            monkeypatch.setattr(space, "check_space", lambda *args: None)
        out = os.path.join(small, "out")
        with pytest.raises(DiskFullError) as err:
            run(TOOLS[tool](ckpt, out))
        line = str(err.value)
        assert line.startswith(f"no space left on device: the output at {out} needs "), line
        assert "bytes" in line and f"nothing was written to {out} (the partial output was removed)" in line, line
        assert "\n" not in line
        assert os.listdir(small) == []  # the temporary folder is gone too
    run(TOOLS[tool](ckpt, str(tmp_path / "roomy")))  # the same command where there is room
