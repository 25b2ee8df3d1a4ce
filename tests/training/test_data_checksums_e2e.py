"""A flipped byte in a preprocessed .bin, through examples/ds_pretrain_gpt2.sh (2 data-parallel processes, each
reading through a DataLoader worker): the pre-launch check passes (it reads no tokens), the first read of the
damaged chunk stops the run with one `error:` line naming the file, the byte range and both checksums; exit 2;
not one iteration."""
import os
import shutil
import zlib

import pytest

from tests.training.test_user_errors import _env, _run_script

pytestmark = pytest.mark.long


def test_a_flipped_bin_byte_stops_training_at_its_first_read(tmp_path, gpt_data):
    prefix = str(tmp_path / "docs")
    for ext in (".bin", ".idx", ".crc.json"):
        shutil.copy(gpt_data["data_prefix"] + ext, prefix + ext)
    good = open(prefix + ".bin", "rb").read()
    assert len(good) < 1 << 20  # one chunk
    damaged = bytearray(good)
    damaged[len(good) // 2] ^= 0x04
    with open(prefix + ".bin", "wb") as f:
        f.write(damaged)
    env = _env(tmp_path, DATA_PATH=prefix, VOCAB_FILE=gpt_data["vocab"], MERGE_FILE=gpt_data["merges"], NPROC="2",
               TP="1", PP="1", NUM_WORKERS="1", TRAIN_ITERS="2", LOG_INTERVAL="1", SAMPLES="0")
    proc = _run_script("ds_pretrain_gpt2.sh", env, timeout=400)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert errors == [f"error: {prefix}.bin: bytes 0..{len(good) - 1} (chunk 0) fail their CRC-32 ({prefix}.crc.json "
                      f"says 0x{zlib.crc32(good):08x}, read 0x{zlib.crc32(bytes(damaged)):08x}): the file is damaged; "
                      f"re-copy it or re-run tools/preprocess_data.py"], out[-3000:]
    assert "launching:" in proc.stdout and " iteration " not in out, out[-3000:]
    assert "built train index" in out  # found by the first read, after the datasets are built
    checkpoints = os.path.join(env["WORK_DIR"], "checkpoints")
    assert not os.path.isdir(checkpoints) or os.listdir(checkpoints) == [], os.listdir(checkpoints)
