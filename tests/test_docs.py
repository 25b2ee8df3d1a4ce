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
