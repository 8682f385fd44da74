"""Python's ways in: the ZMQ client of a running server and the in-process ``Engine``.

- ``client.py``: :class:`Client` (blocking) and :class:`AsyncClient` over the
  front's ZMQ socket (no HTTP).
- ``messages.py``: what they send and receive, and the model-change bodies
  the HTTP API shares.
- ``engine.py``: :class:`Engine`, the whole runtime started in-process
  (``from radixmux.runtime.client.engine import Engine``; it imports the
  launcher, which the client alone does not need).
"""

from radixmux.runtime.client.client import AsyncClient, Client, ClientError, Completion

__all__ = ["AsyncClient", "Client", "ClientError", "Completion"]
