"""The per-interval log line and the TensorBoard dependency error."""
import importlib.util

import pytest

from megatron.logging_utils import IntervalStats, TensorBoard, format_log_line, interval_metrics


def test_log_line_fields():
    stats = IntervalStats()  # two iterations of different global batches (8 and 12 samples, as in a ramp-up)
    stats.add(2.0, 1.5, 0.5, 8)
    stats.add(4.0, None, 1.5, 12)
    m = interval_metrics(stats, tokens_per_sample=100, flops_per_sample=4e11, world_size=2)
    assert m["loss"] == 3.0 and m["grad_norm"] == 1.5 and m["ms_per_iter"] == 1000.0
    assert m["tokens_per_s"] == 1000.0 and m["tflops_per_device"] == 2.0
    line = format_log_line(20, 100, 160, 1e-4, m, loss_scale=65536.0, skipped=1, peak_bytes=2 ** 30)
    for part in ("iteration 20/100", "consumed samples 160", "lr 1.0000e-04", "loss 3.000000", "grad norm 1.5000",
                 "loss scale 65536", "skipped 1", "1000.0 ms/iter", "1000 tokens/s", "2.0000 TFLOP/s/device",
                 "peak mem 1.00 GB"):
        assert part in line, (part, line)
    assert "loss scale" not in format_log_line(1, 1, 8, 0.1, m, None, 0, 0)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_missing_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="needs the 'tensorboard' package"):
        TensorBoard(str(tmp_path))
    TensorBoard(None).scalars({"loss": 1.0}, 1)  # no directory: a no-op


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_scalars_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    board = TensorBoard(str(tmp_path))
    for step, loss in ((1, 2.5), (2, 2.0)):
        board.scalars({"loss": loss, "lr": 1e-3}, step)
    board.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 2.0)]


def _write_lines_together(tmp_path, statement: str, n: int = 3000) -> list:
    """Two unbuffered processes append `n` lines each to one file (as ranks do to SLURM's --output); its lines."""
    import os
    import subprocess
    import sys
    path = tmp_path / "job.out"
    code = ("import sys\nfrom megatron.logging_utils import print_line\n"
            f"for i in range({n}):\n    {statement}\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(path, "a") as out:
        procs = [subprocess.Popen([sys.executable, "-c", code, tag], stdout=out, env=env) for tag in "ab"]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    return path.read_text().splitlines()


def test_print_line_keeps_lines_of_processes_sharing_a_log_whole(tmp_path):
    lines = _write_lines_together(tmp_path, "print_line(f'{sys.argv[1]} line {i} ' + 'x' * 40)")
    assert len(lines) == 6000
    broken = [line for line in lines if not (line[0] in "ab" and line.endswith(" " + "x" * 40))]
    assert not broken, broken[:3]
