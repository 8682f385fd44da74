"""The server under soak: its command line, its model sources, the process that runs it."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.server_process import ServerProcess
from bench.soak.config import MODEL_NAMES, REAL_SOURCES, ROOT, SoakConfig
from bench.soak.hostile.config import server_flags as hostile_server_flags
from bench.soak.procfs import is_alive, parent_pid, process_role


class SoakServer(ServerProcess):
    """``launch.py`` under soak, and the processes it runs."""

    def __init__(self, cmd: list[str], port: int, log_path: Path) -> None:
        super().__init__(cmd, port, log_path)
        self._roles: dict[int, str] = {}

    def processes(self) -> dict[int, str]:
        """The launcher and its live children, and the runners its zygote forked,
        pid -> role (``runner a#0``, ``front``, ...)."""
        found = {self.pid: "launcher"} if is_alive(self.pid) else {}
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
        parents = {pid: parent_pid(pid) for pid in pids}
        for pid, parent in sorted(parents.items(), key=lambda p: p[1] != self.pid):
            if parent != self.pid and found.get(parent) != "zygote":
                continue
            if pid not in self._roles:
                self._roles[pid] = process_role(pid)
            found[pid] = self._roles[pid]
        # Forget the dead: a reused pid must not inherit an old role.
        self._roles = {pid: role for pid, role in self._roles.items() if pid in found}
        return found


def arena_bytes(config: SoakConfig) -> int:
    """The profile's arena, scaled to the same tokens when the real models run in float32."""
    scale = 2 if config.dtype == "float32" and not config.tiny else 1
    return config.profile.kv_cache_bytes * scale


def server_command(config: SoakConfig, sources: Sequence[str]) -> list[str]:
    """The ``launch.py`` command line for this run."""
    cmd = [sys.executable, str(ROOT / "launch.py")]
    for name, source in zip(MODEL_NAMES, sources, strict=True):
        dtype = f",dtype={config.dtype}" if config.dtype else ""
        cmd += ["--model", f"{source},name={name}{dtype}"]
    cmd += [
        "--kv-cache-bytes",
        str(arena_bytes(config)),
        "--kv-block-bytes",
        str(config.profile.kv_block_bytes),
        "--port",
        str(config.port),
        "--log-level",
        "info",
        "--seed",
        str(config.seed),
    ]
    if config.runner_timeout_s > 0:
        cmd += ["--runner-timeout", f"{config.runner_timeout_s:g}"]
    if config.hostile:
        cmd += hostile_server_flags(config)
    return [*cmd, *config.server_args]


def model_sources(tiny: bool) -> list[str]:
    """Tiny random models (made once under the model cache) or the embedded real ones."""
    if not tiny:
        return list(REAL_SOURCES)
    from bench.tiny_models import make_tiny_model_dir
    from radixmux.model_runners.fetch import cache_root

    base = cache_root() / "soak-tiny"
    # ``b`` has no chat template, like Gemma 3 270M (a base model); the context is
    # long enough for any request the load sends.
    return [
        str(make_tiny_model_dir(base / "a-ctx4096", seed=41, context=4096)),
        str(make_tiny_model_dir(base / "b-ctx4096", seed=42, context=4096, chat_template=False)),
    ]
