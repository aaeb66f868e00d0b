"""A tarball turned into a directory in node-local storage, published atomically: what both ways
of staging do, the trainers' `--stage-tar` (xscale.staging: local rank 0 unpacks for its node)
and the batch host's `jobs/lib/stage` (one task per node unpacks the copy sbcast brought).

    publish(archive, dest, name, identity, marker, sha256=..., need_bytes=...)

checks the archive's sha256 and the free space when asked, unpacks into DEST/.NAME.XXXX.partial,
renames that to DEST/NAME and only then writes MARKER with IDENTITY: a job that dies mid-unpack,
or a node whose /tmp fills, leaves a .partial directory that nothing reads, never a half-filled
DEST/NAME (rename(2) within one file system is atomic). A DEST/NAME whose marker already holds
IDENTITY is reused as it is.

Shared with the batch host, so standard library only, no syntax newer than Python 3.6, and no
import from the xscale package (jobs/lib/shared.py loads this file by path).
"""

import contextlib
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile

# Every name staging strips to name what it unpacks; the compressed ones gain nothing from
# sbcast's lz4 in flight.
SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst", ".tar")
COMPRESSED = (".gz", ".tgz", ".bz2", ".xz", ".zst")
PAGE = 4096


class ArchiveError(Exception):
    """Why an archive could not be published, in one line."""


def stem(name):
    """data-resnet-small.tar.gz -> data-resnet-small; a name without a known suffix stays."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def is_compressed(name):
    return name.endswith(COMPRESSED)


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unpacked_bytes(path):
    """What unpacking ARCHIVE takes on a tmpfs: each file rounded up to whole pages, plus a page
    per entry for its inode and directory entry (an estimate that errs on the large side). Reads
    only the headers of a plain tar; a compressed one is read through."""
    try:
        with open_tar(path) as reader:
            return sum(PAGE * ((member.size + PAGE - 1) // PAGE + 1) for member in reader)
    except (OSError, tarfile.TarError):
        raise ArchiveError("%s is not an archive tar can list" % path) from None


def free_bytes(directory):
    """The bytes an unprivileged user may still write in DIRECTORY's file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def mib(size):
    return (size + (1 << 20) - 1) >> 20


def write_atomic(path, text):
    partial = "%s.%d.new" % (path, os.getpid())
    with open(partial, "w") as handle:
        handle.write(text)
    os.replace(partial, path)


def read_marker(marker):
    try:
        with open(marker) as handle:
            return handle.read()
    except OSError:
        return None


def is_published(target, marker, identity):
    return os.path.isdir(target) and read_marker(marker) == identity


def publish(archive, dest, name, identity, marker, sha256_hex=None, need_bytes=None):
    """Unpack ARCHIVE into DEST/NAME unless MARKER already holds IDENTITY there; 'published' or
    'reused'. Raises ArchiveError (nothing published) for a checksum other than SHA256_HEX, less
    free space than NEED_BYTES, or an archive that does not unpack."""
    target = os.path.join(dest, name)
    if is_published(target, marker, identity):
        return "reused"
    if sha256_hex is not None:
        got = sha256(archive)
        if got != sha256_hex:
            raise ArchiveError("checksum mismatch for %s (expected %s, got %s)"
                               % (archive, sha256_hex, got))
    if need_bytes is not None:
        free = free_bytes(dest)
        if free < need_bytes:
            raise ArchiveError("no space left in %s (needs %d MiB, has %d MiB)"
                               % (dest, mib(need_bytes), mib(free)))
    if os.path.lexists(marker):
        os.remove(marker)
    partial = tempfile.mkdtemp(prefix="." + name + ".", suffix=".partial", dir=dest)
    try:
        extract(archive, partial)
    except ArchiveError as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise ArchiveError("cannot unpack %s into %s: %s" % (archive, dest, error)) from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    replace_directory(partial, target)
    write_atomic(marker, identity)
    return "published"


def replace_directory(new, target):
    """Rename NEW to TARGET; an older TARGET is moved aside first and removed after, so that
    TARGET is never half there."""
    if os.path.lexists(target):
        old = tempfile.mkdtemp(prefix="." + os.path.basename(target) + ".",
                               suffix=".old", dir=os.path.dirname(target))
        os.rename(target, os.path.join(old, "previous"))
        shutil.rmtree(old, ignore_errors=True)
    os.rename(new, target)


def extract(archive, into):
    """GNU tar where there is one: on 20,000 small files it unpacked five times faster than
    tarfile (0.46 s against 2.3 s here), and it reads zstd too. It owns the files itself
    (--no-same-owner: a root's unpacking keeps no uid from another system), strips leading '/'
    and skips '..' members. Without it, tarfile, with its 'data' filter where Python has one."""
    tar = shutil.which("tar")
    if tar is None:
        extract_with_tarfile(archive, into)
        return
    proc = subprocess.run([tar, "-x", "--no-same-owner", "-f", archive, "-C", into],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          universal_newlines=True)
    if proc.returncode != 0:
        raise ArchiveError(tar_cause(proc.stderr))


def tar_cause(stderr):
    """The last line tar printed, without its "tar: " prefixes: the cause ("No space left on
    device"), not the list of files it could not write."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1].replace("tar: ", "") if lines else "tar failed"


class _OwnFiles(tarfile.TarFile):
    def chown(self, *args, **kwargs):  # as tar --no-same-owner
        pass


@contextlib.contextmanager
def open_tar(path):
    """ARCHIVE for reading; tarfile reads gzip, bzip2 and xz itself, zstd (before Python 3.14)
    only through the zstd program, as a stream."""
    if not path.endswith(".zst"):
        with _OwnFiles.open(path) as reader:
            yield reader
        return
    proc = subprocess.Popen(["zstd", "-dcq", "--", path], stdout=subprocess.PIPE)
    try:
        with _OwnFiles.open(fileobj=proc.stdout, mode="r|") as reader:
            yield reader
    finally:
        proc.stdout.close()
        proc.wait()


def extract_with_tarfile(archive, into):
    try:
        with open_tar(archive) as reader:
            if hasattr(tarfile, "data_filter"):  # PEP 706: no absolute paths, no links out
                reader.extractall(into, filter="data")
            else:
                reader.extractall(into)
    except (OSError, tarfile.TarError) as error:
        raise ArchiveError(" ".join(str(error).split())) from None
