"""Training: the driver and what one run needs around the TDS engine.

    pretrain        `run(argv, spec, defaults)` / `pretrain(args, spec)`: start-up, model, engine, --load,
                    data, the loop, the final test evaluation
    loop            one iteration (`engine.train_batch`) and the loop: logging, evaluation, saves
    evaluation      validation / test loss (`engine.eval_batch`)
    batches         the micro-batch iterator the engine reads
    initialize      torch.distributed, the parallel groups, seeding
    optimizer       AdamW with Megatron's parameter groups
    learning_rates  Megatron's AnnealingLR
    flops           model FLOPs per iteration (the MFU convention)
"""
from .pretrain import pretrain, run  # noqa: F401  (Megatron's `from megatron.training import pretrain`)
