"""One module per HTTP API, each with its types, conversion, formatting and ``endpoints``:
``openai``, ``native`` (SGLang's ``/generate``), ``tokenize``, ``ops`` (health,
info, cache control, metrics), ``models`` (load, unload, reload), ``warmup``,
``dashboard``; ``common`` holds what they share, ``extensions`` the SGLang and
vLLM extension fields each endpoint accepts.
"""
