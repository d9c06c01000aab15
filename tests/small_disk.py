"""A small, real file system for the tests of a full disk: a tmpfs of a few MiB, mounted for one test and always
unmounted, and a file that fills it to the free space a test asks for.

On a tmpfs a write fails as on any full disk (``ENOSPC``, from the kernel, whichever library writes),
``statvfs`` says what is free, and what a test removes is free again at once, to the page (4 KiB).

Mounting one needs root, which the tests have on CI's machines. A user without root runs these tests as root
of a user and mount namespace of their own, where the mount is theirs alone::

    unshare --user --map-root-user --mount python -m pytest tests/training/test_full_disk.py

(:func:`mountable` says so when it is neither). What could make writes fail without root does not behave like
a full disk, and is not used: ``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored refuses a write past a size with
``EFBIG`` (a file too large, not a disk full), per file, while ``statvfs`` still shows the space free, so
neither the message's numbers nor the resume's space check would be tried; an ``LD_PRELOAD`` shim or a patched
``write`` is an injected fault, which proves only the injection.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

#: the size of a tmpfs page: what a file takes is a multiple of it
PAGE = 4096


def mountable() -> str | None:
    """Why this process cannot mount a tmpfs (None when it can: it is root, perhaps of a user namespace)."""
    if os.geteuid() != 0:
        return ("mounting a small tmpfs needs root: run these tests as root, or in a user and mount namespace of "
                "their own: unshare --user --map-root-user --mount python -m pytest ...")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount and umount are not installed (util-linux)"
    return None


@contextlib.contextmanager
def small_disk(folder: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` MiB mounted on ``folder`` (made if needed) for the block; unmounted afterwards
    whatever happened (lazily if a process the test started still holds a file there: it is then detached at
    once and freed when that process lets go)."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755", "tmpfs", str(folder)],
                   check=True, capture_output=True, text=True)
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(folder)], check=True, capture_output=True)


def free(disk: Path) -> int:
    """The bytes free on ``disk``'s file system."""
    return shutil.disk_usage(disk).free


def fill(disk: Path, leave: int) -> Path:
    """Make ``disk/filler`` take all of the free space of ``disk`` but ``leave`` bytes (to the page below);
    remove it to free the space again."""
    filler = disk / "filler"
    size = free(disk) - leave
    if size <= 0:
        raise ValueError(f"{disk} has {free(disk)} bytes free: it cannot be filled to leave {leave}")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # pages taken for real (a sparse file would take none)
    finally:
        os.close(fd)
    return filler
