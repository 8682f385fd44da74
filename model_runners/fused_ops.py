"""Fused element-wise layers swapped into a loaded transformers model (CPU).

transformers writes RMSNorm, a gated MLP's activation and rotary embedding as
chains of small torch ops. Each op is a dispatch of a few microseconds and,
at prefill sizes, a pass over a tensor larger than the caches, so on a CPU
they cost a decode step about as much as its attention does. The kernels in
``kernels/fused_ops.cpp`` do each chain in one pass and round every
intermediate to the model's dtype exactly where eager does (results equal
eager's up to float reduction order).

Only code that is provably the eager chain is replaced: a module or function
is swapped when its bytecode equals transformers' own Llama (or Gemma) version
of it, so an architecture that changes any detail keeps its own code.

* RMSNorm modules: Llama's ``w * normed.to(dtype)`` and Gemma's
  ``(normed * (1 + w)).to(dtype)``, per instance.
* Gated MLPs (``down(act(gate(x)) * up(x))`` with SiLU or tanh-GELU): gate and
  up become one projection of twice the width (one matmul instead of two) and
  the activation-and-multiply one kernel, per instance.
* ``apply_rotary_pos_emb`` of the model's modeling module: replaced by a
  function that uses the kernel inside a radixmux forward (a ``paged_batch``)
  and transformers' own code everywhere else, so a plain copy of the model in
  the same process (the tests' reference) runs unmodified.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixmux.model_runners import paged_decode

log = logging.getLogger("radixmux.runner")

SILU, GELU_TANH = 0, 1


@dataclass
class FuseReport:
    """What :func:`fuse_model` replaced."""

    norms: int = 0
    mlps: int = 0
    rotary_modules: int = 0

    @property
    def total(self) -> int:
        return self.norms + self.mlps + self.rotary_modules


def same_code(fn: Callable[..., Any], reference: Callable[..., Any]) -> bool:
    """Whether two functions compile to the same instructions, names and constants
    (docstrings aside: copies of one function in two modeling files differ there)."""

    def shape(f: Callable[..., Any]) -> tuple[Any, ...] | None:
        code = getattr(f, "__code__", None)
        if code is None:
            return None
        doc = f.__doc__
        consts = tuple(c for c in code.co_consts if doc is None or c is not doc)
        return code.co_code, code.co_names, consts

    mine = shape(fn)
    return mine is not None and mine == shape(reference)


@functools.cache
def references() -> dict[str, Any]:
    """transformers' own code that swapped-in code must equal (here, in lean_stack.py
    and tied_embedding.py)."""
    from transformers.models.gemma3 import modeling_gemma3 as gemma
    from transformers.models.llama import modeling_llama as llama

    return {
        "llama_norm": llama.LlamaRMSNorm.forward,
        "gemma_norm": gemma.Gemma3RMSNorm.forward,
        "gemma_norm_inner": gemma.Gemma3RMSNorm._norm,
        "gemma_embedding": gemma.Gemma3TextScaledWordEmbedding.forward,
        "mlp": llama.LlamaMLP.forward,
        "rotary": llama.apply_rotary_pos_emb,
        "rotate_half": llama.rotate_half,
        "causal_lm": llama.LlamaForCausalLM.forward,
        "model": llama.LlamaModel.forward,
        "layer": llama.LlamaDecoderLayer.forward,
        "attention": llama.LlamaAttention.forward,
    }


# ---- RMSNorm ----------------------------------------------------------------------------
def _norm_style(module: nn.Module) -> str | None:
    """``llama``, ``gemma`` or None (not an RMSNorm whose code we know)."""
    ref = references()
    cls = type(module)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if same_code(cls.forward, ref["llama_norm"]) and hasattr(module, "variance_epsilon"):
        return "llama"
    if (
        same_code(cls.forward, ref["gemma_norm"])
        and same_code(getattr(cls, "_norm", None), ref["gemma_norm_inner"])
        and hasattr(module, "eps")
    ):
        return "gemma"
    return None


def _fuse_norm(module: nn.Module, style: str) -> None:
    eps = float(module.variance_epsilon if style == "llama" else module.eps)
    gemma = style == "gemma"
    eager = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != module.weight.dtype:
            return eager(x)
        return torch.ops.radixmux.rms_norm(x, module.weight, eps, gemma)

    module.forward = forward
    module.radixmux_norm = (eps, gemma)  # read by lean_stack.py


# ---- gated MLP --------------------------------------------------------------------------
def _activation(act: nn.Module) -> int | None:
    from transformers.activations import GELUTanh, SiLUActivation

    if isinstance(act, (SiLUActivation, nn.SiLU)):
        return SILU
    # GELUTanh's default is F.gelu(approximate="tanh"); its python variant rounds differently.
    inner = getattr(act, "act", None)
    if (
        isinstance(act, GELUTanh)
        and isinstance(inner, functools.partial)
        and inner.func is nn.functional.gelu
        and inner.keywords == {"approximate": "tanh"}
    ):
        return GELU_TANH
    return None


def _mlp_parts(module: nn.Module) -> tuple[nn.Linear, nn.Linear, int] | None:
    if not same_code(type(module).forward, references()["mlp"]):
        return None
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if type(gate) is not nn.Linear or type(up) is not nn.Linear:
        return None
    if gate.weight.shape != up.weight.shape or (gate.bias is None) != (up.bias is None):
        return None
    act = _activation(getattr(module, "act_fn", None))
    return None if act is None else (gate, up, act)


def _fuse_mlp(module: nn.Module, gate: nn.Linear, up: nn.Linear, act: int) -> None:
    merged = nn.Linear(
        gate.in_features,
        2 * gate.out_features,
        bias=gate.bias is not None,
        device=gate.weight.device,
        dtype=gate.weight.dtype,
    )
    with torch.no_grad():
        merged.weight.copy_(torch.cat([gate.weight, up.weight]))
        if gate.bias is not None:
            merged.bias.copy_(torch.cat([gate.bias, up.bias]))
    del module.gate_proj, module.up_proj  # their weights now live in gate_up_proj
    module.gate_up_proj = merged

    table = act_table(module.act_fn) if merged.weight.dtype == torch.bfloat16 else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        # Packing (packed_linear.py) may give the MLP a one-pass gate/up and
        # activation for its packed projection, the lean stack's too.
        gated = getattr(module, "radixmux_gate_up_act", None)
        if gated is not None:
            return module.down_proj(gated(x))
        gate_up = module.gate_up_proj(x)
        return module.down_proj(torch.ops.radixmux.act_and_mul(gate_up, act, table))

    module.forward = forward
    module.radixmux_act = (act, table)  # read by lean_stack.py


def act_table(act_fn: nn.Module) -> torch.Tensor:
    """``act_fn`` of every bfloat16 value, as the int16 bits the kernel indexes by a
    bf16 input's bits (plus one spare entry for its 32-bit gathers): eager's own
    function computes it, so a tabled activation is eager's to the bit."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    with torch.no_grad():
        out = act_fn(every.view(torch.bfloat16)).view(torch.int16)
    # Index by the unsigned bits: entry b is act(bits b); arange started at -32768.
    return torch.cat([out.roll(-(1 << 15)), out[:1]]).contiguous()


# ---- rotary embedding -------------------------------------------------------------------
def _rotary(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``q [1, H, T, D]`` rotated; the result is a ``[1, H, T, D]`` view of ``[T, H, D]``
    memory, the layout the paged attention reads without a copy."""
    out = torch.ops.radixmux.rotary(q[0].transpose(0, 1), cos[0], sin[0])
    return out.transpose(0, 1).unsqueeze(0)


def _fused_rotary(eager: Callable[..., Any]) -> Callable[..., Any]:
    from radixmux.model_runners import paged_attention

    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        unsqueeze_dim: int = 1,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        usable = (
            paged_attention.active()
            and not kwargs
            and unsqueeze_dim == 1
            and q.dim() == 4
            and k.dim() == 4
            and q.shape[0] == 1
            and cos.dim() == 3
            and cos.shape == sin.shape
            and cos.shape[1:] == (q.shape[2], q.shape[3])
            and q.device.type == "cpu"
            and q.dtype == k.dtype == cos.dtype == sin.dtype
        )
        if not usable:
            return eager(q, k, cos, sin, unsqueeze_dim, **kwargs)
        return _rotary(q, cos, sin), _rotary(k, cos, sin)

    apply_rotary_pos_emb.radixmux_eager = eager  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def plain_function(fn: Any) -> Any:
    """The function under transformers' hub-kernel wrapper, else ``fn`` itself.

    With the ``kernels`` package installed (a dependency of transformers from 5.2x),
    ``@use_kernel_forward_from_hub`` turns a module-level function into an instance
    of an ``nn.Module`` class whose ``forward`` calls the original through a closure.
    Comparing code needs the original; where the wrapper's shape is not the one
    known here, ``fn`` comes back and the comparison fails, so nothing is swapped.
    """
    if not isinstance(fn, nn.Module):
        return fn
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or not forward.__closure__:
        return fn
    cells = dict(zip(code.co_freevars, forward.__closure__, strict=True))
    inner = cells["func"].cell_contents if "func" in cells else None
    return inner if callable(inner) and hasattr(inner, "__code__") else fn


def _fuse_rotary(modeling: types.ModuleType) -> bool:
    """Swap ``modeling.apply_rotary_pos_emb`` (once per process) if it is Llama's."""
    current = getattr(modeling, "apply_rotary_pos_emb", None)
    if current is None:
        return False
    if hasattr(current, "radixmux_eager"):
        return True  # another model of this module already swapped it
    ref = references()
    rotate = getattr(modeling, "rotate_half", None)
    plain, want = plain_function(current), plain_function(ref["rotary"])
    if not (same_code(plain, want) and same_code(rotate, ref["rotate_half"])):
        return False
    modeling.apply_rotary_pos_emb = _fused_rotary(current)
    return True


# ---- the model ----------------------------------------------------------------------------
_FUSED_ATTR = "radixmux_fused"


def is_fused(model: nn.Module) -> bool:
    """Whether :func:`fuse_model` already ran on ``model``."""
    return hasattr(model, _FUSED_ATTR)


def fuse_model(model: nn.Module) -> FuseReport:
    """Swap the fused kernels into ``model`` (on CPU, where the kernel library builds).

    Call before ``pack_linear_weights`` (the merged gate/up projection is then
    packed like any other linear layer) and after the weights fingerprint.
    """
    if is_fused(model):
        return getattr(model, _FUSED_ATTR)
    report = FuseReport()
    if next(model.parameters()).device.type != "cpu" or not paged_decode.load():
        return report
    modelings = set()
    for module in list(model.modules()):
        modelings.add(type(module).__module__)
        style = _norm_style(module)
        if style is not None:
            _fuse_norm(module, style)
            report.norms += 1
            continue
        parts = _mlp_parts(module)
        if parts is not None:
            _fuse_mlp(module, *parts)
            report.mlps += 1
    for name in sorted(modelings):
        modeling = sys.modules.get(name)
        if name.startswith("transformers.models.") and modeling and _fuse_rotary(modeling):
            report.rotary_modules += 1
    setattr(model, _FUSED_ATTR, report)
    log.info(
        "fused ops: %d RMSNorms, %d gated MLPs, rotary in %d modeling module(s)",
        report.norms,
        report.mlps,
        report.rotary_modules,
    )
    return report
