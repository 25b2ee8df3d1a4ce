"""The test and benchmark harness: what tests/ and bench/ share, importable from any folder (installed with the
project: `pip install -e .`, which `make venv` runs).

    dist.py               run a function on N gloo ranks, every rank's result or traceback back (tests, bench)
    spawn.py              run a benchmark function on N spawned gloo ranks, rank 0's result back (bench)
    synthetic.py          a checkpoint made without training, at any layout (tests, bench/reshape_checkpoint.py)
    example_data.py       the example script's small corpus, tokenizer and .bin/.idx, by its three scripts
    corpus.py             deterministic texts and small tokenizers trained from them (tests)
    planner_case.py       the planner's golden command (tests/planning, bench/plan_speed.py)
    sleeping_pipeline.py  a pipeline of layers that sleep fixed times in F, B and W; a bare gloo hop (bench)
    faults/               the fault campaign's engine, and faults injected into the ranks of a real launch

It imports the library (megatron, tds), never tests/ or bench/, and the library never imports it
(tests/test_import_layers.py); corpus.py alone imports tools/ too (the checkout's command line, on sys.path where
pytest runs). It works in a checkout: its data and scripts are the repository's (`ROOT`).
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
