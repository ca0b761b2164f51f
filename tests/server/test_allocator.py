"""The server's allocator settings against its most frequent large allocation: asyncio's read.

Each socket read allocates ``recv(256 KiB)`` and shrinks it. With glibc's mmap threshold at or
below that size, every read mapped a fresh region and faulted its first page in; the server
fixed the threshold at 256 KiB for the attacks of docs/reliability.md and paid that on every
frame a client sent (an mmap, an mremap and a munmap per read, under strace). The page faults
of the reads are what the two settings are told apart by here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from duplex_actors.server import memory

pytestmark = pytest.mark.skipif(memory._GLIBC is None, reason="the thresholds are glibc's")

READS = 2000

_PROBE = """
import resource, socket, sys
from duplex_actors.server import memory
mmap_threshold, trim_threshold = (int(x) if x != "-" else None for x in sys.argv[1:3])
assert memory.configure_allocator(mmap_threshold, trim_threshold)
a, b = socket.socketpair()
frame = b"x" * 1330  # a 20 ms append of 24 kHz audio, as text
def reads(n):
    for _ in range(n):
        a.send(frame)
        b.recv(memory.ASYNCIO_READ_SIZE)
# A server's heap is in use: its free chunks are taken by what it holds, so a read is carved
# from the top of the heap or mapped (a fresh interpreter's heap may hold a large free chunk
# that a read would reuse whatever the thresholds).
keep = [bytearray(100 << 10) for _ in range(200)]
reads(200)  # the heap settles under the reads first
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
reads(int(sys.argv[3]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_per_read(mmap_threshold: int, trim_threshold: int | None) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(mmap_threshold), str(trim_threshold or "-"), str(READS)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(out.stdout) / READS


def test_a_socket_read_is_served_from_the_heap_without_a_page_fault():
    assert memory.MMAP_THRESHOLD > memory.ASYNCIO_READ_SIZE
    assert memory.TRIM_THRESHOLD > 2 * memory.ASYNCIO_READ_SIZE
    assert _faults_per_read(memory.MMAP_THRESHOLD, memory.TRIM_THRESHOLD) < 0.05


def test_the_former_threshold_mapped_every_read():
    # The control: the probe does tell the two apart.
    assert _faults_per_read(256 << 10, None) >= 0.95
