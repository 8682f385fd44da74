"""The domain types every process carries: models, runner ids, sampling parameters, chat
messages, logprobs. Plain frozen Structs, no behaviour beyond naming."""

from __future__ import annotations

from typing import Literal, NamedTuple

import msgspec

from radixmux.memory.layout import KVLayout


class ModelArg(msgspec.Struct, frozen=True):
    """One ``--model`` flag: ``SOURCE[,name=N][,dtype=D][,priority=P][,replicas=R]``
    ``[,load=on_demand][,keep_alive=S]``."""

    source: str
    name: str
    dtype: str | None = None
    priority: float = 1.0
    replicas: int = 1
    on_demand: bool = False  # registered only: loaded by its first request
    keep_alive: float | None = None  # idle seconds before an on-demand unload (None: the flag's)


class ModelInfo(msgspec.Struct, frozen=True):
    """Layout, limits and fingerprints of a loaded model (sent in the ready message).

    ``sliding_windows`` has one entry per layer: the window in tokens, or
    ``None`` for full attention. ``kv_share_key`` is the weights fingerprint.
    """

    name: str
    architecture: str
    layout: KVLayout
    context_length: int
    sliding_windows: list[int | None]
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer_fingerprint: str
    kv_share_key: str
    has_chat_template: bool
    dtype: str
    device: str
    # Bytes of its parameters and buffers as loaded (a tied matrix once),
    # before the runner repacks them: what its memory is measured against.
    weight_bytes: int = 0
    # Cumulative fingerprints of the layer stack (``fingerprint.layer_chain``):
    # models with equal entry ``k - 1`` compute identical K/V in layers 0..k-1.
    layer_keys: list[str] = msgspec.field(default_factory=list)
    hidden_size: int = 0
    # The runner can run its upper layers alone from stored hidden states
    # (ForwardBatch.layer_splits with SeqInput.lower_starts): a partial hit.
    layer_restart: bool = False


class Constraint(msgspec.Struct, frozen=True):
    """A grammar the generated tokens must stay inside (structured output).

    ``kind``: ``"json"`` (``spec`` a JSON schema as JSON text, ``""`` for any
    JSON value), ``"regex"``, or ``"ebnf"`` (xgrammar's EBNF, GBNF-like, with a
    ``root`` rule). ``strict``: a JSON schema's objects take no properties it
    does not list (OpenAI's ``strict``; off, they may). ``field`` names the
    request field it came from, so an error about it can say where to look.
    The runner masks every sampled token to the grammar; the row ends with
    ``finish_reason == "stop"`` once the grammar is complete.
    """

    kind: Literal["json", "regex", "ebnf"]
    spec: str = ""
    strict: bool = True
    field: str = ""


class SamplingParams(msgspec.Struct, frozen=True):
    """How to pick a sequence's next token. Defaults mean greedy, no penalties.

    ``temperature <= 0`` or ``top_k == 1`` is greedy. ``top_k = 0``, ``top_p =
    1``, ``min_p = 0`` switch those filters off. Penalties apply over the
    sequence's ``output_ids``. ``seed`` makes sampling reproducible: the same
    seed, step and logits give the same token, whatever else is in the batch.
    ``logprobs`` asks for the chosen token's log-probability and the
    ``top_logprobs`` most likely alternatives. ``logit_bias`` adds to the
    logits of the listed token ids (after penalties, before everything else).
    ``constraint`` limits the output to a grammar (logprobs are then those of
    the masked distribution, as vLLM reports them).
    ``prompt_logprobs_start >= 0`` asks for the log-probability (and the top
    alternatives) of every prompt token from that index on (the first prompt
    token has none): the scheduler then computes those positions instead of
    taking them from the cache.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_new_tokens: int = 128
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: list[tuple[int, float]] = msgspec.field(default_factory=list)
    prompt_logprobs_start: int = -1
    constraint: Constraint | None = None


class ServedModel(msgspec.Struct, frozen=True):
    """A model as every process sees it once its runners are up.

    ``version`` counts reloads of one served name; each version is its own
    *instance* inside the runtime (runners, tree entries, tokenizer), so a
    request bound to one version at the front never runs on another.
    """

    name: str  # the served name clients use
    folder: str  # local HF folder (tokenizer, config, chat template)
    info: ModelInfo
    replicas: int = 1
    priority: float = 1.0
    version: int = 1

    @property
    def instance(self) -> str:
        """The name this version has inside the runtime (scheduler, tree, tokenizers)."""
        return instance_name(self.name, self.version)


def instance_name(name: str, version: int) -> str:
    """A served name's internal name at ``version``: the name itself for the
    first version, so a server whose models never change keeps its names."""
    return name if version == 1 else f"{name}@v{version}"


def served_name(instance: str) -> tuple[str, int]:
    """(served name, version) of an instance name: :func:`instance_name`'s
    inverse (a served name never contains ``@``)."""
    name, sep, version = instance.rpartition("@v")
    if sep and version.isdigit():
        return name, int(version)
    return instance, 1


class RunnerId(NamedTuple):
    """A runner's identity: the instance it serves and its replica index,
    spelled ``<instance>#<replica>`` on the wire (the scheduler's ROUTER
    identity) and in the launcher's process table."""

    model: str
    replica: int

    def __str__(self) -> str:
        return f"{self.model}#{self.replica}"

    @classmethod
    def parse(cls, text: str) -> RunnerId | None:
        """The id spelled ``text``, or None when it is not a runner id."""
        model, sep, replica = text.rpartition("#")
        if not sep or not replica.isdigit():
            return None
        return cls(model, int(replica))


def runner_ids(arg: ModelArg) -> list[str]:
    """The runner ids of an instance's replicas, spelled as on the wire."""
    return [str(RunnerId(arg.name, i)) for i in range(arg.replicas)]


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class ToolSpec(msgspec.Struct, frozen=True):
    """A function a chat request offers the model (rendered by the chat template)."""

    name: str
    description: str
    parameters: str  # its JSON schema, as JSON text


class TokenLogprob(msgspec.Struct, frozen=True):
    """A sampled token's log-probability and the top alternatives'. ``text`` and
    ``top_text`` (the tokens as text) are filled in by the detokenizer."""

    token_id: int
    logprob: float | None  # None only for a prompt's first token (nothing scores it)
    top: list[tuple[int, float]] | None = None
    text: str | None = None
    top_text: list[str] | None = None
