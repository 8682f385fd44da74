"""Load a model for serving: by short name, from a local HF folder, or a GGUF file."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from radixmux.common.tokenizer_load import load_tokenizer
from radixmux.memory.layout import KVLayout
from radixmux.model_runners.fetch import resolve
from radixmux.model_runners.fingerprint import (
    kv_share_key,
    layer_chain,
    tokenizer_fingerprint,
)
from radixmux.model_runners.fused_ops import fuse_model
from radixmux.model_runners.info import eos_ids, sliding_windows
from radixmux.model_runners.packed_linear import pack_linear_weights
from radixmux.protocol import ModelInfo

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and the ``ModelInfo`` describing them."""

    model: Any
    tokenizer: Any
    info: ModelInfo
    source: str
    load_seconds: float


def kv_layout(config: Any, dtype: str) -> KVLayout:
    """The arena layout one token of this model needs, K/V stored in ``dtype``."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVLayout(config.num_hidden_layers, kv_heads, head_dim, dtype)


def describe(
    model: Any, tokenizer: Any, name: str, dtype: str, device: str, kv_dtype: str | None = None
) -> ModelInfo:
    """Build the ``ModelInfo`` (layout, limits, fingerprints) of a loaded model;
    its K/V stored in ``kv_dtype`` (default: the model's ``dtype``)."""
    config = model.config
    return ModelInfo(
        name=name,
        architecture=type(model).__name__,
        layout=kv_layout(config, kv_dtype or dtype),
        context_length=int(getattr(config, "max_position_embeddings", 0) or 0),
        sliding_windows=sliding_windows(config),
        vocab_size=int(config.vocab_size),
        eos_token_ids=eos_ids(config, getattr(model, "generation_config", None), tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer) if tokenizer is not None else "",
        kv_share_key=kv_share_key(model),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        dtype=dtype,
        device=device,
        weight_bytes=weight_bytes(model),
        layer_keys=layer_chain(model),
        hidden_size=int(getattr(getattr(config, "text_config", None) or config, "hidden_size", 0)),
    )


def weight_bytes(model: Any) -> int:
    """Bytes of ``model``'s parameters and buffers (a tensor shared by two
    modules, as tied embeddings are, counted once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.nbytes for t in tensors.values())


def load_model(
    source: str,
    dtype: str = "float32",
    device: str = "cpu",
    name: str | None = None,
    attn_implementation: str | None = None,
    pack_weights: bool = True,
    fuse_ops: bool = True,
    amx_linear: bool = True,
    onednn_copy: bool = False,
    deterministic: bool = False,
    kv_dtype: str | None = None,
) -> LoadedModel:
    """Load ``source`` (short name, HF folder or GGUF file) in ``dtype`` on ``device``.

    ``attn_implementation`` is transformers' own (default: its choice) and only
    matters for plain use of ``model``; a ``ModelRunner`` switches it to paged.
    ``pack_weights`` puts CPU linear weights in oneDNN's layout (see
    ``packed_linear.py``) and ``fuse_ops`` swaps in the fused RMSNorm, gated
    MLP and rotary kernels (``fused_ops.py``) and, with ``amx_linear`` too,
    runs small bfloat16 products on the small-batch kernel (AMX tiles, or
    AVX512-BF16 dot products) where the CPU has one (``onednn_copy``: only up
    to its row limits, oneDNN above; ``deterministic``: linear layers whose
    per-row results do not depend on the row count, ``packed_linear.py``); the
    fingerprints are taken before all of it, from the weights as stored.
    """
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {sorted(DTYPES)}")
    t0 = time.perf_counter()
    folder, gguf = resolve(source)
    extra = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = load_tokenizer(folder / gguf if gguf else folder)
    except (OSError, ValueError, TypeError):
        # A weights-only folder (e.g. a test model): the runner needs only ids;
        # its tokenizer fingerprint is then empty and matches nothing.
        tokenizer = None
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=DTYPES[dtype], attn_implementation=attn_implementation, **extra
    )
    model.to(device).eval()
    info = describe(model, tokenizer, name or source, dtype, device, kv_dtype)
    if fuse_ops and device == "cpu":
        fuse_model(model)
    if pack_weights and device == "cpu":
        pack_linear_weights(
            model,
            amx=fuse_ops and amx_linear,
            onednn_copy=onednn_copy,
            deterministic=deterministic,
        )
    return LoadedModel(model, tokenizer, info, source, time.perf_counter() - t0)
