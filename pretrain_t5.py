"""Pretrain T5 (span corruption) with 3D parallelism (tensor x pipeline x data) on DeepSpeed + TDS.

    deepspeed pretrain_t5.py --num-layers 12 --hidden-size 768 --encoder-seq-length 512 \
        --decoder-seq-length 128 --tokenizer-type SentencePieceTokenizer --tokenizer-model spm.model ...

--num-layers is the depth of the encoder, and of the decoder unless --decoder-num-layers is given.
T5 v1.0 by default (ReLU feed-forward, LM head tied to the word embeddings); T5 v1.1 with
--feed-forward-proj gated-gelu --untie-embeddings-and-output-weights (usually with dropout 0 for pretraining).
The model, its datasets and micro-batches are `megatron.model.specs.SPECS['t5']`; the driver is
`megatron.training.pretrain.run`.
"""
import sys

from megatron.config.arguments import ENTRY_DEFAULTS
from megatron.errors import exit_on_user_error
from megatron.model.specs import spec_for
from megatron.training.pretrain import run

SPEC = spec_for("t5")
DEFAULTS = ENTRY_DEFAULTS["t5"]

if __name__ == "__main__":
    exit_on_user_error(lambda: run(sys.argv[1:], SPEC, DEFAULTS))
