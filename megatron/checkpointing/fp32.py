"""to-fp32: one consolidated fp32 state dict (what DeepSpeed's zero_to_fp32.py cannot read from these checkpoints).

The plain model's state dict at tp = 1, loadable by `GPTModel` / `T5Model` with `load_state_dict`: the fp32
master weights where the optimizer has them (bf16 / fp16 training), else the weights cast to fp32. A
`.safetensors` output is written with safetensors, anything else with torch.save; atomically.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from megatron.model.config import padded_vocab_size
from .consolidated import read_consolidated
from .manifest import checked_folder
from .names import ModelTable
from .tp import resize_rows


def to_fp32(load_dir: str, output: str, tag: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """One consolidated fp32 state dict of the plain model at tp = 1, written atomically to `output`."""
    ck = read_consolidated(checked_folder(load_dir, tag), with_optimizer=True)
    table = ModelTable(ck.args)
    rows = padded_vocab_size(ck.args["vocab_size"], ck.args["make_vocab_size_divisible_by"], 1)
    state = {}
    for p in table.params:
        value = ck.optim[p.name]["fp32"] if ck.optim else ck.weights[p.name].float()
        state[p.name] = (resize_rows(value, rows) if p.vocab else value).contiguous()
    tmp = os.path.join(os.path.dirname(os.path.abspath(output)), f".{os.path.basename(output)}.tmp.{os.getpid()}")
    try:
        if output.endswith(".safetensors"):
            from safetensors.torch import save_file
            save_file(state, tmp, metadata={"format": "pt"})
        else:
            torch.save(state, tmp)
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return state
