"""The planner's golden case, as a command: tools/plan_layout.py on Llama 3 8B (tests/planning/llama3_8b_config.json)
on 2 x 8 H100s, global batch 512, sequence 8192, bf16, --json. tests/planning/golden_plan.py records its ranking
(tests/golden/llama3_8b_plan.json) and tests/planning/test_plan_golden.py pins it; bench/plan_speed.py times it."""
import os

from harness import ROOT

CONFIG = os.path.join(ROOT, "tests", "planning", "llama3_8b_config.json")
FLAGS = ["--nodes", "2", "--gpus-per-node", "8", "--gpu", "h100", "--global-batch-size", "512", "--seq-length", "8192",
         "--bf16", "--json"]


def argv(config: str = CONFIG) -> list:
    """tools/plan_layout.py's arguments for the golden case."""
    return ["--hf-config", config, *FLAGS]
