"""Shared by the benchmarks: how a script's section of BENCHMARKS.md is laid out, printed and written.

Every benchmark prints its section (heading, machine, date, command, tables, a few lines of
reading) to stdout, and writes it into a file only when given ``--output FILE``: there it
replaces the section of the same script (one per script: its latest run), or is appended, and every
other section is kept.

Shell scripts use it as a command, the section's body on stdin:

    ... | python benchmarks/report.py --heading "## Name (benchmarks/x.sh)" --command "bash ..." [--output FILE]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
NEW_FILE = "# Benchmarks\n\n"


def machine() -> str:
    """One line: the GPUs (with cuDNN, its frontend, FlashAttention-4) or the CPU; torch's and Python's versions."""
    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
        major, minor = divmod(torch.backends.cudnn.version() // 100, 100)
        device += f", cuDNN {major}.{minor}"
        try:
            import cudnn  # the ``gpu`` extra

            device += f", cudnn-frontend {cudnn.__version__}"
        except (ImportError, OSError):
            pass
        try:  # the ``fa4`` extra, without importing it (seconds)
            device += f", flash-attn-4 {importlib.metadata.version('flash-attn-4')}"
        except importlib.metadata.PackageNotFoundError:
            pass
    else:
        device = f"{_cpu_name()} x {os.cpu_count()} ({platform.machine()})"
    return f"{device}, torch {torch.__version__}, Python {platform.python_version()}"


def _cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("model name")]
    return names[0] if names else platform.processor() or "CPU"


def command() -> str:
    """How this process was started, as a command run from the repository root."""
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])


def header(heading: str, *, run_command: str | None = None) -> list[str]:
    """A section's first lines: its heading, then machine, date and command."""
    return [
        heading,
        "",
        f"- machine: {machine()}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `{' '.join(map(_portable, (run_command or command()).split(' ')))}`",
        "",
    ]


def _portable(arg: str) -> str:
    """A path into a ``doclens`` folder as ``$DOCLENS/...``: the length files live outside the repository, and
    BENCHMARKS.md names only what it contains (its preamble says what ``$DOCLENS`` holds)."""
    option, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    parts = Path(value).parts
    if "doclens" not in parts:
        return arg
    return option + eq + "/".join(("$DOCLENS", *parts[parts.index("doclens") + 1 :]))


def add_output_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output",
        metavar="FILE",
        default=None,
        help="also write this script's section into FILE (e.g. BENCHMARKS.md), replacing the script's section "
        "there; default (or '-'): print only",
    )


def publish(heading: str, lines: list[str], output: str | None) -> None:
    """Print the section; write it into ``output`` too where one is given (not ``-``)."""
    text = "\n".join(lines).rstrip("\n") + "\n"
    print(text, end="", flush=True)
    if output and output != "-":
        write_section(Path(output), heading, text)
        print(f"wrote {heading!r} into {output}", file=sys.stderr)


def write_section(path: Path, heading: str, text: str) -> None:
    """Put ``text`` in place of the section of ``path`` that the same script wrote (or append it), keeping the others.

    A section belongs to the script its ``## heading`` names in parentheses, ``(benchmarks/x.py ...)``: the file
    holds one section per script, its latest run, so every section of that script goes and ``text`` takes the
    first one's place.
    """
    old = path.read_text() if path.exists() else NEW_FILE
    script = _script(heading)
    parts = re.split(r"(?m)^(?=## )", old)
    kept, placed = [parts[0]], False
    for part in parts[1:]:
        first = part.split("\n", 1)[0]
        if first == heading or (script is not None and _script(first) == script):
            if not placed:
                kept.append(text.rstrip("\n") + "\n\n")
                placed = True
            continue
        kept.append(part)
    if not placed:
        kept[-1] = kept[-1].rstrip("\n") + "\n\n"
        kept.append(text)
    path.write_text("".join(kept).rstrip("\n") + "\n")


def _script(heading: str) -> str | None:
    """The benchmark script a section heading names, ``benchmarks/x.py`` in ``## Name (benchmarks/x.py ...)``."""
    found = re.search(r"\((benchmarks/[\w./-]+)", heading)
    return found.group(1) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description="Print (and with --output write) a section whose body is stdin.")
    parser.add_argument("--heading", required=True, help="the section's heading, '## Name (script)'")
    parser.add_argument("--command", required=True, help="the command that produced the body")
    add_output_argument(parser)
    args = parser.parse_args()
    publish(args.heading, [*header(args.heading, run_command=args.command), sys.stdin.read()], args.output)


if __name__ == "__main__":
    main()
