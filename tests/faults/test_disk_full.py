"""A checkpoint saved into a file system that is too small (a tmpfs mounted here as root; skipped where the tests
do not run as root, failed where root cannot mount: tests/faults/tmpfs.py), through examples/ds_pretrain_gpt2.sh
at (1, 2, 2), saving every 4 iterations: the run stops with one line naming the path and the bytes needed, exit 2;
nothing half-written is published (`latest` still names iteration 4), and that checkpoint, copied where there is
room, resumes with the uninterrupted run's losses (exactly: harness/faults/script.py's Run.losses; resumed in the
first and third cases).

- the second save does not fit: refused before anything of it is written (the previous checkpoint's size);
- another writer fills the file system during the second save (harness/faults/plan.py's fill_disk);
- the same with --async-save: the background write fails, the run stops at its next save.
"""
from __future__ import annotations

import os
import re
import shutil

import pytest

from megatron.checkpointing import read_latest
from megatron.checkpointing.files import folder_bytes
from harness.faults.script import ITERS, run_script, script_env
from tests.faults.tmpfs import small_tmpfs

pytestmark = pytest.mark.long
CHECKPOINT_BYTES = 1_100_000  # about one checkpoint of harness/faults/script.py's layout (checked below)


@pytest.mark.parametrize("case", ["refused before the save", "filled during the save", "filled, --async-save"])
def test_a_full_disk_stops_the_run_and_the_previous_checkpoint_resumes(data, reference, tmp_path, case):
    work = str(tmp_path / "work")
    size = int(1.5 * CHECKPOINT_BYTES) if case == "refused before the save" else 4 * CHECKPOINT_BYTES
    with small_tmpfs(str(tmp_path / "small"), size) as small:
        save = os.path.join(small, "checkpoints")
        faults = None if case == "refused before the save" else dict(fill_disk=dict(iteration=8, path=small))
        extra = dict(ASYNC_SAVE="1") if "async" in case else {}
        run = run_script(script_env(data, work, faults=faults, SAVE=save, **extra))
        assert run.rc == 2, run.log[-4000:]
        errors = [line for line in run.log.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in run.log, run.log[-4000:]
        assert re.search(rf"no space left on device: checkpoint (iteration 8|iter_0000008) at {save}/?\S* needs ",
                         errors[0]), errors[0]
        assert re.search(r"\d+ bytes \(\d+\.\d MB\)", errors[0]), errors[0]
        assert "`latest` still names iter_0000004" in errors[0], errors[0]
        assert read_latest(save) == "iter_0000004"
        assert 0.5 < folder_bytes(os.path.join(save, "iter_0000004")) / CHECKPOINT_BYTES < 1.2
        roomy = str(tmp_path / "roomy")
        shutil.copytree(save, roomy)
    if case == "filled during the save":
        return  # its resume is the --async-save case's (the same failed write, in the background there)
    again = run_script(script_env(data, work, SAVE=roomy))
    assert again.rc == 0, again.log[-4000:]
    assert f"loaded checkpoint {roomy}/iter_0000004: iteration 4," in again.log, again.log[-3000:]
    assert again.losses == {i: reference[i] for i in range(5, ITERS + 1)}
