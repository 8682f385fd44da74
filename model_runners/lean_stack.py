"""A Llama decoder stack run without transformers' per-module Python (CPU).

With the matmuls on AMX tiles and the element-wise chains fused, a decode
step of SmolLM2 spends a fifth of its time in Python: every layer makes about
eleven ``nn.Module`` calls (hook checks, keyword plumbing, deprecation
wrappers, the attention-interface lookup) around a dozen small kernels. For a
model whose code is *provably* transformers' Llama (the same bytecode, as
``fused_ops.py`` checks its swaps) with every norm and MLP fused, this runs
the same kernels in the same order straight from one loop: the results are
identical to the model's own forward (tested bit for bit), the Python is
not. Anything else (another architecture, fused ops off, a module that
differs) keeps transformers' forward.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixmux.model_runners import paged_attention
from radixmux.model_runners.fused_ops import references, same_code
from radixmux.model_runners.kv_store import KVStore
from radixmux.model_runners.packed_linear import PackedLinear, gated_activation

Linear = Callable[[torch.Tensor], torch.Tensor]


def _same(fn: Callable[..., Any], name: str) -> bool:
    # Decorators wrap every forward in look-alike wrappers: compare what they wrap.
    return same_code(inspect.unwrap(fn), inspect.unwrap(references()[name]))


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module.forward`` directly would skip a hook of ``module``."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _linear(module: nn.Module) -> Linear | None:
    """The module's own forward, bound (no ``nn.Module.__call__``), if it is a plain
    or packed linear layer."""
    if isinstance(module, PackedLinear) or type(module) is nn.Linear:
        return module.forward
    return None


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parts, as the loop calls them."""

    attn: nn.Module  # the attention module (the paged attention reads layer_idx from it)
    in_norm: tuple[torch.Tensor, float, bool]
    post_norm: tuple[torch.Tensor, float, bool]
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    gate_up_act: Linear  # act(gate(x)) * up(x): packed_linear.gated_activation
    down: Linear
    head_dim: int
    scaling: float


def _norm(module: nn.Module) -> tuple[torch.Tensor, float, bool] | None:
    fused = getattr(module, "radixmux_norm", None)
    return None if fused is None else (module.weight, *fused)


def _layer(layer: nn.Module) -> _Layer | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not _same(type(layer).forward, "layer"):
        return None
    if not _same(type(attn).forward, "attention") or not hasattr(mlp, "radixmux_act"):
        return None
    rotary = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if not hasattr(rotary, "radixmux_eager"):
        return None  # the modeling module's rotary is not the fused one
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    linears = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [mlp.gate_up_proj, mlp.down_proj]
    # Every module the loop calls by its forward alone: none may have a hook to skip.
    if any(_hooked(m) for m in (layer, attn, mlp, *norms, *linears)):
        return None
    in_norm, post_norm = (_norm(m) for m in norms)
    parts = [_linear(m) for m in linears]
    if in_norm is None or post_norm is None or any(p is None for p in parts):
        return None
    q, k, v, o, _gate_up, down = parts  # (the projection: checked, then gated_activation)
    gate_up_act = gated_activation(mlp.gate_up_proj, mlp.radixmux_act)
    return _Layer(
        attn, in_norm, post_norm, q, k, v, o, gate_up_act, down, attn.head_dim, float(attn.scaling),
    )  # fmt: skip


@dataclass(frozen=True)
class GroupPass:
    """One layer group's part of a forward whose model keeps its layers in
    groups (scheduler/layer_groups.py), each computing its own rows.

    ``rows``: the packed rows the group computes (None: all); with a partial
    hit a lower group skips the positions it holds already. ``fill``: before
    the group runs, rows whose input comes from the group below's stored
    boundary hidden states (that group held those positions): (store, its
    first hidden pseudo-layer, addresses, packed rows). ``save``: after it
    ran (lower groups), where its computed rows' hidden states go: (store,
    first pseudo-layer, addresses of its rows).
    """

    start: int
    end: int
    rows: torch.Tensor | None
    fill: tuple[KVStore, int, torch.Tensor, torch.Tensor] | None = None
    save: tuple[KVStore, int, torch.Tensor] | None = None


class LeanStack:
    """The forward of a fused Llama-code model, as one loop over its layers."""

    def __init__(self, model: nn.Module, layers: list[_Layer], rotary: Callable[..., Any]) -> None:
        self.layers = layers
        self.rotary = rotary
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.final_norm = _norm(inner.norm)
        self.lm_head = model.lm_head

    @classmethod
    def build(cls, model: nn.Module) -> LeanStack | None:
        """A lean stack for ``model``, or None where its code is not Llama's, fused."""
        inner = getattr(model, "model", None)
        if inner is None or not _same(type(model).forward, "causal_lm"):
            return None
        if _hooked(model) or _hooked(inner) or _hooked(inner.norm):  # forwards not called
            return None
        if not _same(type(inner).forward, "model") or _norm(inner.norm) is None:
            return None
        if len(inner.layers) != inner.config.num_hidden_layers:
            return None
        layers = [_layer(layer) for layer in inner.layers]
        if not layers or any(p is None for p in layers):
            return None
        rotary = sys.modules[type(layers[0].attn).__module__].apply_rotary_pos_emb
        return cls(model, layers, rotary)  # type: ignore[arg-type]

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[1, len(keep), vocab]`` of the packed batch ``input_ids [1, T]``
        at positions ``keep``, as ``model(..., logits_to_keep=keep).logits``."""
        h = self.embed(input_ids)
        cos, sin = self.rotary_emb(h, position_ids=position_ids)
        x = torch.ops.radixmux.rms_norm(h, *self.layers[0].in_norm)
        norms = [lay.in_norm for lay in self.layers[1:]] + [self.final_norm]
        _, x = self._layers(self.layers, norms, h, x, cos, sin)
        return self.lm_head(x[:, keep])

    def _layers(
        self,
        layers: list[_Layer],
        next_norms: list[tuple[torch.Tensor, float, bool]],
        h: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``layers`` over the rows of ``h`` (the residual stream) and ``x``
        (its normed input to the first of them); returns both after the last,
        ``x`` normed with its ``next_norms`` entry."""
        # Each residual add and the norm after it are one kernel (the same
        # roundings as the add's bfloat16 result then the norm); x is always
        # the normed input of the next part, h the residual stream.
        add_rms = torch.ops.radixmux.add_rms_norm
        attend = paged_attention.paged_attention_forward
        tokens = h.shape[1]
        for lay, next_norm in zip(layers, next_norms, strict=True):
            shape = (1, tokens, -1, lay.head_dim)
            q = lay.q(x).view(shape).transpose(1, 2)
            k = lay.k(x).view(shape).transpose(1, 2)
            v = lay.v(x).view(shape).transpose(1, 2)
            q, k = self.rotary(q, k, cos, sin)
            o, _ = attend(lay.attn, q, k, v, None, dropout=0.0, scaling=lay.scaling)
            h, x = add_rms(h, lay.o(o.reshape(1, tokens, -1).contiguous()), *lay.post_norm)
            h, x = add_rms(h, lay.down(lay.gate_up_act(x)), *next_norm)
        return h, x

    def run_groups(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor,
        passes: list[GroupPass],
    ) -> torch.Tensor:
        """As ``__call__``, layer group by layer group (``passes``, lowest
        first): each computes its rows only, takes the rows it did not get
        from the group below out of that group's stored hidden states, and a
        lower group stores the hidden states it hands on. The kernels and
        their order per row are the loop's own, so a row computed here is
        bit-identical to the same row through ``__call__``."""
        rms_norm = torch.ops.radixmux.rms_norm
        first = passes[0].rows
        ids = input_ids if first is None else input_ids[:, first]
        h0 = self.embed(ids)
        tokens = input_ids.shape[1]
        # The residual stream and the normed input of every packed row, as far
        # as a group has set them.
        h = h0.new_empty(1, tokens, h0.shape[-1])
        x = torch.empty_like(h)
        rows0 = slice(None) if first is None else first
        h[:, rows0] = h0
        if h0.shape[1]:
            x[:, rows0] = rms_norm(h0, *self.layers[0].in_norm)
        cos_all, sin_all = self.rotary_emb(h, position_ids=position_ids)
        norms = [lay.in_norm for lay in self.layers[1:]] + [self.final_norm]
        for gp in passes:
            if gp.rows is not None and not len(gp.rows):
                # A chunk of a partial hit that ends before where this group
                # starts: the group above takes every row from its stored states.
                continue
            if gp.fill is not None:
                store, layer, addr, rows = gp.fill
                stored = store.read_hidden(layer, addr, h.shape[-1]).to(h.dtype)
                h[0, rows] = stored
                x[0, rows] = rms_norm(stored[None], *self.layers[gp.start].in_norm)[0]
            sel = slice(None) if gp.rows is None else gp.rows
            hg, xg = self._layers(
                self.layers[gp.start : gp.end],
                norms[gp.start : gp.end],
                h[:, sel],
                x[:, sel],
                cos_all[:, sel],
                sin_all[:, sel],
            )
            h[:, sel], x[:, sel] = hg, xg
            if gp.save is not None:
                store, layer, addr = gp.save
                store.write_hidden(layer, addr, hg[0])
        return self.lm_head(x[:, keep])
