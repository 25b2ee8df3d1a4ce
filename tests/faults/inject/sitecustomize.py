"""Faults injected into the training ranks of a real launch (the example scripts, torchrun, DeepSpeed's launcher).

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one; the tests put this
folder on PYTHONPATH. Nothing happens unless FAULTS names a plan (tests/faults/plan.py) and the process is a
training rank (LOCAL_RANK in its environment: set by the launcher for its workers only), so the preflight,
the launchers and the tools run untouched.
"""
import os

if os.environ.get("FAULTS") and "LOCAL_RANK" in os.environ:
    from tests.faults.plan import install

    install(os.environ["FAULTS"])
