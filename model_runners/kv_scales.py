"""Per-layer scales for a float8 KV arena (``--kv-cache-dtype fp8``).

float8 e4m3 keeps 3 mantissa bits between 2^-6 and 448; below 2^-6 its
steps are a fixed 2^-9, so small values lose their relative precision
(SmolLM2's first-layer V: median 0.018, 44% of values under 2^-6). Each
layer's K and V are therefore stored divided by a scale that puts the
layer's largest value (seen on a fixed calibration text, times a margin for
larger ones later) at 448, and the attention multiplies it back: K's scale
folds into the softmax scale, V's multiplies the output. A value past the
margin saturates at 448 (``KVStore.write`` clamps).

The scales come from one forward pass over ``CALIBRATION_TEXT`` at load, with
transformers' SDPA attention wrapped to record each layer's largest |K| and
|V|. The same weights give the same scales, so replicas and reloads agree on
what the arena's bytes mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from radixmux.model_runners.kv_store import FP8_MAX
from radixmux.model_runners.paged_attention import set_attention

CALIBRATE_NAME = "radixmux_kv_calibrate"
# Head room above the calibration text's largest value.
MARGIN = 2.0
CALIBRATION_TEXT = (
    "The history of science is the study of the development of science and scientific "
    "knowledge. def main(argv):\n    total = sum(int(x) for x in argv[1:])\n    print(total)\n"
    "Q: What is 17 times 23? A: 391. Les langues romanes sont issues du latin vulgaire. "
    '{"name": "radixmux", "tokens": [1, 2, 3], "ok": true} 1984, 2001; 3.14159; #ff8800. '
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "told the children stories of storms, stars and the long way home."
)

_seen: dict[int, list[float]] = {}  # layer -> [max |K|, max |V|] while calibrating


def _calibrating_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA attention that records the layer's largest |K| and |V| on the way."""
    seen = _seen.setdefault(module.layer_idx, [0.0, 0.0])
    seen[0] = max(seen[0], key.detach().abs().max().item())
    seen[1] = max(seen[1], value.detach().abs().max().item())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CALIBRATE_NAME, _calibrating_attention)


@torch.inference_mode()
def calibrate(
    model: torch.nn.Module, tokenizer: object | None, num_layers: int
) -> tuple[list[float], list[float]]:
    """Per-layer K and V scales of ``model`` for a float8 arena (module doc).

    Without a tokenizer the calibration text's bytes stand in for token ids.
    The model's attention is set back to what it was.
    """
    if tokenizer is not None:
        ids = tokenizer(CALIBRATION_TEXT, return_tensors="pt").input_ids
    else:
        vocab = int(getattr(model.config, "vocab_size", 256))
        ids = torch.tensor([[b % vocab for b in CALIBRATION_TEXT.encode()]])
    device = next(model.parameters()).device
    _seen.clear()
    was = model.config._attn_implementation
    set_attention(model, CALIBRATE_NAME)
    try:
        model(input_ids=ids.to(device))
    finally:
        set_attention(model, was)
    seen = [_seen.get(layer, [0.0, 0.0]) for layer in range(num_layers)]
    _seen.clear()
    return _scales([s[0] for s in seen]), _scales([s[1] for s in seen])


def _scales(largest: Sequence[float]) -> list[float]:
    """A scale per layer: its largest value times MARGIN maps to FP8_MAX (1.0
    for a layer that saw only zeros)."""
    return [m * MARGIN / FP8_MAX if m > 0 else 1.0 for m in largest]
