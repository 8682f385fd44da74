"""Fingerprints that decide what may be shared between models.

* The tokenizer fingerprint groups models whose token ids mean the same text
  (same vocab, merges, special tokens, normaliser): they may share radix paths.
* The weights fingerprint is the KV-share key: models with identical weights
  (replicas, aliases) produce identical K/V, so they may share arena entries.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of what maps text to ids: vocab, merges, added/special tokens, normaliser.

    Settings that do not change ids (truncation, padding, model_max_length) are
    left out so two copies of one tokenizer saved differently still match.
    """
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        for key in ("model", "normalizer", "pre_tokenizer", "added_tokens", "post_processor"):
            h.update(key.encode())
            h.update(_canonical(spec.get(key)))
    else:  # a slow (Python) tokenizer: the vocab is all we can see
        h.update(_canonical(sorted(tokenizer.get_vocab().items())))
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h.update(_canonical(specials))
    h.update(_canonical(sorted(tokenizer.all_special_ids)))
    return h.hexdigest()[:32]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """Hash over every tensor (name, dtype, shape and bytes) of the model's state.

    Computed on the weights as loaded (after the dtype cast): a float32 and a
    bfloat16 copy of one checkpoint produce different K/V and must not share.
    """
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
