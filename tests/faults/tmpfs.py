"""A small tmpfs for the full-disk tests, mounted as root (`mount -t tmpfs -o size=...`). Not root (a developer's
machine): the test is skipped, saying so. Root (CI runs as root): a mount that fails fails the test, so that CI
never passes without having run it."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(path: str, size_bytes: int) -> Iterator[str]:
    """`path` (created) as a tmpfs of `size_bytes`, unmounted afterwards; skips the test where this process is not
    root, fails it where root cannot mount."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("not root: the full-disk tests mount a small tmpfs, which needs root (CI runs them as root)")
    if shutil.which("mount") is None:
        pytest.fail("no mount command: the full-disk tests mount a small tmpfs (install util-linux's mount)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", path], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.fail(f"root could not mount a tmpfs at {path} ({proc.stderr.strip() or proc.returncode}): the "
                    f"full-disk tests need the mount capability (a container: --cap-add SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)
