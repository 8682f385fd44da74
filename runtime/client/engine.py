"""``Engine``: the whole runtime in-process, for offline batches from Python.

::

    with Engine(model=["smollm2"]) as engine:
        outs = engine.generate(["Hello", "The capital of France is"], {"max_new_tokens": 16})

It starts the same processes as ``launch.py`` (through :class:`Launcher`) and
sends each prompt through the ZeroMQ client, concurrently, so the scheduler
batches them. Flags are the ``ServerArgs`` field names; ``model`` takes
``--model`` strings, ``models_file`` a ``--models-file`` path.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixmux.common.model_entry import parse_model_arg, read_models_file
from radixmux.common.server_args import ServerArgs
from radixmux.protocol import ModelArg
from radixmux.runtime.client.client import Client, Completion
from radixmux.runtime.launcher import Launcher

MAX_IN_FLIGHT = 64  # concurrent requests an Engine keeps open


def args_from_flags(flags: dict[str, Any]) -> ServerArgs:
    """``ServerArgs`` from keyword flags; ``model`` / ``models`` may be ``--model`` strings."""
    flags = dict(flags)
    models = flags.pop("model", None) or flags.pop("models", None) or []
    if isinstance(models, (str, ModelArg)):
        models = [models]
    flags["models"] = [m if isinstance(m, ModelArg) else parse_model_arg(m) for m in models]
    if (path := flags.pop("models_file", None)) is not None:
        flags["models"] += read_models_file(path)
    flags.setdefault("port", 0)  # a free port: the HTTP front runs too
    return ServerArgs(**flags)


class Engine:
    """Start a runtime on construction; ``generate`` prompts; ``shutdown`` at the end."""

    def __init__(self, args: ServerArgs | None = None, **flags: Any) -> None:
        if args is not None and flags:
            raise TypeError("pass either a ServerArgs or keyword flags, not both")
        args = args if args is not None else args_from_flags(flags)
        self.launcher = Launcher(args)
        self.launcher.start()
        self.args = self.launcher.args
        # Loaded and on demand alike: a request for a registered model loads it.
        self.models = [m.name for m in self.launcher.served]
        self.models += [m.name for m in self.args.on_demand_models]
        self._local = threading.local()
        self._clients: list[Client] = []
        self._lock = threading.Lock()
        # Long-lived threads, so each keeps its one client across calls.
        self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="radixmux-engine")
        # The launcher's monitor: reports dead runners to the scheduler (their
        # model's requests then fail instead of hanging).
        self._monitor = threading.Thread(
            target=self.launcher.wait, name="radixmux-monitor", daemon=True
        )
        self._monitor.start()

    def _client(self) -> Client:
        """One ZeroMQ client per thread (ZeroMQ sockets are not thread-safe)."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = Client(self.launcher.endpoints.client, self.args.api_key)
            with self._lock:
                self._clients.append(client)
        return client

    def generate(
        self,
        prompts: str | Sequence[str],
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        model: str | None = None,
    ) -> list[Completion]:
        """Generate for every prompt (one result each, in order).

        ``sampling_params`` is one dict for all prompts or one per prompt;
        ``model`` defaults to the first served model.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, dict):
            params = [dict(sampling_params or {})] * len(prompts)
        else:
            params = [dict(p) for p in sampling_params]
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling_params")
        name = model or self.models[0]
        if name not in self.models:
            raise ValueError(f"model {name!r} is not served; served: {', '.join(self.models)}")
        if not prompts:
            return []

        def one(i: int) -> Completion:
            return self._client().generate(name, prompt=prompts[i], **params[i])

        return list(self._pool.map(one, range(len(prompts))))

    def shutdown(self) -> None:
        """Stop every process and remove the runtime's files (idempotent)."""
        self._pool.shutdown(wait=True)
        self.launcher.request_stop()
        self._monitor.join()  # it uses the launcher's sockets: done before stop()
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()
        self.launcher.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
