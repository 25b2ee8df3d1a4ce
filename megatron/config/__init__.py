"""The run's configuration, resolved once: Megatron's command line and the DeepSpeed JSON.

    arguments       the parser (Megatron's flags and aliases), `parse_args` -> resolved arguments
    resolution      every derived value and check in one place (`resolve_args`, `with_vocabulary`)
    ds_config       the DeepSpeed JSON merged with the command line; the dict DeepSpeed receives
    batch_schedule  the global batch per iteration (batch ramp-up) and --train-samples -> iterations
    run_config      the frozen RunConfig, one record per section, built once the vocabulary is known
    launcher_env    RANK, WORLD_SIZE, ... from SLURM (srun) or OpenMPI (mpirun) when no launcher set them
    preflight       `python -m megatron.config.preflight gpt|t5 --world-size N ...`: arguments and input
                    files checked in one process before a launch

Nothing in this package imports torch or DeepSpeed (the preflight runs in about a second).
"""
