"""The OpenAI API, one module per endpoint.

- ``base``: what both share (sampling fields, usage, token names in logprobs,
  the internal ``GenerateRequest``);
- ``completions``, ``chat``: each endpoint's request and response schemas,
  the requests a body becomes, and its per-request formatter;
- ``routes``: ``endpoints``, the routes the app (``front/app.py``) mounts.
"""

from radixmux.runtime.front.api.openai.routes import endpoints

__all__ = ["endpoints"]
