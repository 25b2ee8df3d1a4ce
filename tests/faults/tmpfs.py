"""A small tmpfs for the full-disk tests: mounted as root (`mount -t tmpfs -o size=...`); where mounting is refused
(not root, no mount command, a container without the capability) the test is skipped with that reason."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(path: str, size_bytes: int) -> Iterator[str]:
    """`path` (created) as a tmpfs of `size_bytes`, unmounted afterwards; skips the test if it cannot mount."""
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the full-disk tests mount a small tmpfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", path], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs was refused ({proc.stderr.strip() or proc.returncode}): the full-disk tests "
                    f"need root and the mount capability")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)
