"""The quantized kernels against a scalar reference on every path they compile to: NEON under
qemu, and this host's own.

The library's Python tests run the kernels as built for this machine, so on x86 (here, CI) the
``__ARM_NEON`` branches never execute. tests/kernels/harness.cpp checks lt_matmul,
lt_matmul_rows, lt_matmul_panels and lt_matmul_t for all eight types against double-precision
sums over the blocks decoded by GGUF's formulas (tolerance 2e-6 of each output's sum of
|terms|). It is built with the library's own flags (``kernel_build.BASE_FLAGS``) for aarch64
by the cross compiler, with and without the dot product extension, and run under
qemu-aarch64; and built for this host with ``-march=native``, ``-march=haswell`` (the AVX2
path, where the CPU has it) and the compiler's default target, which needs only a C++
compiler. The aarch64 binaries are also read back to check
that the intended instructions were compiled (SDOT, or SMULL + SADALP without dotprod).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from llamatrain.ops.kernel_build import BASE_FLAGS, SOURCES

pytestmark = pytest.mark.slow

HARNESS = Path(__file__).parents[1] / "kernels" / "harness.cpp"
FLAGS = [flag for flag in BASE_FLAGS if flag not in ("-shared", "-fPIC")]
"""The library's flags but for those that make a shared library: the harness is a program."""

CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64-static"
SYSROOT = "/usr/aarch64-linux-gnu"
OBJDUMP = "aarch64-linux-gnu-objdump"
ARM_TOOLS = [CROSS, QEMU, OBJDUMP]
missing_arm_tools = [tool for tool in ARM_TOOLS if shutil.which(tool) is None]
needs_arm_tools = pytest.mark.skipif(
    bool(missing_arm_tools) or not Path(SYSROOT).is_dir(),
    reason=f"needs {', '.join(ARM_TOOLS)} and {SYSROOT} (Debian/Ubuntu: apt-get install "
    "g++-aarch64-linux-gnu qemu-user-static)",
)


def build(compiler: list[str], arch: list[str], binary: Path) -> Path:
    """The harness and quantized.cpp compiled into ``binary``; the compiler's errors on failure."""
    sources = [str(SOURCES / "quantized.cpp"), str(HARNESS)]
    done = subprocess.run(
        [*compiler, *FLAGS, *arch, *sources, "-o", str(binary)], capture_output=True, text=True
    )
    assert done.returncode == 0, f"{shlex.join(compiler + arch)} failed:\n{done.stderr[-3000:]}"
    return binary


def run_harness(command: list[str]) -> str:
    """The harness's report; every line that failed, on failure."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    failed = [line for line in done.stdout.splitlines() if not line.endswith(" ok")]
    assert done.returncode == 0, "\n".join([*failed, done.stderr[-2000:]])
    assert done.stdout.rstrip().endswith("tolerance 2e-06 of the sum of |terms|")
    return done.stdout


def instructions(binary: Path) -> set[str]:
    """The mnemonics in ``binary``'s code."""
    listing = subprocess.run([OBJDUMP, "-d", str(binary)], capture_output=True, text=True)
    fields = (line.split("\t") for line in listing.stdout.splitlines())
    return {parts[2].split()[0] for parts in fields if len(parts) > 2 and parts[2].strip()}


@needs_arm_tools
@pytest.mark.parametrize(
    ("march", "expected", "absent"),
    [
        ("-march=armv8.2-a+dotprod", {"sdot"}, set()),
        ("-march=armv8-a", {"smull", "smull2", "sadalp"}, {"sdot"}),
    ],
    ids=["dotprod", "armv8-a"],
)
def test_neon_paths_under_qemu(tmp_path, march, expected, absent):
    binary = build([CROSS], [march], tmp_path / "harness")
    compiled = instructions(binary)
    assert expected <= compiled and not absent & compiled, sorted(expected - compiled)
    # 8 types x 2 shapes x 5 row counts x 4 entry points, each within tolerance
    report = run_harness([QEMU, "-L", SYSROOT, str(binary)])
    assert report.count(" ok\n") == 320


def host_has_avx2() -> bool:
    """Whether this CPU runs ``-march=haswell`` code (AVX2, FMA, F16C)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.is_file() else set()
    return {"avx2", "fma", "f16c"} <= flags


haswell = pytest.param(
    ["-march=haswell"],
    id="haswell",
    marks=pytest.mark.skipif(not host_has_avx2(), reason="this CPU has no AVX2/FMA/F16C"),
)


@pytest.mark.parametrize(
    "arch", [["-march=native"], haswell, []], ids=["native", "haswell", "default-target"]
)
def test_host_paths(tmp_path, arch):
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    if shutil.which(compiler[0]) is None:
        pytest.fail(f"no C++ compiler ({compiler[0]}; set CXX) to build the harness", pytrace=False)
    report = run_harness([str(build(compiler, arch, tmp_path / "harness"))])
    assert report.count(" ok\n") == 320
