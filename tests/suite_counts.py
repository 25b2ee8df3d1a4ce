"""A pytest plugin that prints how many tests each make target collects (tests/test_docs.py compares the counts the
README states with it):

    python -m pytest --collect-only -q -o addopts= -p tests.suite_counts

prints one line `suite counts: test=N long=N slurm=N`: `make test` (no long, slow or slurm marker), `make test-long`
((long or slow) and not slurm) and `make test-slurm` (slurm).
"""


def pytest_collection_finish(session) -> None:
    def marked(item, *names):
        return any(item.get_closest_marker(n) is not None for n in names)
    test = sum(not marked(i, "long", "slow", "slurm") for i in session.items)
    long = sum(marked(i, "long", "slow") and not marked(i, "slurm") for i in session.items)
    slurm = sum(marked(i, "slurm") for i in session.items)
    print(f"\nsuite counts: test={test} long={long} slurm={slurm}")
