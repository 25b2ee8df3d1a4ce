"""Build a small English corpus offline from the docstrings of Python's standard library.

One JSON line {"text": ...} per docstring of at least 200 characters (modules, classes, functions), in
source order. Files are visited in sorted order, so the corpus is the same on every run of
the same Python version. Stops after --max-mb megabytes of text.

    python examples/make_default_corpus.py --output data/corpus.jsonl --max-mb 4
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
from typing import Iterator, List

MIN_DOC_CHARS = 200


def module_docstrings(path: str) -> List[str]:
    """Module, class and function docstrings of one source file ([] if it does not parse)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef))]
    return [d for d in (ast.get_docstring(n) for n in nodes) if d]


def stdlib_files(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def build_corpus(output: str, max_bytes: int, root: str) -> int:
    """Write the corpus; returns the number of documents."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    written = docs = 0
    tmp = output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for text in (t for path in stdlib_files(root) for t in module_docstrings(path)):
            if len(text) < MIN_DOC_CHARS:
                continue
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            out.write(line)
            written += len(line.encode("utf-8"))
            docs += 1
            if written >= max_bytes:
                break
    os.replace(tmp, output)
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--max-mb", type=float, default=4.0)
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="source tree to read")
    a = p.parse_args()
    docs = build_corpus(a.output, int(a.max_mb * 2 ** 20), a.stdlib)
    if docs == 0:
        raise SystemExit(f"no docstrings found under {a.stdlib}: pass --stdlib DIR with Python sources")
    print(f"wrote {docs} documents to {a.output}")


if __name__ == "__main__":
    main()
