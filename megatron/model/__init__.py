"""GPT (GPT-2 and the Llama family) and T5 on Megatron tensor-parallel layers, as plain models and as TDS pipelines.

    config        GPTConfig, T5Config, padded_vocab_size
    gpt2_model    GPTModel                  gpt2_pipe   GPTModelPipe    (GPT-2's layer and the Llama family's)
    t5_model      T5Model                   t5_pipe     T5ModelPipe
    specs         one spec per model family and their registry (`spec_for`): everything else asks it
    language_model  tied LM head with padded ids masked, masked vocab-parallel LM loss (LMLoss)
    transformer / attention / mlp / layer_norm / position   the layers, shared by plain and pipeline models
    rng           layout-independent initialisation and dropout, checkpointing that replays dropout

The pipeline modules import tds.pipe; import them from their modules (`megatron.model.gpt2_pipe`).
"""
from tds.lazy import lazy_exports

# the names below import on first use (tds/lazy.py): `flops` imports without torch (the layout planner)
__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(("GPTConfig", "GPT2Config", "T5Config", "padded_vocab_size"), "megatron.model.config"),
    **dict.fromkeys(("GPTModel", "GPT2Model"), "megatron.model.gpt2_model"), "LMLoss": "megatron.model.language_model",
    "masked_lm_loss": "megatron.model.language_model", "T5Model": "megatron.model.t5_model"})
# GPT2Config, GPT2Model, GPT2ModelPipe (gpt2_pipe) and GPT2MLP (mlp) are the earlier names of the GPT classes
