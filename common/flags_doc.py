"""``docs/flags.md``, generated from the one flag set (``server_args.build_parser``).

    python -m radixmux.common.flags_doc > docs/flags.md

``tests/test_docs.py`` fails when the file and this output differ, so the
reference cannot drift from ``launch.py --help``: both read the same parser.
"""

from __future__ import annotations

import argparse

from radixmux.common.server_args import DEFAULT_MODEL, build_parser

# Topics a reader looks a flag up by. A flag of the parser named in no group
# lands in "Other"; a name here that the parser lacks is an error.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Models",
        (
            "--model",
            "--models-file",
            "--dtype",
            "--device",
            "--chat-template",
            "--attention-backend",
            "--disable-fused-ops",
            "--runner-threads",
            "--runner-start",
            "--tokenizer-workers",
            "--seed",
        ),
    ),
    (
        "HTTP server and access",
        (
            "--host",
            "--port",
            "--api-key",
            "--allowed-hosts",
            "--allowed-origins",
            "--max-request-bytes",
            "--incremental-streaming-output",
            "--zmq-endpoint",
            "--runtime-dir",
            "--log-level",
        ),
    ),
    (
        "Scheduling",
        (
            "--schedule-policy",
            "--max-running-requests",
            "--max-queued-requests",
            "--chunked-prefill-size",
            "--prefill-tokens-during-decode",
            "--prefill-wait-ratio",
            "--schedule-conservativeness",
        ),
    ),
    (
        "KV arena and prefix cache",
        (
            "--kv-cache-bytes",
            "--kv-block-bytes",
            "--page-size",
            "--kv-partition",
            "--disable-layer-sharing",
            "--eviction-policy",
            "--disable-radix-cache",
            "--warmup",
            "--max-pinned-fraction",
            "--check-invariants",
        ),
    ),
    (
        "Disk tier",
        (
            "--kv-disk-bytes",
            "--kv-disk-dir",
            "--kv-disk-write-policy",
            "--kv-disk-chunk-tokens",
            "--kv-disk-min-load-tokens",
            "--kv-disk-timeout",
            "--kv-disk-shared",
        ),
    ),
    (
        "Supervision and models at run time",
        (
            "--runner-timeout",
            "--memory-reserve-bytes",
            "--drain-timeout",
            "--model-load-timeout",
            "--max-loaded-models",
            "--max-weights-bytes",
            "--idle-unload-seconds",
        ),
    ),
)

HEADER = """\
# Flags

Generated from `common/server_args.py` by
`python -m radixmux.common.flags_doc > docs/flags.md`: do not edit by hand
(`tests/test_docs.py` fails when this file and the parser differ).
`python launch.py --help` prints the same flags; the Python `Engine` takes
them as keywords (`ServerArgs` field names: `kv_cache_bytes=...`).
[HTTP API](http-api.md) says more about the access flags and models at run
time, [architecture](architecture.md) about the arena, scheduler and disk tier.
"""

MIB = 1 << 20


def _default(action: argparse.Action) -> str:
    """A flag's default as the table shows it."""
    value = action.default
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.dest == "model":  # empty on the command line: ServerArgs fills it in
        return DEFAULT_MODEL
    if value is None or value == []:
        return "none"
    text = str(value)
    if isinstance(value, int) and action.dest.endswith("_bytes") and value and value % MIB == 0:
        mib = value // MIB
        text += f" ({mib // 1024} GiB)" if mib % 1024 == 0 else f" ({mib} MiB)"
    return text


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    name = action.option_strings[-1]
    if action.metavar:
        name += f" {action.metavar}"
    return f"`{name}`"


def _grouped(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    actions = {
        a.option_strings[-1]: a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    }
    groups = []
    for title, names in GROUPS:
        missing = [n for n in names if n not in actions]
        if missing:
            raise KeyError(f"flags_doc.GROUPS names flags the parser lacks: {missing}")
        groups.append((title, [actions.pop(n) for n in names]))
    if actions:
        groups.append(("Other", list(actions.values())))
    return groups


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole ``docs/flags.md``: a header, then one table per group."""
    parser = parser or build_parser()
    parts = [HEADER]
    for title, actions in _grouped(parser):
        rows = [f"## {title}", "", "| flag | default | meaning |", "|---|---|---|"]
        rows += [f"| {_flag(a)} | {_cell(_default(a))} | {_cell(a.help or '')} |" for a in actions]
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
