"""What a model's config says about its attention windows and end tokens (for ``ModelInfo``)."""

from __future__ import annotations

from typing import Any


def sliding_windows(config: Any) -> list[int | None]:
    """Per-layer attention windows as the config declares them."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types[:n]]
    if window and getattr(config, "use_sliding_window", True):
        return [window] * n
    return [None] * n


def eos_ids(config: Any, generation_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a generation: generation config, model config, tokenizer."""
    found: list[int] = []
    for src in (generation_config, config, tokenizer):
        value = getattr(src, "eos_token_id", None) if src is not None else None
        values = value if isinstance(value, (list, tuple)) else [value]
        found.extend(int(v) for v in values if v is not None and int(v) not in found)
    return found
