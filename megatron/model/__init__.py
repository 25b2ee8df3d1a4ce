"""GPT-2 and T5 on Megatron tensor-parallel layers, as plain models and as TDS pipelines.

    config        GPT2Config, T5Config, padded_vocab_size
    gpt2_model    GPT2Model                 gpt2_pipe   GPT2ModelPipe
    t5_model      T5Model                   t5_pipe     T5ModelPipe
    language_model  tied LM head with padded ids masked, masked vocab-parallel LM loss (LMLoss)
    transformer / attention / mlp / layer_norm / position   the layers, shared by plain and pipeline models
    rng           layout-independent initialisation and dropout, checkpointing that replays dropout

The pipeline modules import tds.pipe; import them from their modules (`megatron.model.gpt2_pipe`).
"""
from tds.lazy import lazy_exports

# the names below import on first use (tds/lazy.py): `flops` imports without torch (the layout planner)
__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(("GPT2Config", "T5Config", "padded_vocab_size"), "megatron.model.config"),
    "GPT2Model": "megatron.model.gpt2_model", "LMLoss": "megatron.model.language_model",
    "masked_lm_loss": "megatron.model.language_model", "T5Model": "megatron.model.t5_model"})
