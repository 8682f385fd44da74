"""Derive N fine-tuned variants of one base model, offline, as ordinary HF folders.

The many-fine-tunes-of-one-base deployment (issue 34) needs models that share
a tokenizer and architecture but not weights. Each variant ``i`` is specialised
to one persona (``bench/finetune_corpus.py``) by *context distillation*: the
base answers the training prompts under the persona's system prompt (sampled,
seeded), then a LoRA adapter is trained for ``--steps`` steps to give those
answers with no system prompt, and is merged into the weights. Two families:

* ``all``: LoRA on every linear of every layer, so every layer changes;
* ``upper``: LoRA on the linears of the upper ``--upper-layers`` layers only.
  The embeddings, layers ``0..L-k-1`` and the final norm stay bit-identical to
  the base (the merged file copies those tensors unchanged). SmolLM2 ties
  ``lm_head`` to the embeddings, so changing the head would change the
  embeddings: neither family touches them (the tie is kept as is).

The defaults are sized for a 2-core CPU: 32 persona answers of up to 64 tokens
(one sampled generation batch, cached per persona), 30 LoRA steps of 4 sequences
of at most 128 tokens. A step takes about 1.5 s (``upper``, backward through the
top layers only) or 2.4 s (``all``) on two idle cores, several times that on
shared ones; ``--steps``/``--train-prompts``/``--gen-tokens`` scale it up.

``--method perturb`` replaces training with a seeded low-rank perturbation of
the same linears, scaled to ``--perturb-scale`` of each weight's norm; it is
much faster and the printed perplexity shows whether it stayed fluent.

Idempotent: a variant folder whose ``radixmux-finetune.json`` records the same
spec and whose weights still hash to the recorded sha256 is reused as is. Each
family also gets ``<family>-manifest.json`` (arguments, per-variant hashes,
seconds, perplexities, greedy answers). Output goes to ``--out`` (default
``~/.cache/radixmux/finetunes/<base>/<family>-<i>``, next to fetch()'s models;
``<family>-perturb-<i>`` for ``--method perturb``).

    python -m bench.make_finetunes --family upper --n 4
    python -m bench.make_finetunes --family all upper --n 8 --method perturb
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.finetune_corpus import EVAL_PROMPTS, HELD_OUT_TEXT, TRAIN_PROMPTS, persona

MARKER = "radixmux-finetune.json"
FAMILIES = ("all", "upper")
METHODS = ("lora", "perturb")


@dataclass(frozen=True)
class FinetuneArgs:
    """Every argument that decides a variant's weights (what the marker records)."""

    method: str = "lora"
    upper_layers: int = 8  # the ``upper`` family changes only this many top layers
    steps: int = 30
    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-3
    batch: int = 4
    seq_len: int = 128
    train_prompts: int = 32  # the first ones of TRAIN_PROMPTS; one generation batch
    gen_tokens: int = 64  # length of the persona answers the variant is trained on
    perturb_scale: float = 0.02
    seed: int = 0


@dataclass
class VariantReport:
    """One variant as built or reused: where it is and what it measured."""

    name: str
    path: str
    persona: str
    weights_sha256: str
    changed_tensors: int
    reused: bool
    seconds: dict[str, float] = field(default_factory=dict)  # gen / train / write
    loss_first: float | None = None  # mean loss of the first and last steps (lora)
    loss_last: float | None = None
    perplexity: float = 0.0  # on HELD_OUT_TEXT
    answers: list[str] = field(default_factory=list)  # greedy, to EVAL_PROMPTS


# ---- files ----------------------------------------------------------------------------
def finetunes_root() -> Path:
    """Default output root: ``finetunes/`` beside fetch()'s model cache."""
    from radixmux.model_runners.fetch import cache_root

    return cache_root().parent / "finetunes"


def resolve_base(base: str) -> Path:
    """An embedded model's short name (fetched once) or a HF folder."""
    path = Path(base).expanduser()
    if path.is_dir():
        return path
    from radixmux.model_runners.fetch import fetch

    return fetch(base)


def weights_sha256(folder: Path) -> str:
    """sha256 over a folder's safetensors files, in name order."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def _json_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


# ---- the model ------------------------------------------------------------------------
def load_model(folder: Path) -> Any:
    """The folder's causal LM in float32 (training and evaluation precision), eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer, padding on the left (batched generation)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def decoder_layers(model: Any) -> Any:
    """The model's stack of decoder layers (Llama-style ``model.model.layers``)."""
    return model.model.layers


def changed_layer_ids(num_layers: int, family: str, upper_layers: int) -> range:
    """The layers a family's variants change."""
    if family == "all":
        return range(num_layers)
    if not 0 < upper_layers <= num_layers:
        raise ValueError(f"--upper-layers {upper_layers} must be in 1..{num_layers}")
    return range(num_layers - upper_layers, num_layers)


def target_linears(model: Any, layer_ids: range) -> dict[str, torch.nn.Linear]:
    """Every ``nn.Linear`` in the given layers, by its weight's safetensors key."""
    out: dict[str, torch.nn.Linear] = {}
    for i in layer_ids:
        for name, mod in decoder_layers(model)[i].named_modules():
            if isinstance(mod, torch.nn.Linear):
                out[f"model.layers.{i}.{name}.weight"] = mod
    return out


# ---- training data --------------------------------------------------------------------
def chat_prompt(tok: Any, question: str, system: str | None = None) -> str:
    """The chat-templated prompt for one question (``system`` optional)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@torch.inference_mode()
def generate(
    model: Any, tok: Any, prompts: Sequence[str], max_new: int, sample: bool, batch: int = 32
) -> list[str]:
    """Completions of already-templated prompts: sampled (T=0.7, top-p 0.9) or greedy."""
    answers: list[str] = []
    for start in range(0, len(prompts), batch):
        enc = tok(list(prompts[start : start + batch]), return_tensors="pt", padding=True)
        enc.pop("token_type_ids", None)
        kw: dict[str, Any] = (
            {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
            if sample
            else {"do_sample": False}
        )
        out = model.generate(
            **enc, max_new_tokens=max_new, pad_token_id=tok.pad_token_id, top_k=None, **kw
        )
        new = out[:, enc["input_ids"].shape[1] :]
        answers += [t.strip() for t in tok.batch_decode(new, skip_special_tokens=True)]
    return answers


def persona_data(
    base: Any, tok: Any, index: int, args: FinetuneArgs, cache: Path, base_sha: str
) -> tuple[list[dict[str, str]], float]:
    """Variant ``index``'s (question, persona answer) pairs, generated once and cached.

    Both families' variant ``index`` train on the same data (cached by its inputs),
    so ``all-i`` and ``upper-i`` are one fine-tune with two freezing choices.
    Returns the pairs and the seconds generation took (0 when cached).
    """
    who = persona(index)
    key = {
        "base": base_sha,
        "persona": dataclasses.asdict(who),
        "prompts": args.train_prompts,
        "tokens": args.gen_tokens,
        "seed": args.seed + index,
    }
    path = cache / f"{who.name}-{index}-{_json_hash(key)}.json"
    if path.is_file():
        return json.loads(path.read_text())["pairs"], 0.0
    t0 = time.perf_counter()
    questions = TRAIN_PROMPTS[: args.train_prompts]
    print(f"{who.name}: generating {len(questions)} persona answers", file=sys.stderr)
    torch.manual_seed(args.seed + index)
    texts = generate(
        base,
        tok,
        [chat_prompt(tok, q, who.system_prompt) for q in questions],
        args.gen_tokens,
        True,
    )
    pairs = [{"q": q, "a": a} for q, a in zip(questions, texts, strict=True) if a]
    cache.mkdir(parents=True, exist_ok=True)
    _write_json(path, {"key": key, "pairs": pairs})
    return pairs, time.perf_counter() - t0


def encode_pairs(
    tok: Any, pairs: Sequence[dict[str, str]], seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) per pair: the loss covers the answer and its end-of-turn only."""
    out = []
    for p in pairs:
        prompt = chat_prompt(tok, p["q"])
        full = tok.apply_chat_template(
            [{"role": "user", "content": p["q"]}, {"role": "assistant", "content": p["a"]}],
            tokenize=False,
        )
        n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
        ids = torch.tensor(tok(full, add_special_tokens=False)["input_ids"][:seq_len])
        labels = ids.clone()
        labels[:n_prompt] = -100
        if (labels != -100).any():
            out.append((ids, labels))
    return out


def batches(
    examples: Sequence[tuple[torch.Tensor, torch.Tensor]], size: int, pad: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless shuffled right-padded batches (ids, attention mask, labels)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(examples), generator=gen).tolist()
        for start in range(0, len(order) - size + 1, size):
            chunk = [examples[j] for j in order[start : start + size]]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((size, width), pad)
            mask = torch.zeros((size, width), dtype=torch.long)
            labels = torch.full((size, width), -100)
            for row, (x, y) in enumerate(chunk):
                ids[row, : len(x)], mask[row, : len(x)], labels[row, : len(y)] = x, 1, y
            yield ids, mask, labels


# ---- deltas ---------------------------------------------------------------------------
class LoRA(torch.nn.Module):
    """A low-rank update ``scale * B @ A`` added to one frozen linear through a forward hook."""

    def __init__(self, linear: torch.nn.Linear, rank: int, alpha: float, gen: torch.Generator):
        super().__init__()
        # A random, B zero: the model starts exactly at the base (the LoRA paper's init).
        self.a = torch.nn.Parameter(
            torch.randn(rank, linear.in_features, generator=gen) / linear.in_features**0.5
        )
        self.b = torch.nn.Parameter(torch.zeros(linear.out_features, rank))
        self.scale = alpha / rank
        self.handle = linear.register_forward_hook(self._hook)

    def _hook(self, _mod: torch.nn.Module, inputs: tuple[torch.Tensor], out: torch.Tensor):
        return out + (inputs[0] @ self.a.T) @ self.b.T * self.scale

    def delta(self) -> torch.Tensor:
        """The merged weight update."""
        return (self.b @ self.a).detach() * self.scale


def train_lora(
    model: Any,
    tok: Any,
    targets: dict[str, torch.nn.Linear],
    pairs: Sequence[dict[str, str]],
    args: FinetuneArgs,
    seed: int,
    label: str,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train one LoRA adapter per target linear; return the merged deltas and the losses."""
    from tqdm import tqdm

    for p in model.parameters():  # only the adapters learn; autograd stops below them
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    adapters = {key: LoRA(lin, args.rank, args.alpha, gen) for key, lin in targets.items()}
    params = [p for a in adapters.values() for p in a.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    examples = encode_pairs(tok, pairs, args.seq_len)
    if len(examples) < args.batch:
        raise ValueError(f"{label}: {len(examples)} training examples, fewer than --batch")
    stream = batches(examples, args.batch, tok.pad_token_id, seed)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(args.steps), desc=label, unit="step", leave=True, file=sys.stderr)
    try:
        for _ in bar:
            ids, mask, labels = next(stream)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix_str(f"loss {losses[-1]:.3f}")
    finally:
        bar.close()
        model.eval()
        for a in adapters.values():
            a.handle.remove()
    return {key: a.delta() for key, a in adapters.items()}, losses


def perturb_deltas(
    targets: dict[str, torch.nn.Linear], args: FinetuneArgs, seed: int
) -> dict[str, torch.Tensor]:
    """Seeded rank-``args.rank`` updates, each ``args.perturb_scale`` of its weight's norm."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, lin in targets.items():
        u = torch.randn(lin.out_features, args.rank, generator=gen)
        v = torch.randn(args.rank, lin.in_features, generator=gen)
        d = u @ v
        out[key] = d * (args.perturb_scale * lin.weight.detach().norm() / d.norm())
    return out


def write_variant(base_dir: Path, target: Path, deltas: dict[str, torch.Tensor]) -> None:
    """Copy ``base_dir`` to ``target`` with ``deltas`` added to their tensors.

    Every other tensor is copied as read, so it stays bit-identical to the base;
    changed ones keep the base's dtype. Written to a staging folder and renamed
    last, so an interrupted run never leaves a half variant behind.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    staging = target.with_name(f".{target.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        pending = set(deltas)
        for src in base_dir.iterdir():
            if src.suffix == ".safetensors":
                with safe_open(src, "pt") as f:
                    meta = f.metadata()
                    tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
                for key in pending & tensors.keys():
                    w = tensors[key]
                    tensors[key] = (w.float() + deltas[key]).to(w.dtype)
                    pending.discard(key)
                save_file(tensors, staging / src.name, metadata=meta)
            elif src.is_file() and not src.name.startswith("radixmux-"):
                shutil.copy2(src, staging / src.name)  # config, tokenizer, chat template
        if pending:
            raise KeyError(f"tensors not in {base_dir}: {sorted(pending)[:3]}")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---- evaluation -----------------------------------------------------------------------
@torch.inference_mode()
def perplexity(model: Any, tok: Any, text: str = HELD_OUT_TEXT) -> float:
    """Perplexity of ``text`` (one sequence) under ``model``."""
    ids = tok(text, return_tensors="pt")["input_ids"]
    return float(torch.exp(model(input_ids=ids, labels=ids).loss))


def evaluate(model: Any, tok: Any, eval_tokens: int) -> tuple[float, list[str]]:
    """Held-out perplexity and greedy answers to ``EVAL_PROMPTS`` (no system prompt)."""
    prompts = [chat_prompt(tok, q) for q in EVAL_PROMPTS]
    return perplexity(model, tok), generate(model, tok, prompts, eval_tokens, sample=False)


# ---- one variant, one family ----------------------------------------------------------
@dataclass(frozen=True)
class Base:
    """The base model a family derives from."""

    name: str
    folder: Path
    sha256: str
    num_layers: int


def variant_name(family: str, index: int | None, method: str) -> str:
    """``<family>-<i>`` for fine-tunes, ``<family>-perturb-<i>`` for perturbations (both
    can live side by side); ``index`` None gives the family's prefix (its manifest's)."""
    prefix = family if method == "lora" else f"{family}-{method}"
    return prefix if index is None else f"{prefix}-{index}"


def variant_spec(base: Base, family: str, index: int, args: FinetuneArgs) -> dict[str, Any]:
    """What a variant's weights depend on; a folder recording another spec is rebuilt."""
    spec = {"base": base.name, "base_sha256": base.sha256, "family": family, "index": index}
    spec["persona"] = persona(index).name
    fields = dataclasses.asdict(args)
    if family == "all":
        fields.pop("upper_layers")
    if args.method == "perturb":
        for k in ("steps", "alpha", "lr", "batch", "seq_len", "train_prompts", "gen_tokens"):
            fields.pop(k)
    else:
        fields.pop("perturb_scale")
    return spec | fields


def reuse(target: Path, spec: dict[str, Any]) -> VariantReport | None:
    """The recorded report of an existing variant folder built from ``spec``, else None."""
    marker = target / MARKER
    if not marker.is_file():
        return None
    record = json.loads(marker.read_text())
    if record.get("spec") != spec or weights_sha256(target) != record["report"]["weights_sha256"]:
        return None
    report = VariantReport(**record["report"])
    report.reused = True
    return report


def build_variant(
    base: Base, family: str, index: int, args: FinetuneArgs, root: Path, eval_tokens: int
) -> VariantReport:
    """Build (or reuse) variant ``index`` of ``family`` under ``root``."""
    name = variant_name(family, index, args.method)
    target = root / name
    spec = variant_spec(base, family, index, args)
    found = reuse(target, spec)
    if found is not None:
        print(f"{name} ({found.persona}): reused {target}", file=sys.stderr)
        return found
    tok = load_tokenizer(base.folder)
    model = load_model(base.folder)
    layer_ids = changed_layer_ids(base.num_layers, family, args.upper_layers)
    targets = target_linears(model, layer_ids)
    seed = args.seed * 1000 + index
    seconds: dict[str, float] = {}
    losses: list[float] = []
    if args.method == "lora":
        pairs, seconds["gen"] = persona_data(model, tok, index, args, root / "data", base.sha256)
        t0 = time.perf_counter()
        label = f"{name} ({persona(index).name}, lora {args.steps} steps)"
        deltas, losses = train_lora(model, tok, targets, pairs, args, seed, label)
        seconds["train"] = time.perf_counter() - t0
    else:
        print(f"{name} ({persona(index).name}): perturb", file=sys.stderr)
        deltas = perturb_deltas(targets, args, seed)
    del model
    t0 = time.perf_counter()
    write_variant(base.folder, target, deltas)
    seconds["write"] = time.perf_counter() - t0
    # Evaluate the folder as written (and loaded back), not the in-memory model.
    ppl, answers = evaluate(load_model(target), tok, eval_tokens)
    head = losses[: max(1, len(losses) // 10)]
    tail = losses[-max(1, len(losses) // 10) :]
    report = VariantReport(
        name=name,
        path=str(target),
        persona=persona(index).name,
        weights_sha256=weights_sha256(target),
        changed_tensors=len(deltas),
        reused=False,
        seconds={k: round(v, 1) for k, v in seconds.items()},
        loss_first=round(sum(head) / len(head), 4) if losses else None,
        loss_last=round(sum(tail) / len(tail), 4) if losses else None,
        perplexity=round(ppl, 3),
        answers=answers,
    )
    _write_json(target / MARKER, {"spec": spec, "report": dataclasses.asdict(report)})
    return report


def base_eval(base: Base, root: Path, eval_tokens: int) -> dict[str, Any]:
    """The base's perplexity and greedy answers (cached beside the data)."""
    key = {"base": base.sha256, "eval_tokens": eval_tokens, "prompts": list(EVAL_PROMPTS)}
    path = root / "data" / f"base-eval-{_json_hash(key)}.json"
    if path.is_file():
        return json.loads(path.read_text())
    ppl, answers = evaluate(load_model(base.folder), load_tokenizer(base.folder), eval_tokens)
    result = {"perplexity": round(ppl, 3), "answers": answers}
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, result)
    return result


def distinct_pairs(answers: dict[str, list[str]]) -> list[tuple[str, str, int]]:
    """(model, model, prompt index) for every two models giving one prompt the same answer."""
    names = list(answers)
    return [
        (a, b, k)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        for k, (x, y) in enumerate(zip(answers[a], answers[b], strict=True))
        if x == y
    ]


def build_family(
    base_source: str,
    family: str,
    n: int,
    args: FinetuneArgs,
    out: Path | None = None,
    eval_tokens: int = 40,
) -> dict[str, Any]:
    """Build (or reuse) variants ``0..n-1`` of ``family``; write and return its manifest."""
    from transformers import AutoConfig

    folder = resolve_base(base_source)
    base = Base(
        name=folder.name,
        folder=folder,
        sha256=weights_sha256(folder),
        num_layers=AutoConfig.from_pretrained(folder).num_hidden_layers,
    )
    root = (out or finetunes_root()) / base.name
    root.mkdir(parents=True, exist_ok=True)
    reports = [build_variant(base, family, i, args, root, eval_tokens) for i in range(n)]
    reference = base_eval(base, root, eval_tokens)
    answers = {"base": reference["answers"]} | {r.name: r.answers for r in reports}
    manifest = {
        "family": family,
        "method": args.method,
        "args": dataclasses.asdict(args),
        "base": {"name": base.name, "folder": str(folder), "sha256": base.sha256},
        "changed_layers": list(changed_layer_ids(base.num_layers, family, args.upper_layers)),
        "untouched": "embeddings (tied lm_head), final norm"
        + ("" if family == "all" else ", every layer below the changed ones"),
        "base_perplexity": reference["perplexity"],
        "base_answers": reference["answers"],
        "variants": [dataclasses.asdict(r) for r in reports],
        "same_answers": distinct_pairs(answers),
    }
    _write_json(root / f"{variant_name(family, None, args.method)}-manifest.json", manifest)
    return manifest


def print_summary(manifest: dict[str, Any]) -> None:
    """One table per family: seconds, loss, perplexity, first greedy answer."""
    print(
        f"\nfamily {manifest['family']} ({manifest['method']}), changed layers "
        f"{manifest['changed_layers'][0]}..{manifest['changed_layers'][-1]}; "
        f"base perplexity {manifest['base_perplexity']:.2f}"
    )
    print(
        f"{'variant':<15} {'persona':<12} {'gen s':>6} {'train s':>8} {'loss':>13} {'ppl':>7}  path"
    )
    for v in manifest["variants"]:
        s = v["seconds"]
        loss = f"{v['loss_first']:.2f}->{v['loss_last']:.2f}" if v["loss_first"] else "-"
        print(
            f"{v['name']:<15} {v['persona']:<12} {s.get('gen', 0):>6.1f} {s.get('train', 0):>8.1f} "
            f"{loss:>13} {v['perplexity']:>7.2f}  {v['path']}{' (reused)' if v['reused'] else ''}"
        )
    print("greedy answers to:", EVAL_PROMPTS[0])
    print(f"  {'base':<15} {manifest['base_answers'][0][:100]!r}")
    for v in manifest["variants"]:
        print(f"  {v['name']:<15} {v['answers'][0][:100]!r}")
    same = manifest["same_answers"]
    print(
        "every model answers every prompt differently"
        if not same
        else f"identical answers (model, model, prompt): {same}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: build the families, print one summary table each."""
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = FinetuneArgs()
    parser.add_argument("--base", default="smollm2", help="embedded model name or HF folder")
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=["upper"])
    parser.add_argument("--n", type=int, default=4, help="variants per family")
    parser.add_argument("--out", type=Path, default=None, help=f"root (default {finetunes_root()})")
    for f in dataclasses.fields(FinetuneArgs):  # one flag per weight-deciding argument
        default = getattr(d, f.name)
        choices = METHODS if f.name == "method" else None
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(
            flag, type=type(default), default=default, choices=choices, help=f"default {default}"
        )
    parser.add_argument("--eval-tokens", type=int, default=40, help="greedy answer length")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ns = parser.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    args = FinetuneArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(FinetuneArgs)})
    for family in ns.family:
        manifest = build_family(ns.base, family, ns.n, args, ns.out, ns.eval_tokens)
        print_summary(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
