#!/usr/bin/env python3
"""Flip one byte in every peer snapshot the given processes hold in memory (fault.sh
corrupt-snapshots): the memory fault a snapshot's CRC-32 is there to catch.

A snapshot copy (python/xscale/recovery/snapshots.py) starts with a header: the magic
b"xscsnap1", the step, the payload's bytes and its CRC-32. This reads each process's writable
anonymous memory through /proc/PID/mem (root), takes as a copy every magic whose size fits and
whose payload matches its CRC-32 (the magic alone also sits in the code's constants), and writes
the payload's first byte inverted. The processes should be stopped meanwhile (fault.sh does).
Prints one line per process: its pid and the steps of the copies it corrupted.

    corrupt_snapshots.py PID...
"""

import os
import struct
import sys
import zlib

HEADER = struct.Struct("<8sqQQ")  # as python/xscale/recovery/snapshots.py writes it
MAGIC = b"xscsnap1"
CHUNK = 64 << 20


def writable_regions(pid):
    """(start, end) of PID's private writable mappings that no file backs."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            if fields[1].startswith("rw") and (len(fields) < 6 or fields[5] == "[heap]"):
                start, end = (int(part, 16) for part in fields[0].split("-"))
                yield start, end


def magics(mem, start, end):
    """The addresses of MAGIC in [start, end), read a chunk at a time."""
    address = start
    while address < end:
        try:
            chunk = os.pread(mem, min(CHUNK + len(MAGIC) - 1, end - address), address)
        except OSError:  # a mapping gone meanwhile, or not readable
            return
        found = chunk.find(MAGIC)
        while found >= 0:
            yield address + found
            found = chunk.find(MAGIC, found + 1)
        address += CHUNK


def corrupt(pid):
    """Flip a byte in each whole snapshot copy in PID's memory; the steps of those copies."""
    steps = []
    mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        for start, end in writable_regions(pid):
            for address in magics(mem, start, end):
                _, step, size, crc = HEADER.unpack(os.pread(mem, HEADER.size, address))
                payload_at = address + HEADER.size
                if size == 0 or payload_at + size > end:
                    continue
                if zlib.crc32(os.pread(mem, size, payload_at)) != crc:
                    continue
                first = os.pread(mem, 1, payload_at)[0]
                os.pwrite(mem, bytes([first ^ 0xFF]), payload_at)
                steps.append(step)
    finally:
        os.close(mem)
    return steps


def main(argv):
    if not argv:
        sys.exit("usage: corrupt_snapshots.py PID...")
    for pid in map(int, argv):
        try:
            steps = corrupt(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue  # not a rank: a process that ended meanwhile
        if steps:
            print(f"pid {pid}: corrupted the snapshots of steps {sorted(steps)}")


if __name__ == "__main__":
    main(sys.argv[1:])
