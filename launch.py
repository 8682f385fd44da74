"""Start a radixmux server: ``python launch.py [flags]`` (see ``--help``).

Starts every process (scheduler, runners, detokenizer, tokenizer workers, HTTP
front), prints one line saying where it serves and which models, and serves
until SIGINT/SIGTERM. Exits non-zero when start-up fails or a core process dies.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from radixmux.common.process import setup_logging
    from radixmux.common.server_args import parse_args
    from radixmux.runtime.launcher import Launcher, LaunchError

    args = parse_args(argv)
    log = setup_logging(args.log_level, "launcher")
    launcher = Launcher(args)
    # During start-up a signal interrupts the wait for ready messages (and
    # start() cleans up); once serving it only asks the monitor loop to return,
    # and stop() then shuts everything down in order.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        launcher.start()
    except LaunchError as exc:
        print(f"radixmux: failed to start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("radixmux: interrupted during start-up; stopped", file=sys.stderr)
        return 130
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: launcher.request_stop())
    models = ", ".join(f"{m.name} ({m.folder})" for m in launcher.served)
    print(
        f"radixmux serving http://{launcher.args.host}:{launcher.args.port} "
        f"(ZeroMQ client: {launcher.endpoints.client}) models: {models}",
        flush=True,
    )
    code = 1
    try:
        code = launcher.wait()
    finally:
        log.info("shutting down")
        launcher.stop()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
