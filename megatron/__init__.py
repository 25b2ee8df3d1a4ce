"""Megatron-LM fork with the TDS pipeline engine: 3D-parallel GPT and T5 pretraining.

On a machine with no accelerator device file at all, DeepSpeed's accelerator is named cpu here (DS_ACCELERATOR), so
that DeepSpeed picks it without its WARNING "Setting accelerator to CPU. If you have GPU or other accelerator, we
were unable to detect it." on every process of every tool: there is nothing it could have missed. A user's
DS_ACCELERATOR is kept, and with any device file present DeepSpeed detects as before (tds/__init__.py does the same
for tds used on its own). No torch import: the pre-launch check stays fast.
"""
import glob as _glob
import os as _os

ACCELERATOR_DEVICE_FILES = ("/dev/nvidia*", "/dev/kfd", "/dev/dri", "/dev/davinci*", "/dev/accel*", "/dev/hl*")

if "DS_ACCELERATOR" not in _os.environ and not any(_glob.glob(p) for p in ACCELERATOR_DEVICE_FILES):
    _os.environ["DS_ACCELERATOR"] = "cpu"
