"""radixmux.model_runners: model processes that keep their KV in the shared arena.

Modules (import what you need; nothing is imported here, to keep start-up light):

* ``runner_process``   the runner process: one model, the arena, a ZeroMQ loop
* ``model_runner``     ``ModelRunner.forward(ForwardBatch) -> ForwardResult``
* ``sampling``         batched sampling and logprobs
* ``paged_attention``  the attention function registered with transformers
* ``paged_decode``     the C++ kernels (``kernels/``): paged decode, cascade, extend, fused ops
* ``kv_store``         slot-addressed K/V access on the arena view
* ``fused_ops``        fused RMSNorm / gated MLP / rotary swapped into a model
* ``lean_stack``       a Llama decoder stack without transformers' per-module Python
* ``packed_linear``    linear layers with pre-packed weights (oneDNN, AMX / AVX512-BF16 tiles)
* ``loader``           load by short name, HF folder or GGUF; ``LoadedModel``
* ``fetch``            embedded GGUF models -> local HF folders (CLI)
* ``info``             what a config says about attention windows and end tokens
* ``fingerprint``      tokenizer fingerprints and the KV-share key
"""
