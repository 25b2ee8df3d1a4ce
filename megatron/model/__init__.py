"""GPT-2 and T5 on Megatron tensor-parallel layers, as plain models and as TDS pipelines.

    config        GPT2Config, T5Config, padded_vocab_size
    gpt2_model    GPT2Model                 gpt2_pipe   GPT2ModelPipe
    t5_model      T5Model                   t5_pipe     T5ModelPipe
    language_model  tied LM head with padded ids masked, masked vocab-parallel LM loss (LMLoss)
    transformer / attention / mlp / layer_norm / position   the layers, shared by plain and pipeline models
    rng           layout-independent initialisation and dropout, checkpointing that replays dropout

The pipeline modules import tds.pipe; import them from their modules (`megatron.model.gpt2_pipe`).
"""
from .config import GPT2Config, T5Config, padded_vocab_size  # noqa: F401
from .gpt2_model import GPT2Model  # noqa: F401
from .language_model import LMLoss, masked_lm_loss  # noqa: F401
from .t5_model import T5Model  # noqa: F401
