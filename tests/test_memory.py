"""models/memory.py: release_memory returns freed heap pages to the OS (glibc), which a plain gc.collect does not."""

import subprocess
import sys

import pytest

PROBE = r"""
import gc, os
from models.memory import release_memory

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

blocks = [bytearray(60_000) for _ in range(4000)]  # ~240 MB in heap-sized chunks (below mmap's threshold)
keep = bytearray(60_000)  # allocated last, so the freed chunks lie below a live one: no trim at the top
del blocks
gc.collect()
before = rss_mb()
release_memory()
print(before, rss_mb())
"""


def test_release_memory_returns_freed_heap_to_the_os():
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/statm")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    before, after = map(float, out.split())
    assert before > 200, f"the probe's freed blocks were not resident: {before:.0f} MB"
    assert after < before - 150, f"RSS {before:.0f} MB -> {after:.0f} MB after release_memory"


@pytest.mark.parametrize("preset, expected", [(None, "16"), ("64", "64")])
def test_importing_models_caps_onednn_primitive_cache_unless_the_environment_sets_it(preset, expected):
    """oneDNN reads ONEDNN_PRIMITIVE_CACHE_CAPACITY when it first builds a primitive; importing `models` must
    set it before then (a bf16 matmul after the import), and a user's own setting wins."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    if preset is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = preset
    code = "import os, models; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == expected
