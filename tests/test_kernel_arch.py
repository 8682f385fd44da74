"""The kernels built for an older instruction set than this CPU's (``RADIXMUX_KERNEL_ARCH``).

A CPU without AMX or AVX512-BF16 runs paths that a build for this machine
(``-march=native``) never compiles: AVX-512F without bfloat16 dot products
(Skylake-X to Ice Lake servers), AVX2, scalar loops. An AVX2-only CPU once got
no kernels at all, because the AVX2 build did not compile. Here each
older build is made on this machine, reports the paths it has, and passes the
kernel tests (the same tests, against the same references), in a process of
its own (a process loads one build). A build whose paths are the native
build's (x86-64-v3 on an AVX2-only CPU) is skipped: the suite runs those.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixmux.common.cpu import cpu_flags
from radixmux.model_runners import paged_decode

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = [
    "tests/test_paged_decode.py",
    "tests/test_cascade_decode.py",
    "tests/test_fused_ops.py",
    "tests/test_kv_write.py",
    "tests/test_runner_sampling.py",
]
# gcc -march: (what built_isa reports, the CPU flags its code needs to run)
BUILDS = {
    "x86-64-v4": ("avx512f", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    "x86-64-v3": ("avx2", {"avx2", "fma", "f16c"}),
    "x86-64": ("scalar", set()),
}


def _python(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """This interpreter run with ``args`` in the repository, under ``env``."""
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )


@pytest.mark.parametrize("arch", sorted(BUILDS))
def test_an_older_build_has_its_paths_and_passes_the_kernel_tests(arch: str) -> None:
    isa, needs = BUILDS[arch]
    if not paged_decode.load():
        pytest.skip(f"no kernel build here: {paged_decode.error()[:200]}")
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run {arch} code")
    if paged_decode.built_isa() == isa:
        # This machine's own build has the same vector paths (the #if's see
        # the same instruction sets), and the suite's kernel tests run it.
        pytest.skip(f"the native build is {isa} too: the suite's own kernel tests cover it")
    # The inner run is a pytest of its own, not a worker of this one's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env[paged_decode.ARCH_ENV] = arch
    probe = _python(
        env,
        "-c",
        "from radixmux.model_runners import paged_decode as k\n"
        "assert k.load(), k.error()\n"
        "print(k.built_isa())",
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split()[-1] == isa
    tests = _python(env, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS)
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert " passed" in tests.stdout.splitlines()[-1]


def test_a_target_that_is_not_an_arch_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(paged_decode.ARCH_ENV, "native -fplugin=x.so")
    with pytest.raises(ValueError, match="not a gcc -march name"):
        paged_decode.target_arch()
    monkeypatch.setenv(paged_decode.ARCH_ENV, "x86-64-v3")
    assert paged_decode.cflags()[-1] == "-march=x86-64-v3"
    monkeypatch.delenv(paged_decode.ARCH_ENV)
    assert paged_decode.target_arch() == "native"
