"""fault.sh slow-reads: a data directory whose reads on one virtual node come at RATE bytes per
second, as from a file system client that is slow or overloaded (a Lustre client out of credits,
a congested storage link); the other nodes read it as fast as ever.

    python tests/cluster/slow_reads.py DIR RATE    (inside the node's mount namespace)

A read-only FUSE file system (fusepy) is mounted over DIR itself, in the node's own mount
namespace, so that the job's paths are unchanged. It serves the directory underneath through a
descriptor opened before the mount. `direct_io` keeps the kernel's page cache out of it: every
read, the second epoch's too, comes through here and waits its turn. All reads share one budget
of RATE bytes per second, as the reads of one client share its link. The waits are the fault
itself, not synchronisation. fault.sh heal unmounts it (umount in the node), which ends this
process.
"""

import errno
import os
import sys
import threading
import time

from fuse import FUSE, FuseOSError, Operations

ATTRIBUTES = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime", "st_mtime",
              "st_ctime")


class SlowReads(Operations):
    """DIR as it was before the mount, read-only, its reads at RATE bytes per second."""

    def __init__(self, root_fd, rate):
        self.root_fd, self.rate = root_fd, rate
        self.lock = threading.Lock()
        self.free_at = 0.0  # when the budget can take the next read

    def _relative(self, path):
        return path.lstrip("/") or "."

    def getattr(self, path, fh=None):
        try:
            found = os.stat(self._relative(path), dir_fd=self.root_fd, follow_symlinks=False)
        except OSError as error:
            raise FuseOSError(error.errno) from None
        return {name: getattr(found, name) for name in ATTRIBUTES}

    def readdir(self, path, fh):
        fd = os.open(self._relative(path), os.O_RDONLY | os.O_DIRECTORY, dir_fd=self.root_fd)
        try:
            return [".", "..", *os.listdir(fd)]
        finally:
            os.close(fd)

    def open(self, path, flags):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise FuseOSError(errno.EROFS)
        return os.open(self._relative(path), os.O_RDONLY, dir_fd=self.root_fd)

    def read(self, path, size, offset, fh):
        data = os.pread(fh, size, offset)
        self._wait_for_budget(len(data))
        return data

    def _wait_for_budget(self, size):
        with self.lock:
            now = time.monotonic()
            self.free_at = max(self.free_at, now) + size / self.rate
            until = self.free_at
        time.sleep(max(until - now, 0.0))

    def release(self, path, fh):
        os.close(fh)

    def statfs(self, path):
        found = os.fstatvfs(self.root_fd)
        return {name: getattr(found, name) for name in (
            "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
            "f_favail", "f_namemax")}


def main(directory, rate):
    root_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)  # before the mount hides it
    FUSE(SlowReads(root_fd, rate), directory, foreground=True, ro=True, direct_io=True,
         allow_other=True, nonempty=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
