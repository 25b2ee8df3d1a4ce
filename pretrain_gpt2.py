"""Pretrain GPT-2 with 3D parallelism (tensor x pipeline x data) on DeepSpeed + TDS.

    deepspeed pretrain_gpt2.py --num-layers 24 --hidden-size 1024 ... --deepspeed --deepspeed_config cfg.json
    torchrun --nproc_per_node 8 pretrain_gpt2.py ...

The model, its datasets and micro-batches are `megatron.model.specs.SPECS['gpt']`; the driver is
`megatron.training.pretrain.run`.
"""
import sys

from megatron.config.arguments import ENTRY_DEFAULTS
from megatron.errors import exit_on_user_error
from megatron.model.specs import spec_for
from megatron.training.pretrain import run

SPEC = spec_for("gpt")
DEFAULTS = ENTRY_DEFAULTS["gpt"]

if __name__ == "__main__":
    exit_on_user_error(lambda: run(sys.argv[1:], SPEC, DEFAULTS))
