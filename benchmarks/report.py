"""Shared by the benchmarks: the machine they ran on and their BENCHMARKS.md sections."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def machine() -> str:
    """One line: date, host CPU or GPU (with cuDNN and its frontend), torch version."""
    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
        major, minor = divmod(torch.backends.cudnn.version() // 100, 100)
        device += f", cuDNN {major}.{minor}"
        try:
            import cudnn  # the ``gpu`` extra

            device += f", cudnn-frontend {cudnn.__version__}"
        except (ImportError, OSError):
            pass
    else:
        device = f"CPU ({os.cpu_count()} cores, {platform.machine()})"
    return f"{datetime.date.today()}, {device}, torch {torch.__version__}"


def command() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])


def write_section(path: Path, heading: str, text: str) -> None:
    """Replace the ``## heading`` section of ``path`` with ``text`` (or append it), keeping the others."""
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = old.find(heading)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(heading))
        new = old[:start] + text + ("" if end < 0 else old[end:])
    path.write_text(new.rstrip("\n") + "\n")
