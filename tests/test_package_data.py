"""Every file the run-time C++ builds read ships in the package.

The kernels are compiled on the serving machine from sources inside the
package (``model_runners/paged_decode.py``); an install that is not editable
copies only what ``package-data`` names, and a source left out of it turns
every kernel off there (the build fails, the torch fallbacks serve).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixmux.model_runners import paged_decode

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _shipped(package: str) -> set[Path]:
    """The files ``package-data`` ships for ``package`` (a folder of this repository)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder = ROOT / package.removeprefix("radixmux").lstrip(".").replace(".", "/")
    patterns = tool["package-data"].get(package, [])
    return {p.resolve() for pattern in patterns for p in folder.glob(pattern)}


def test_every_kernel_source_and_header_is_package_data() -> None:
    needed = {p.resolve() for p in paged_decode.SOURCES + paged_decode.HEADERS}
    assert any(p.suffix == ".h" and p.parent.name == "paged" for p in needed)  # the glob saw them
    missing = sorted(str(p.relative_to(ROOT)) for p in needed - _shipped("radixmux.model_runners"))
    assert not missing, f"not in pyproject's package-data: {missing}"
