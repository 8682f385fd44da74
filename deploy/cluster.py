"""N radixmux instances and one cache-aware router in front: one command, one URL.

Run from the repository root (like the benchmarks)::

    python -m deploy.cluster --instances 2 --model smollm2
    python deploy/cluster.py --instances 2 --model smollm2 -- --kv-cache-bytes 4294967296
    python -m deploy.cluster --worker-url http://10.0.0.5:30000 --worker-url http://10.0.0.6:30000

Each local instance is ``launch.py`` with its own port, runtime directory,
KV arena and disk-tier folder (flags after ``--`` go to every instance). Instances on other hosts
are given by URL instead (``--worker-url``; start them there with
``--host 0.0.0.0`` and, past a trusted network, ``--api-key``). Once every
instance and the router answer ``/health`` the router's URL is printed; an
instance that dies is started again on its port (the router takes it back);
SIGHUP restarts the local instances one at a time, each drained first (no
request lost); Ctrl-C or SIGTERM stops the router, then the instances.
docs/cluster.md has the recipe, the router choice and the Kubernetes manifest.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.processes import Cluster
from deploy.specs import ROUTERS, InstanceSpec, RouterSpec


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m deploy.cluster",
        description="Start N radixmux instances and one router in front of them.",
        epilog="Flags after '--' go to every local instance's launch.py.",
    )
    p.add_argument("--instances", type=int, default=2, help="local instances (default 2)")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="a --model of launch.py that every local instance serves (repeat for several)",
    )
    p.add_argument(
        "--instance-models",
        action="append",
        default=[],
        metavar="M[+M...]",
        help="one local instance's --model values, '+' between them (repeat: one per "
        "instance, in place of --instances/--model); instances serving different "
        "models need --router vllm, which routes by the model field, one model each",
    )
    p.add_argument("--base-port", type=int, default=31000, help="instance i serves base-port+i")
    p.add_argument("--instance-host", default="127.0.0.1", help="--host of the local instances")
    p.add_argument(
        "--worker-url",
        action="append",
        default=[],
        help="an instance on another host, already started there (repeat; no local ones "
        "unless --instances is given too)",
    )
    p.add_argument("--router", choices=sorted(ROUTERS), default="sglang")
    p.add_argument("--policy", default="cache_aware", help="the router's --policy")
    p.add_argument("--port", type=int, default=30000, help="the router's port")
    p.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    p.add_argument("--api-key", help="the instances' --api-key (the router sends it to them)")
    p.add_argument(
        "--state-dir", type=Path, default=Path("cluster-state"), help="logs and runtime dirs"
    )
    p.add_argument("--no-restart", action="store_true", help="leave a dead instance down")
    p.add_argument(
        "--router-arg", action="append", default=[], help="one more router flag: --router-arg=--x=1"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = p.parse_args(argv)
    args.launch_args = extra
    if args.worker_url and "--instances" not in argv:
        args.instances = 0
    if args.instance_models:
        if args.model:
            p.error("--instance-models replaces --model")
        args.instances = len(args.instance_models)
    sets = {frozenset(m.split("+")) for m in args.instance_models}
    args.by_model = len(sets) > 1
    if args.by_model and args.router != "vllm":
        p.error("instances serving different models need --router vllm (routes by model)")
    if args.instances + len(args.worker_url) == 0:
        p.error("nothing to route to: --instances 0 and no --worker-url")
    return args


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The cluster the command line describes."""
    state = args.state_dir.resolve()
    extra = list(args.launch_args)
    if args.api_key:
        extra += ["--api-key", args.api_key]
    models = [m.split("+") for m in args.instance_models] or [args.model] * args.instances
    specs = [
        InstanceSpec(
            port=args.base_port + i,
            models=tuple(models[i]),
            state_dir=state / f"instance-{i}",
            host=args.instance_host,
            extra_args=tuple(extra),
        )
        for i in range(args.instances)
    ]
    router = RouterSpec(
        kind=args.router,
        port=args.port,
        worker_urls=tuple([s.url for s in specs] + args.worker_url),
        policy=args.policy,
        by_model=args.by_model,
        host=args.host,
        api_key=args.api_key,
        extra_args=tuple(args.router_arg),
    )
    return Cluster(specs, router, state / "logs", remote_urls=args.worker_url)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cluster = cluster_from_args(args)
    # The children run in sessions of their own: a Ctrl-C at the terminal reaches
    # only this process, which stops them in order. SIGINT set explicitly: a shell
    # starting this in the background would have it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    roll = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: roll.set())
    try:
        url = cluster.start()
        workers = " ".join(cluster.router_spec.worker_urls)
        print(f"radixmux cluster: router {url} ({args.router}) -> {workers}", flush=True)
        while True:
            time.sleep(1.0)
            if roll.is_set():
                roll.clear()
                print("rolling restart: one instance at a time", flush=True)
                cluster.rolling_restart()
                print("rolling restart done", flush=True)
            if cluster.router is not None and cluster.router.proc.poll() is not None:
                print(f"router exited: {cluster.router.log_tail()}", file=sys.stderr)
                return 1
            for i in cluster.dead_instances():
                print(f"instance {i} exited: {cluster.instances[i].log_tail()}", file=sys.stderr)
                if args.no_restart:
                    cluster.instances[i].stop()  # closes its log
                    cluster.instances[i] = None
                else:
                    cluster.restart_instance(i)
                    cluster.rejoin(i)
                    print(f"instance {i} restarted on port {cluster.specs[i].port}", flush=True)
    except KeyboardInterrupt:
        print("radixmux cluster: stopping", file=sys.stderr)
        return 130
    finally:
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
