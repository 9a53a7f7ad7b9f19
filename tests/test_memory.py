"""models/memory.py: release_memory returns freed heap pages to the OS (glibc), which a plain gc.collect does not."""

import os
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


@pytest.mark.parametrize("variable", ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"])
@pytest.mark.parametrize("preset, expected", [(None, "16"), ("64", "64")])
def test_importing_models_caps_the_primitive_caches_unless_the_environment_sets_them(variable, preset, expected):
    """oneDNN and ideep read their cache capacities when they first build a primitive; importing `models` must
    set them before then (a bf16 matmul after the import), and a user's own setting wins."""
    code = f"import os, models; print(os.environ['{variable}'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=environment_with(variable, preset))
    assert out.stdout.strip() == expected


SHAPES_PROBE = r"""
import ctypes
import torch
from models.memory import release_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2

def in_use_mb():
    release_memory()
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20

weight = torch.randn(1536, 576, requires_grad=True)
before = in_use_mb()
for rows in range(300, 700, 5):  # a training round's packed sequence lengths: a new matmul shape each
    with torch.autocast("cpu", torch.bfloat16):
        out = torch.nn.functional.linear(torch.randn(rows, 576), weight)
    out.float().sum().backward()
del out
print(in_use_mb() - before)
"""


def test_bf16_matmuls_of_many_shapes_leave_little_heap_behind():
    """ideep's per-thread primitive cache, at its default 1024 entries, kept what it built for every shape a
    bf16 matmul met (about 50 MB over 80 shapes here, 0.19 GiB over a training round); capped by importing
    `models`, less than half of it (12.7 MB here). Only where torch runs bf16 matmuls through oneDNN."""
    import torch

    from models.devices import native_bf16

    if not sys.platform.startswith("linux") or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("bf16 matmuls do not run through oneDNN on this CPU")
    if not native_bf16("cpu"):  # AVX-512 without AVX512_BF16/AMX: seen leaving 6.9 MB over the 80 shapes
        pytest.skip("no native bf16 on this CPU: oneDNN emulates bf16 and caches little per shape (training "
                    "autocasts to bf16 only with native bf16)")

    def left_mb(capacity: str | None) -> float:
        out = subprocess.run([sys.executable, "-c", SHAPES_PROBE], capture_output=True, text=True, check=True,
                             env=environment_with("LRU_CACHE_CAPACITY", capacity))
        return float(out.stdout.split()[-1])

    uncapped, capped = left_mb("1024"), left_mb(None)
    assert uncapped > 25, f"the probe's 80 shapes left only {uncapped:.1f} MB uncapped: it measures nothing"
    assert capped < uncapped / 2, f"{capped:.1f} MB left with the cap against {uncapped:.1f} MB without"


def environment_with(variable: str, value: str | None) -> dict[str, str]:
    """This process's environment with `variable` set to `value`, or unset when None."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    return env


def test_only_new_objects_freezes_what_exists_and_collects_what_the_block_makes():
    """Inside the block the collector skips what existed before it (gc.freeze), yet a reference cycle the block
    makes is still collected; an inner block changes nothing; the end gives the frozen objects back."""
    import gc
    import weakref

    from models.memory import only_new_objects, release_memory

    class Node:
        pass

    assert gc.get_freeze_count() == 0
    with only_new_objects():
        frozen = gc.get_freeze_count()
        assert frozen > 1000
        cycle = Node()
        cycle.me = cycle
        gone = weakref.ref(cycle)
        with only_new_objects():  # a stage inside the flow: it freezes nothing the outer block made
            # (the count itself may fall: a frozen object still frees itself by reference counting, e.g. a
            # test worker's, so CI's xdist worker saw 925961 after 926003)
            assert gc.get_freeze_count() <= frozen
            assert any(o is cycle for o in gc.get_objects())  # still in a collected generation, not frozen
        del cycle
        release_memory()
        assert gone() is None
    assert gc.get_freeze_count() == 0
