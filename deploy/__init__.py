"""Deployment recipes, each run from the repository root as ``python -m deploy.<name>``.

Like ``bench``, not part of the installed ``radixmux`` package and above every
layer of it: a recipe starts servers (``launch.py``) and routers as processes
and talks to them over HTTP only, so it imports nothing of the runtime.
``cluster`` is the command line; ``specs`` the members' command lines,
``processes`` starts and supervises them, ``probes`` reads an instance over
HTTP, ``router_admin`` changes the router's worker list; ``k8s/`` holds the
Kubernetes manifest.
"""
