"""Whether a process of this host is alive: for the records of processes that may have died without a word (a run
row, a GPU or queue lock, a file handed to a trial process). Imports nothing from autofuse."""
from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path


def pid_alive(pid: int, started_at: _dt.datetime | None = None) -> bool:
    """Whether *pid* is a live process on this host (that may be the one that started at *started_at*).

    Zombies count as dead; on Linux a process that started more than a few
    seconds after *started_at* is a reused pid, so also dead.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        text = stat.read_text()
    except OSError:
        return True  # not Linux, or raced with its exit: trust kill(0)
    fields = text[text.rfind(")") + 2 :].split()
    if fields and fields[0] in ("Z", "X"):
        return False
    if started_at is not None and len(fields) > 19:
        try:
            ticks = int(fields[19])  # field 22 of /proc/PID/stat: start time, clock ticks after boot
            btime = next(
                int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
            )
            proc_start = btime + ticks / os.sysconf("SC_CLK_TCK")
            if proc_start > started_at.timestamp() + 5.0:
                return False
        except (OSError, ValueError, StopIteration):
            pass
    return True
