"""Undo the word tokenization of WikiText-103 before BPE, as Megatron's WikiText task does.

WikiText's files are tokenized text ("the 1 @,@ 000 men ' s ..."): Megatron counts words on the raw file
(`len(text.strip().split(" "))`, the "original tokens"), rejoins them with these rules, then tokenizes.
`auto` picks `wikitext` when the file name contains "wiki" (Megatron's choice by path), `none` otherwise.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Dict

# (pattern, replacement, is_regex), applied in order
_WIKITEXT_RULES = (
    ("s '", "s'", False),                       # plural possessive
    (" @-@ ", "-", False), (" @,@ ", ",", False), (" @.@ ", ".", False),  # number separators
    (" : ", ": ", False), (" ; ", "; ", False), (" . ", ". ", False), (" ! ", "! ", False),
    (" ? ", "? ", False), (" , ", ", ", False),
    (r"\(\s*([^\)]*?)\s*\)", r"(\1)", True),    # no spaces inside brackets and quotes
    (r"\[\s*([^\]]*?)\s*\]", r"[\1]", True),
    (r"{\s*([^}]*?)\s*}", r"{\1}", True),
    (r"\"\s*([^\"]*?)\s*\"", r'"\1"', True),
    (r"'\s*([^']*?)\s*'", r"'\1'", True),
    ("= = = =", "====", False), ("= = =", "===", False), ("= =", "==", False),  # section headings
    (" \u00b0 ", "\u00b0", False),              # degree sign
    (" \n", "\n", False), ("\n ", "\n", False),
    (" N ", " 1 ", False), (" 's", "'s", False),
)


def wikitext(text: str) -> str:
    for pattern, replacement, is_regex in _WIKITEXT_RULES:
        text = re.sub(pattern, replacement, text) if is_regex else text.replace(pattern, replacement)
    return text


def identity(text: str) -> str:
    return text


DETOKENIZERS: Dict[str, Callable[[str], str]] = {"wikitext": wikitext, "none": identity}


def pick(name: str, path: str) -> Callable[[str], str]:
    """The detokenizer called `name` ('auto': by the file name)."""
    if name == "auto":
        name = "wikitext" if "wiki" in os.path.basename(path).lower() else "none"
    return DETOKENIZERS[name]
