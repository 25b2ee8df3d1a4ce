"""The checkpoints of this project's ancestors, read and written (`tools/convert_checkpoint.py import-megatron`,
`export-megatron`):

    legacy      Megatron-LM's per-rank files (iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt, checkpoint_version 0-3.0)
    torch_dist  Megatron core's distributed checkpoints (metadata.json + PyTorch DCP files), read in one process
    ds_pipe     DeepSpeed pipeline layer files: Megatron-DeepSpeed, DeepSpeedExamples v1.1.5, CPM-Pretrain
    probe       which of them a folder holds
    source      what every reader returns: named tensors per (tp, pp) rank and the run's position
    args        the saved Megatron arguments -> the arguments of the GPT computing the same function
    qkv         QKV row orders per checkpoint version -> this project's [Q; K; V]
    importer    import_megatron: a source -> a checkpoint of this project at (tp, pp)
    export      export_megatron: a GPT checkpoint -> Megatron-LM's legacy format, checkpoint_version 3.0
"""
