"""Fingerprints that decide what may be shared between models.

* The tokenizer fingerprint groups models whose token ids mean the same text
  (same vocab, merges, special tokens, normaliser): they may share radix paths.
* The KV-share key: models with identical weights *and* an identical
  normalised config (replicas, aliases, copies of one folder) produce
  identical K/V, so they may share arena entries and disk-tier chunks (the
  scheduler's pool key and the disk store's namespace are derived from it).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import msgspec
import torch
import xxhash


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


class _TokenizerSpec(msgspec.Struct):
    """The parts of a Rust tokenizer's serialisation that map text to ids.

    ``model`` (vocab and merges: 13 MB of Gemma 3's 33) stays raw bytes: the
    Rust serialiser writes it in one order (vocab by id, merges by rank), so
    the bytes are already canonical, and parsing them into Python objects to
    re-encode them sorted cost 1.8 of a runner's CPU-seconds at each Gemma 3
    load. The small parts are parsed and re-encoded with sorted keys, in case
    one holds a map whose order the serialiser does not fix."""

    model: msgspec.Raw = msgspec.Raw(b"null")
    normalizer: Any = None
    pre_tokenizer: Any = None
    added_tokens: Any = None
    post_processor: Any = None


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of what maps text to ids: vocab, merges, added/special tokens, normaliser.

    Settings that do not change ids (truncation, padding, model_max_length) are
    left out so two copies of one tokenizer saved differently still match.
    Only compared between the processes of one server (never stored).
    """
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = msgspec.json.decode(backend.to_str(), type=_TokenizerSpec)
        h.update(b"model")
        h.update(spec.model)
        for key in ("normalizer", "pre_tokenizer", "added_tokens", "post_processor"):
            h.update(key.encode())
            h.update(_canonical(getattr(spec, key)))
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
    h = _tensor_hash()
    for name, tensor in sorted(model.state_dict().items()):
        _hash_tensor(h, name, tensor)
    return h.hexdigest()


# Config fields that provably cannot change K/V, left out of the KV-share key.
# A deny-list, not an allow-list: K/V depend on everything the attention and
# the layers below it read (rope theta and scaling, norm epsilon, head dims,
# windows, soft-capping, query scaling, partial rotary factor, ...) and each
# architecture adds its own names; a field nobody listed must count, so a new
# one is in the key by default. Only provenance, dtype (the weights are hashed
# after the cast and the pool key adds the dtype), output and cache switches,
# generation settings and tokenizer-side ids are out: they differ between
# copies or aliases of one model without changing a single K/V byte.
_NOT_KV = frozenset(
    {
        # where and by what the config was written
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "_commit_hash",
        # which class a pipeline would pick (unset until a model is saved):
        # the class that runs is in the key itself
        "architectures",
        # the load dtype: in the weights fingerprint and the pool key already
        "dtype",
        "torch_dtype",
        "use_bfloat16",
        # the attention kernel transformers would pick: the runner replaces it
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        # what a forward returns, not what it computes
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
        "tf_legacy_loss",
        # generation settings (transformers 4 kept them in the model config)
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        # token ids and labels: which ids stop or pad, not what a token's K/V is
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "finetuning_task",
        "id2label",
        "label2id",
        "problem_type",
    }
)


def _normalized(value: Any, is_config: bool = False) -> Any:
    """``value`` with harmless fields dropped (from a config or a nested
    sub-config: a dict with a ``model_type``) and integral floats made ints,
    so ``10000`` and ``10000.0`` hash alike. Other nested dicts (rope
    parameters, quantisation) are kept whole: their keys are not config fields."""
    if isinstance(value, dict):
        is_config = is_config or "model_type" in value
        return {
            str(k): _normalized(v) for k, v in value.items() if not (is_config and k in _NOT_KV)
        }
    if isinstance(value, (list, tuple)):
        return [_normalized(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def kv_config(config: Any) -> dict[str, Any]:
    """The part of a transformers config that can change K/V (see ``_NOT_KV``):
    the full ``to_dict()`` (defaults included, so a config.json that spells a
    default out matches one that leaves it implicit), harmless fields dropped."""
    return _normalized(config.to_dict(), is_config=True)


def kv_share_key(model: torch.nn.Module) -> str:
    """The KV-share key: the weights fingerprint, the model class and the
    KV-relevant config (``kv_config``). A config-only change (rope theta
    edited in config.json, say) gives a new key, so a reload never reuses K/V
    the old config computed; replicas, aliases and copies of one folder keep
    one key and share their cache."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"weights\0" + weights_fingerprint(model).encode())
    h.update(b"\0class\0" + f"{type(model).__module__}.{type(model).__qualname__}".encode())
    h.update(b"\0config\0" + _canonical(kv_config(model.config)))
    return h.hexdigest()


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """The module that holds the decoder layers, and the layers (the ModuleList
    named ``layers`` with ``num_hidden_layers`` entries)."""
    config = getattr(model.config, "text_config", None) or model.config
    n = int(config.num_hidden_layers)
    for parent in model.modules():
        layers = getattr(parent, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
            return parent, layers
    raise ValueError(f"{type(model).__name__}: no ModuleList of {n} decoder layers found")


def layer_chain(model: torch.nn.Module) -> list[str]:
    """Cumulative fingerprints of the layer stack: entry ``i`` hashes what the
    K/V (and the hidden state) of layers ``0..i`` depend on.

    Entry ``i`` covers the model class, the K/V-relevant config (``kv_config``),
    every tensor outside the layer stack that feeds it (embeddings, rotary
    tables, anything not after the stack) and the tensors of layers ``0..i``.
    Left out: the stack's final norm and an untied output head, which only the
    logits read. Two models with equal entry ``k - 1`` therefore produce
    identical K/V in layers ``0..k-1`` for the same tokens, whatever their
    upper layers (fine-tunes that froze the lower layers), so those layers'
    K/V can be stored once for both (``scheduler/layer_groups.py``).
    """
    decoder, layers = _decoder_layers(model)
    after: set[int] = set()
    norm = getattr(decoder, "norm", None)
    if isinstance(norm, torch.nn.Module):
        after |= {id(p) for p in norm.parameters()}
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None:
        inputs = {id(p) for p in embed.parameters()} if embed is not None else set()
        after |= {id(p) for p in head.parameters()} - inputs
    per_layer: dict[int, list[tuple[str, torch.Tensor]]] = {i: [] for i in range(len(layers))}
    base = _tensor_hash()
    base.update(f"{type(model).__module__}.{type(model).__qualname__}\0".encode())
    base.update(_canonical(kv_config(model.config)))
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    for name, tensor in sorted(named.items()):
        found = _LAYER_INDEX.search(name)
        if found is not None and int(found.group(1)) in per_layer:
            # The name inside its layer, so two layers' keys do not depend on
            # where the stack sits in the module tree.
            per_layer[int(found.group(1))].append((name[found.end() :], tensor))
        elif id(tensor) not in after:
            _hash_tensor(base, name, tensor)
    chain, prev = [], base.hexdigest()
    for i in range(len(layers)):
        h = _tensor_hash()
        h.update(prev.encode())
        for name, tensor in per_layer[i]:
            _hash_tensor(h, name, tensor)
        prev = h.hexdigest()
        chain.append(prev)
    return chain


def _tensor_hash() -> Any:
    """The hash weights go through: XXH3-128, 10x blake2b's speed here (a
    model's every byte is hashed twice at each load), 128 bits as before."""
    return xxhash.xxh3_128()


def _hash_tensor(h: Any, name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach().to("cpu").contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
    if t.numel():  # the bytes in place, not a copy
        h.update(t.reshape(-1).view(torch.uint8).numpy())
