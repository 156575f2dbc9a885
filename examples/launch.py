"""What the example scripts check before they start a process group (imported by them from this folder)."""

from __future__ import annotations

import os

#: What torchrun sets and ``init_process_group("env://")`` reads.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def require_torchrun(script: str) -> None:
    """Exit with a hint, not ``init_process_group``'s bare ``environment variable RANK expected``,
    when ``script`` (its path from the repository root) was not started by torchrun."""
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        name = os.path.basename(script)
        raise SystemExit(
            f"{name}: {', '.join(missing)} not set: this example runs one process per CP rank; "
            f"start it with torchrun --nproc-per-node 2 {script}"
        )
