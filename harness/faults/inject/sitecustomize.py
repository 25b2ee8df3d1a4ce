"""Faults injected into the training ranks of a real launch (the example scripts, torchrun, DeepSpeed's launcher).

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one; the tests put this
folder on PYTHONPATH. Nothing happens unless FAULTS names a plan (harness/faults/plan.py) and the process is a
training rank (a process running pretrain_*.py, under any launcher: torchrun, DeepSpeed's, srun), so the
preflight, the launchers and the tools run untouched.
"""
import os
import sys

if os.environ.get("FAULTS") and os.path.basename(sys.argv[0] if sys.argv else "").startswith("pretrain_"):
    from harness.faults.plan import install

    install(os.environ["FAULTS"])
