"""A model entry: what one served model is (source, name, dtype, priority,
replicas, load mode, keep-alive), in its two spellings, checked by one function
(:func:`model_arg`) so they cannot drift.

``--model SOURCE[,name=N][,dtype=D]...``
    :func:`parse_model_arg`.
``--models-file PATH``
    :func:`read_models_file`: a JSON file of entries with the same fields::

        {"models": [
            {"source": "smollm2", "name": "chat"},
            {"source": "/models/gemma", "name": "gemma", "load": "on_demand", "keep_alive": 600}
        ]}

    (a bare list of entries is accepted too). ``source`` is required; a
    relative one that names a path beside the file is taken from there, so a
    file and its models can move together. A bad file is a start-up error
    naming the entry (its index, and its name when it has one) and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from radixmux.protocol import ModelArg

DTYPES = ("auto", "float32", "bfloat16")
MODEL_OPTIONS = ("name", "dtype", "priority", "replicas", "load", "keep_alive")
# start: loaded when the server starts; on_demand: registered, loaded by its first request.
LOAD_MODES = ("start", "on_demand")
N = TypeVar("N", int, float)


def parse_model_arg(text: str) -> ModelArg:
    """One ``--model`` flag's value, checked."""
    source, *opts = [p.strip() for p in text.split(",")]
    where = f"--model {text!r}"
    fields: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in MODEL_OPTIONS:
            use = ", ".join(f"{k}=" for k in MODEL_OPTIONS)
            raise ValueError(f"{where}: bad option {opt!r}; use {use}")
        fields[key] = value
    return model_arg(source, fields, where)


def model_arg(source: str, fields: Mapping[str, str], where: str) -> ModelArg:
    """One model entry, checked: ``fields`` are ``MODEL_OPTIONS`` as text (a
    ``--model`` flag's or a ``--models-file`` entry's); an error starts with
    ``where`` and names the field."""
    if not source:
        raise ValueError(f"{where}: empty model source")
    name = fields.get("name") or default_model_name(source)
    try:
        check_model_name(name)
    except ValueError as exc:
        raise ValueError(f"{where}: name: {exc}") from None
    dtype = fields.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"{where}: dtype must be one of {DTYPES}")
    priority = _number(fields, "priority", float, where)
    replicas = _number(fields, "replicas", int, where)
    keep_alive = _number(fields, "keep_alive", float, where)
    if not (priority is None or priority > 0):
        raise ValueError(f"{where}: priority must be > 0")
    if not (replicas is None or replicas >= 1):
        raise ValueError(f"{where}: replicas must be >= 1")
    load = fields.get("load", "start")
    if load not in LOAD_MODES:
        raise ValueError(f"{where}: load must be one of {LOAD_MODES}")
    if keep_alive is not None and not keep_alive >= 0:
        raise ValueError(f"{where}: keep_alive must be >= 0 seconds (0: never unload)")
    on_demand = load == "on_demand"
    if keep_alive is not None and not on_demand:
        raise ValueError(f"{where}: keep_alive needs load=on_demand")
    return ModelArg(
        source,
        name,
        dtype,
        1.0 if priority is None else priority,
        1 if replicas is None else replicas,
        on_demand,
        keep_alive,
    )


def _number(fields: Mapping[str, str], key: str, kind: type[N], where: str) -> N | None:
    """``fields[key]`` as a ``kind`` (None when absent); a ValueError naming it."""
    if key not in fields:
        return None
    try:
        return kind(fields[key])
    except ValueError:
        what = "an int" if kind is int else "a number"
        raise ValueError(f"{where}: {key} must be {what}, not {fields[key]!r}") from None


def default_model_name(source: str) -> str:
    """The served name of a source given none: its last path part, less ``.gguf``."""
    stem = source.rstrip("/").rsplit("/", 1)[-1]
    return stem[: -len(".gguf")] if stem.endswith(".gguf") else stem


def check_model_name(name: str) -> None:
    """Refuse a served name the runtime cannot carry: ``@`` marks a version
    (``name@v2``) and ``#`` a replica (``name#0``) inside it."""
    if not name or len(name) > 256:
        raise ValueError("a model name must have 1 to 256 characters")
    bad = sorted({c for c in name if c in "@#" or not c.isprintable() or c.isspace()})
    if bad:
        raise ValueError(f"model name {name!r} must not contain {''.join(bad)!r}")


FIELDS = ("source", *MODEL_OPTIONS)


def read_models_file(path: str) -> list[ModelArg]:
    """The model entries of ``path``, checked (ValueError naming entry and field)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--models-file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--models-file {path}: not JSON: {exc}") from None
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(
            f'--models-file {path}: expected {{"models": [entry, ...]}} or a list of entries'
        )
    base = Path(path).resolve().parent
    return [
        _entry(entry, f"--models-file {path}: models[{i}]", base) for i, entry in enumerate(entries)
    ]


def _entry(entry: Any, where: str, base: Path) -> ModelArg:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: an entry is an object with the fields {', '.join(FIELDS)}")
    if isinstance(entry.get("name"), str):
        where += f" ({entry['name']!r})"
    for key in entry:
        if key not in FIELDS:
            raise ValueError(f"{where}: unknown field {key!r}; fields: {', '.join(FIELDS)}")
    source = entry.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(
            f"{where}: field 'source' is required: a short name, HF folder or GGUF file"
        )
    fields: dict[str, str] = {}
    for key in MODEL_OPTIONS:
        value = entry.get(key)
        if value is None:  # absent or null: the default
            continue
        # JSON numbers become text for the one checker; true/false are no numbers.
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError(f"{where}: field {key!r} must be a string or a number, not {value!r}")
        fields[key] = str(value)
    beside = base / source
    if not Path(source).is_absolute() and beside.exists():
        source = str(beside)
    return model_arg(source.strip(), fields, where)
