"""Benchmarks and the soak, each run from the repository root as ``python -m bench.<name>``.

Not part of the installed ``radixmux`` package: the benchmarks drive a server
(or the library) from outside, as a user would, and the tests import their
pieces (and ``bench.tiny_models``) from the repository root.
"""
