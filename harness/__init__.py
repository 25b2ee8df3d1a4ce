"""The test and benchmark harness: what tests/ and bench/ share, importable from any folder (installed with the
project: `pip install -e .`, which `make venv` runs).

    dist.py            run a function on N gloo ranks, every rank's result or traceback back (tests, bench)
    synthetic.py       a checkpoint made without training, at any layout (reshape tests, bench/reshape_checkpoint.py)
    example_data.py    the example script's small corpus, tokenizer and .bin/.idx, by its three scripts (tests, bench)
    corpus.py          deterministic texts and small tokenizers trained from them (tests: needs tools/ on sys.path)
    faults/            the fault campaign's engine, and faults injected into the ranks of a real launch

It imports the library (megatron, tds), never tests/ or bench/, and the library never imports it
(tests/test_import_layers.py). It runs in a checkout: its data and scripts are the repository's (`ROOT`).
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
