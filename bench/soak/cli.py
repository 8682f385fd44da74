"""The soak's command line: flags to a config, the server started and stopped around the run."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import bench.soak
from bench.server_process import ServerFailed, free_port
from bench.soak.config import REAL, RESULTS_DIR, TINY, SoakConfig
from bench.soak.hostile.config import prepare as prepare_hostile
from bench.soak.run import soak
from bench.soak.server import SoakServer, model_sources, server_command


def parse_args(argv: Sequence[str] | None = None) -> SoakConfig:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=bench.soak.__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    p.add_argument("--tiny", action="store_true", help="two tiny random-weight models (tests)")
    p.add_argument(
        "--kill-every",
        type=float,
        default=None,
        help=f"seconds between runner kills (default {TINY.kill_every_s:g} tiny, "
        f"{REAL.kill_every_s:g} real)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR / "soak.json",
        help="JSON path (or a folder: soak.json in it); the PNG and the server log go beside it",
    )
    p.add_argument(
        "--runner-timeout",
        type=float,
        default=60.0,
        help="the server's --runner-timeout (0: do not pass it, for older servers)",
    )
    p.add_argument("--server-args", default="", help="extra launch.py flags, one string")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default=None,
        help="the models' dtype (default float32): the greedy probe holds the correctness "
        "contract, which is float32's; in bfloat16 a prefix prefilled in other chunks, or a "
        "decode in another cascade group, rounds differently and near-ties flip (README), "
        "the more often in the tiny random-weight models",
    )
    p.add_argument(
        "--hostile",
        action="store_true",
        help="hostile clients beside the load, with the disk tier on (bench/soak/hostile/)",
    )
    a = p.parse_args(argv)
    profile = TINY if a.tiny else REAL
    port = a.port or free_port()
    return SoakConfig(
        minutes=a.minutes,
        tiny=a.tiny,
        kill_every_s=a.kill_every or profile.kill_every_s,
        seed=a.seed,
        port=port,
        out=a.out / "soak.json" if a.out.is_dir() else a.out,  # a folder: soak.json in it
        runner_timeout_s=a.runner_timeout,
        server_args=tuple(a.server_args.split()),
        profile=profile,
        dtype=a.dtype or "float32",
        hostile=a.hostile,
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    if config.hostile:
        config = prepare_hostile(config)
    sources = model_sources(config.tiny)
    cmd = server_command(config, sources)
    print(f"[soak] starting {' '.join(cmd)}", flush=True)
    server = SoakServer(cmd, config.port, config.log)
    # SIGTERM stops the run like Ctrl-C: the finally below then stops the server,
    # which would otherwise outlive us.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return asyncio.run(soak(config, server, sources))
    except ServerFailed as exc:
        print(f"[soak] FAIL: server did not start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[soak] interrupted", file=sys.stderr)
        return 130
    finally:
        server.stop()  # idempotent: a no-op once the run stopped it
