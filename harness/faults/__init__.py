"""The fault campaign's engine: file kinds and their mutations, the drivers that run a case through the user's
command, the judge of each outcome (campaign.py ties them together; tests/faults and bench/fault_campaign.py run
it), and faults injected into the ranks of a real launch (script.py, plan.py, inject/sitecustomize.py)."""
