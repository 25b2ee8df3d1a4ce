"""What the documentation shows must work: relative links that resolve, and command lines that name existing files
and only flags their parsers accept (tests/test_docs.py runs it over every Markdown file a user reads).

    links(path)       [(line, target)] of the relative links `[text](target)` (http(s), mailto and #anchors left out)
    commands(path)    [(line, script, args)] of the command lines in fenced code blocks and inline code spans that
                      run `tools/*.py`, `pretrain_*.py` or `examples/*.sh` (backslash continuations joined, env
                      assignments and launchers before the script skipped, args up to a shell operator or comment)
    problems(path)    one line per broken link, missing script or unknown flag

A flag is checked against the parser the script builds (captured when the script's `main` parses its arguments,
nothing run): a `tools/convert_checkpoint.py` subcommand's own parser; for `examples/*.sh`, the extra arguments go to
`pretrain_gpt2.py` or `pretrain_t5.py`. Tokens holding `<`, `...` or `$` are placeholders and are not checked.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import sys
from functools import lru_cache
from typing import List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT = re.compile(r"^(?:\./)?(tools/\w+\.py|pretrain_\w+\.py|examples/(?:slurm/)?[\w.]+\.(?:sh|sbatch))$")
SHELL_STOP = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "&", "2>&1"}


def doc_files() -> List[str]:
    """Every Markdown file of the repository a user reads (README, docs/, examples/, tds/, bench/)."""
    out = [os.path.join(ROOT, "README.md")]
    for folder in ("docs", "examples", os.path.join("examples", "slurm"), "tds", "bench"):
        path = os.path.join(ROOT, folder)
        if os.path.isdir(path):
            out += sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".md"))
    return out


def links(path: str) -> List[Tuple[int, str]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            for target in LINK.findall(line):
                if not re.match(r"^(https?:|mailto:|#)", target):
                    out.append((n, target))
    return out


def _snippets(path: str) -> List[Tuple[int, str]]:
    """(first line, text) of each fenced block's logical lines and of each inline code span."""
    out, fence, lines = [], False, open(path, encoding="utf-8").read().splitlines()
    pending, start = "", 0
    for n, line in enumerate(lines, start=1):
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if fence:
            text = line.rstrip()
            if not pending:
                start = n
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            out.append((start, pending + text))
            pending = ""
        else:
            out += [(n, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def commands(path: str) -> List[Tuple[int, str, List[str]]]:
    out = []
    for n, text in _snippets(path):
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError:
            continue
        for i, token in enumerate(tokens):
            m = SCRIPT.match(token)
            if m:
                args = []
                for t in tokens[i + 1:]:
                    if t in SHELL_STOP:
                        break
                    args.append(t)
                out.append((n, m.group(1), args))
                break
    return out


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@lru_cache(maxsize=None)
def script_parser(script: str) -> argparse.ArgumentParser:
    """The parser `script` builds: pretrain_*.py's is Megatron's (`megatron.config.arguments.build_parser`); a tool's
    is captured when its get_args / main / run (called with no arguments) parses, before anything runs."""
    if script.startswith("pretrain_"):
        from megatron.config.arguments import build_parser
        return build_parser(prog=script)
    path = os.path.join(ROOT, script)
    spec = importlib.util.spec_from_file_location(f"_docs_{os.path.basename(script)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Captured(self)
    argparse.ArgumentParser.parse_args = capture
    saved_argv = sys.argv
    try:
        sys.argv = [path]
        takes_argv = [f for f in (getattr(module, n, None) for n in ("get_args", "main", "run"))
                      if f is not None and f.__code__.co_argcount]
        try:
            takes_argv[0]([])
        except _Captured as captured:
            return captured.parser
        raise AssertionError(f"{script}: no parser was built")
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv


def _flags(parser: argparse.ArgumentParser) -> Set[str]:
    return set(parser._option_string_actions)


def _subparser(parser: argparse.ArgumentParser, name: str) -> Optional[argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def _parser_for(script: str, args: List[str]) -> Tuple[Optional[argparse.ArgumentParser], List[str]]:
    if script.startswith("examples/"):
        return script_parser("pretrain_t5.py" if "t5" in script else "pretrain_gpt2.py"), args
    parser = script_parser(script)
    if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        if not args or args[0].startswith("-"):
            return parser, args
        return _subparser(parser, args[0]), args[1:]
    return parser, args


def problems(path: str) -> List[str]:
    where = os.path.relpath(path, ROOT)
    out = []
    for n, target in links(path):
        if not os.path.exists(os.path.join(os.path.dirname(path), target.split("#")[0])):
            out.append(f"{where}:{n}: link {target} does not resolve")
    for n, script, args in commands(path):
        if not os.path.isfile(os.path.join(ROOT, script)):
            out.append(f"{where}:{n}: {script} does not exist")
            continue
        parser, rest = _parser_for(script, args)
        if parser is None:
            out.append(f"{where}:{n}: {script} has no subcommand {args[0]!r}")
            continue
        known = _flags(parser)
        for token in rest:
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and not re.search(r"[<$]|\.\.\.", token) and flag not in known:
                command = f"{script} {args[0]}" if rest is not args else script
                out.append(f"{where}:{n}: {command} does not take {flag}")
    return out
