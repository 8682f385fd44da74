"""SGLang's and vLLM's extension fields, accepted on top of OpenAI's API and SGLang's ``/generate``.

Their servers take these beside OpenAI's fields, their routers add some to every
request they forward (``sglang-router`` sends ``no_stop_trim``, ``ignore_eos``,
``skip_special_tokens``, ``return_hidden_states`` on completions, chat adds
``continue_final_message``, ``separate_reasoning``, ``stream_reasoning``, and
``vllm-router`` ``include_reasoning``; on ``/generate`` ``model: null``,
``background``, ``no_logs``, ``return_bytes``, ``return_entropy``, ...) and
their clients send others. Each field is declared on a request Struct (the
shared ones on the bases here) and listed once in a table below: either
honoured, or accepted only with a value that asks for nothing this server does
not do (None always does), anything else being a 400 naming the field. A field
in no table stays an unknown field (400), as before.

docs/http-api.md lists the tables; ``tests/test_extension_fields.py`` checks
that it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from radixmux.runtime.front.api.structured import StructuredOutputs

SGLANG, VLLM, BOTH = "SGLang", "vLLM", "SGLang, vLLM"


@dataclass(frozen=True)
class Extension:
    """One extension field: whose, and what this server does with it.

    ``honoured``: any valid value is served as its origin serves it.
    Otherwise only None and ``neutral`` are accepted: the values that ask for
    what this server does anyway."""

    name: str
    origin: str
    neutral: tuple[Any, ...] = ()
    honoured: bool = False


def _table(*rows: Extension) -> dict[str, Extension]:
    return {row.name: row for row in rows}


def neutral_only(table: dict[str, Extension]) -> dict[str, tuple[Any, ...]]:
    """The table's fields that are accepted only when neutral, with their
    neutral values (what ``common.refuse_unsupported`` checks)."""
    return {row.name: row.neutral for row in table.values() if not row.honoured}


# ---- /v1/completions and /v1/chat/completions ----------------------------------
class OpenAIExtensions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The extension fields both OpenAI endpoints take (None: not sent)."""

    # Honoured.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    no_stop_trim: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Structured output (api/structured.py reads and checks them).
    regex: str | None = None
    ebnf: str | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Accepted only when neutral (see OPENAI_SHARED).
    min_tokens: int | None = None
    spaces_between_special_tokens: bool | None = None
    add_special_tokens: bool | None = None
    stop_regex: Any = None
    structural_tag: Any = None
    lora_path: Any = None
    session_id: Any = None
    session_params: Any = None
    custom_params: Any = None
    custom_logit_processor: Any = None
    logits_processors: Any = None
    images_config: Any = None
    return_hidden_states: bool | str | None = None
    return_routed_experts: bool | None = None
    routed_experts_start_len: int | None = None
    return_cached_tokens_details: bool | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    rid: Any = None
    request_id: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    ngram_corpus_id: Any = None
    custom_labels: Any = None
    priority: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: Any = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


# Zero is the one data-parallel rank a radixmux instance has.
_ONE_RANK = (0,)

OPENAI_SHARED: tuple[Extension, ...] = (
    Extension("top_k", BOTH, honoured=True),
    Extension("min_p", BOTH, honoured=True),
    Extension("repetition_penalty", BOTH, honoured=True),
    Extension("stop_token_ids", BOTH, honoured=True),
    Extension("ignore_eos", BOTH, honoured=True),
    Extension("skip_special_tokens", BOTH, honoured=True),
    Extension("no_stop_trim", SGLANG, honoured=True),
    Extension("include_stop_str_in_output", VLLM, honoured=True),
    Extension("min_tokens", BOTH, (0,)),
    Extension("spaces_between_special_tokens", BOTH, (True,)),
    *(Extension(name, SGLANG, honoured=True) for name in ("regex", "ebnf")),
    *(
        Extension(name, VLLM, honoured=True)
        for name in (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "guided_decoding_backend",
            "guided_whitespace_pattern",
            "structured_outputs",
        )
    ),
    *(Extension(name, SGLANG) for name in ("stop_regex", "structural_tag", "lora_path")),
    *(
        Extension(name, VLLM)
        for name in (
            "logits_processors",
            "request_id",
            "truncate_prompt_tokens",
            "allowed_token_ids",
            "prompt_logprobs",
            "kv_transfer_params",
            "vllm_xargs",
        )
    ),
    *(
        Extension(name, SGLANG)
        for name in (
            "session_id",
            "session_params",
            "custom_params",
            "custom_logit_processor",
            "images_config",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "rid",
            "extra_key",
            "ngram_corpus_id",
            "custom_labels",
        )
    ),
    Extension("cache_salt", BOTH),
    *(
        Extension(name, SGLANG, (False,))
        for name in (
            "return_hidden_states",
            "return_routed_experts",
            "return_cached_tokens_details",
        )
    ),
    Extension("routed_experts_start_len", SGLANG, (0,)),
    Extension("return_token_ids", BOTH, (False,)),
    Extension("return_tokens_as_token_ids", VLLM, (False,)),
    *(
        Extension(name, SGLANG, _ONE_RANK)
        for name in ("routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank")
    ),
    Extension("priority", BOTH, (0,)),
    Extension("use_beam_search", VLLM, (False,)),
    Extension("length_penalty", VLLM, (1.0,)),
    Extension("bad_words", VLLM, ([],)),
)

COMPLETION: dict[str, Extension] = _table(
    *OPENAI_SHARED,
    # vLLM adds the tokenizer's special tokens (BOS) to a text prompt, as radixmux does.
    Extension("add_special_tokens", VLLM, (True,)),
    Extension("json_schema", SGLANG, honoured=True),
)

CHAT: dict[str, Extension] = _table(
    *OPENAI_SHARED,
    # A chat template writes its own special tokens; none are added on top.
    Extension("add_special_tokens", VLLM, (False,)),
    Extension("continue_final_message", BOTH, honoured=True),
    Extension("add_generation_prompt", VLLM, honoured=True),
    # Without a reasoning parser (radixmux has none) these change nothing,
    # as in SGLang and vLLM: the answer's text is the whole output.
    Extension("separate_reasoning", SGLANG, (True, False)),
    Extension("stream_reasoning", SGLANG, (True, False)),
    Extension("include_reasoning", VLLM, (True, False)),
    Extension("chat_template_kwargs", BOTH, ({},)),
    Extension("chat_template", VLLM),
    Extension("documents", VLLM),
    Extension("mm_processor_kwargs", VLLM),
    Extension("echo", VLLM, (False,)),
    Extension("return_prompt_token_ids", SGLANG, (False,)),
    Extension("return_meta_info", SGLANG, (False,)),
    Extension("max_dynamic_patch", SGLANG),
    Extension("min_dynamic_patch", SGLANG),
    Extension("use_audio_in_video", SGLANG, (False,)),
    Extension("input_ids", SGLANG),
    Extension("task", SGLANG),
)


# ---- /generate ----------------------------------------------------------------
class GenerateExtensions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's ``/generate`` fields this server does not implement."""

    rid: Any = None
    token_ids_logprob: Any = None
    lora_path: Any = None
    lora_id: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    mm_hashes: Any = None
    modalities: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: bool | None = None
    return_routed_experts: bool | None = None
    return_indexer_topk: bool | None = None
    routed_experts_start_len: int | None = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    require_reasoning: bool | None = None
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    background: bool | None = None
    conversation_id: Any = None
    priority: int | None = None
    extra_key: Any = None
    routing_key: Any = None
    no_logs: bool | None = None
    custom_labels: Any = None
    return_bytes: bool | None = None
    return_entropy: bool | None = None
    return_prompt_token_ids: bool | None = None
    use_audio_in_video: bool | None = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None


GENERATE: dict[str, Extension] = _table(
    # Request ids are the server's: a client's could collide with another's.
    Extension("rid", SGLANG),
    *(
        Extension(name, SGLANG)
        for name in (
            "token_ids_logprob",
            "lora_path",
            "lora_id",
            "image_data",
            "video_data",
            "audio_data",
            "input_embeds",
            "mm_hashes",
            "modalities",
            "session_params",
            "custom_logit_processor",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "bootstrap_pair_key",
            "decode_tp_size",
            "conversation_id",
            "extra_key",
            "routing_key",
            "custom_labels",
            "max_dynamic_patch",
            "min_dynamic_patch",
        )
    ),
    *(
        Extension(name, SGLANG, (False,))
        for name in (
            "return_hidden_states",
            "return_routed_experts",
            "return_indexer_topk",
            "require_reasoning",
            "background",
            # no_logs asks that nothing of the request be logged: not promised.
            "no_logs",
            "return_bytes",
            "return_entropy",
            "return_prompt_token_ids",
            "use_audio_in_video",
        )
    ),
    Extension("routed_experts_start_len", SGLANG, (0,)),
    *(
        Extension(name, SGLANG, _ONE_RANK)
        for name in ("routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank")
    ),
    Extension("priority", SGLANG, (0,)),
)


class SamplingExtensions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's ``sampling_params`` fields beyond the ones every server has."""

    no_stop_trim: bool | None = None
    min_new_tokens: int | None = None
    spaces_between_special_tokens: bool | None = None
    json_schema: Any = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: Any = None
    stop_regex: Any = None
    custom_params: Any = None
    stream_interval: Any = None


SAMPLING: dict[str, Extension] = _table(
    Extension("no_stop_trim", SGLANG, honoured=True),
    Extension("min_new_tokens", SGLANG, (0,)),
    Extension("spaces_between_special_tokens", SGLANG, (True,)),
    *(Extension(name, SGLANG, honoured=True) for name in ("json_schema", "regex", "ebnf")),
    *(
        Extension(name, SGLANG)
        for name in (
            "structural_tag",
            "stop_regex",
            "custom_params",
            "stream_interval",
        )
    ),
)
