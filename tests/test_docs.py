"""The documentation a user reads works as shown (tests/docs_check.py): every relative link resolves and every
`python tools/...`, `pretrain_*.py` and `examples/*.sh` command line names a file that exists and only flags its
parser accepts; and the check does fail on a broken link, a missing script, an unknown flag and an unknown
subcommand."""
import os

from tests.docs_check import ROOT, commands, doc_files, problems


def test_every_link_and_command_line_of_the_docs_works():
    files = doc_files()
    assert os.path.join(ROOT, "README.md") in files and len(files) >= 4
    assert sum(len(commands(f)) for f in files) > 50  # the check saw the command lines
    found = [p for f in files for p in problems(f)]
    assert found == [], "\n".join(found)


def test_the_check_finds_what_is_broken(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[gone](missing.md) and [here](page.md#top)\n"
                    "```bash\n"
                    "python tools/preprocess_data.py --input a.jsonl --no-such-flag 3 \\\n"
                    "    --workers 2   # a comment --not-a-flag\n"
                    "TP=2 bash examples/ds_pretrain_gpt2.sh --swiglu --bogus | tee log\n"
                    "python tools/convert_checkpoint.py reshape --load x --frobnicate\n"
                    "python tools/convert_checkpoint.py fold --load x\n"
                    "python tools/preprocess_data.py --input <your corpus> --tokenizer-model $TOK\n"
                    "```\n"
                    "and `python tools/no_such_tool.py --x`\n")
    where = os.path.relpath(str(page), ROOT)
    assert problems(str(page)) == [
        f"{where}:1: link missing.md does not resolve",
        f"{where}:3: tools/preprocess_data.py does not take --no-such-flag",
        f"{where}:5: examples/ds_pretrain_gpt2.sh does not take --bogus",
        f"{where}:6: tools/convert_checkpoint.py reshape does not take --frobnicate",
        f"{where}:7: tools/convert_checkpoint.py has no subcommand 'fold'",
        f"{where}:10: tools/no_such_tool.py does not exist"]


def test_the_test_counts_the_docs_state_are_what_the_suite_collects():
    """README.md and docs/testing.md say how many tests `make test`, `make test-long` and `make test-slurm` run;
    the counts come from collecting the suite (tests/suite_counts.py), so a test added or removed shows here."""
    import re
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=",
                          "-p", "tests.suite_counts"], cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    counts = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", out.split("suite counts:")[-1]))
    assert set(counts) == {"test", "long", "slurm"} and counts["test"] > 1000, out[-2000:]
    for name in ("README.md", os.path.join("docs", "testing.md")):
        text = " ".join(open(os.path.join(ROOT, name)).read().split())
        stated = re.search(r"`make test` runs the default suite on CPU with gloo \(([\d,]+) tests\), and `make "
                           r"test-long` its ([\d,]+) runs", text)
        slurm = re.search(r"runs `tests/slurm` against it \(([\d,]+) tests\)", text)
        assert stated and (name != "README.md" or slurm), f"{name}: the sentence with the counts is gone"
        assert int(stated[1].replace(",", "")) == counts["test"], (name, stated[1], counts)
        assert int(stated[2].replace(",", "")) == counts["long"], (name, stated[2], counts)
        if slurm:
            assert int(slurm[1].replace(",", "")) == counts["slurm"], (name, slurm[1], counts)
