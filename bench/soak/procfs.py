"""The server's processes read from /proc: alive, parent, role, resident memory."""

from __future__ import annotations

import contextlib
import json
from typing import Any


def read_proc_file(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:  # the process exited between listing and reading
        return None


def is_alive(pid: int) -> bool:
    stat = read_proc_file(f"/proc/{pid}/stat")
    return stat is not None and stat.rsplit(")", 1)[1].split()[0] != "Z"


def parent_pid(pid: int) -> int | None:
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    stat = read_proc_file(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]) if fields[0] != "Z" else None


def process_role(pid: int) -> str:
    """A runtime process's role from its command line: module, then its JSON config."""
    raw = read_proc_file(f"/proc/{pid}/cmdline") or ""
    argv = [a for a in raw.split("\0") if a]
    module = next((a for a in argv if a.startswith("radixmux.")), "")
    config: dict[str, Any] = {}
    with contextlib.suppress(ValueError, IndexError):
        config = json.loads(argv[-1])
    if module.endswith("runner_process"):
        return f"runner {config.get('runner_id', '?')}"
    if module.endswith(".zygote"):  # the zygote, or a runner forked from it (named by its id)
        comm = (read_proc_file(f"/proc/{pid}/comm") or "").strip()
        return "zygote" if comm in ("zygote", "") else f"runner {comm}"
    if isinstance(config, dict) and config.get("name"):
        return str(config["name"])
    return module.rsplit(".", 1)[-1] or f"pid {pid}"


def read_rss(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon) of ``pid`` in KiB, or None when it is gone."""
    status = read_proc_file(f"/proc/{pid}/status")
    if status is None:
        return None
    values = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            values[key] = int(rest.split()[0])
    if "VmRSS" not in values:  # a zombie has no memory lines
        return None
    return values["VmRSS"], values.get("RssAnon", 0)
