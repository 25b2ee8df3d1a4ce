"""Megatron-LM fork with the TDS pipeline engine: 3D-parallel GPT-2 and T5 pretraining."""
