"""radixmux.model_runners: model processes that keep their KV in the shared arena.

Modules (import what you need; nothing is imported here, to keep start-up light):

* ``fetch``            embedded GGUF models -> local HF folders (CLI)
* ``loader``           load by short name, HF folder or GGUF; ``LoadedModel``
* ``info``             ``ModelInfo`` (layout, limits, fingerprints)
* ``fingerprint``      tokenizer and weights fingerprints
* ``kv_store``         slot-addressed K/V access on the arena view
* ``paged_attention``  the attention function registered with transformers
* ``model_runner``     ``ModelRunner.forward(ForwardBatch) -> ForwardResult``
* ``sampling``         batched sampling and logprobs
* ``protocol``         messages between scheduler and runner
* ``runner_process``   the runner process (ZeroMQ DEALER loop)
"""
