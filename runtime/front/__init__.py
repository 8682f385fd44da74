"""The HTTP front: one process serving HTTP (OpenAI, SGLang-native, operations) and
the Python ZMQ client, over the same request hub.

- ``server.py``: the process (``python -m radixmux.runtime.front.server``).
- ``state.py``: ``Front``, what the process holds and every API reads.
- ``app.py``: the ASGI app: every API's routes, the OpenAPI document, errors,
  the API key guard; ``guard.py``: Host / Origin / content-type checks.
- ``hub.py``: the ZeroMQ sockets and one request's life (``InFlight``);
  ``stream.py``: serving one generation as SSE or one JSON body.
- ``zmq_server.py``: the ROUTER socket the Python client talks to.
- ``model_changes.py``: loads, unloads and reloads at run time (HTTP and ZMQ).
- ``openapi.py``: ``/openapi.json`` and ``/docs``; ``metrics.py``: ``/metrics``.
- ``api/``: one module per API (its types, conversion, formatting and routes).
"""
