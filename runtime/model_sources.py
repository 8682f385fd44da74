"""Where a ``--model`` source comes from, made local: an embedded model (fetched and
converted once), a Hugging Face folder or a GGUF file; and the launcher's error.

The launcher resolves every model at start; the model lifecycle resolves a
model loaded at run time the same way.
"""

from __future__ import annotations

import logging

import msgspec

from radixmux.common.cpu import resolve_dtype
from radixmux.common.server_args import ServerArgs
from radixmux.protocol import ModelArg

log = logging.getLogger("radixmux.launcher")


class LaunchError(RuntimeError):
    """The server could not start; the message names the process and why."""


def resolve_source(source: str) -> str:
    """A ``--model`` source as a local path: a HF folder or a ``.gguf`` file."""
    # fetch, not loader: the launcher then never imports torch.
    from radixmux.model_runners import fetch

    if source in fetch.EMBEDDED:
        try:
            return str(fetch.fetch(source, progress=True))
        except fetch.FetchError as exc:
            raise LaunchError(f"--model {source}: {exc}") from None
        except Exception as exc:  # a failed conversion: say so without a traceback
            raise LaunchError(
                f"--model {source}: fetch failed: {type(exc).__name__}: {exc}"
            ) from None
    try:
        folder, gguf = fetch.resolve(source)
    except (FileNotFoundError, OSError) as exc:
        raise LaunchError(f"--model {source}: {exc}") from None
    return str(folder / gguf) if gguf else str(folder.resolve())


def resolve_models(args: ServerArgs) -> ServerArgs:
    """``args`` with every model's source replaced by its local folder (or
    .gguf file) and its dtype made concrete (``auto`` resolved, logged); the
    on-demand ones too, so a bad source fails at start rather than at its
    first request."""
    return msgspec.structs.replace(
        args,
        models=[resolve_model(m, args.dtype) for m in args.models],
        on_demand_models=[resolve_model(m, args.dtype) for m in args.on_demand_models],
    )


def resolve_model(m: ModelArg, default_dtype: str) -> ModelArg:
    """``m`` with its source a local path and its dtype concrete."""
    dtype, why = resolve_dtype(m.dtype or default_dtype)
    log.info("model %s: dtype %s (%s)", m.name, dtype, why)
    return msgspec.structs.replace(m, source=resolve_source(m.source), dtype=dtype)
