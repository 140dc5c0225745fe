"""A FUSE mount that never answers: a hung NFS or Lustre mount, on demand, for tests of code that stats filesystems.

    reason = hung_mount_available()
    if reason:
        pytest.skip(reason)
    with hung_mount(tmp_path / "mnt") as mnt:
        ...   # os.statvfs(mnt) / os.stat(mnt) now block in the kernel, in any thread or process

The filesystem is served by hand on /dev/fuse (no libfuse, fusepy or fusermount): a daemon thread answers the
kernel's INIT handshake, then reads every request (statfs, getattr, lookup, ...) and answers none of them, so
the caller waits in the kernel just as it would on a dead NFS server. The one exception is an interrupt: when
a blocked caller is signalled, the kernel asks the filesystem to give the request up, and this one fails it
with EINTR. Without that a caller the kernel already handed to the filesystem cannot even be killed (FUSE
waits out such a request uninterruptibly), so `subprocess.run(..., timeout=...)`, which kills its child and
then waits for it, would hang; NFS's hard mounts also let SIGKILL through.

Leaving the context aborts the connection, so every blocked caller returns at once with ENOTCONN, and
lazily unmounts the mount point, so nothing stays mounted even while callers are still on their way out.
Needs root (CAP_SYS_ADMIN), /dev/fuse and the fuse filesystem; `hung_mount_available` says why not.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import select
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2
CAP_SYS_ADMIN = 21
FUSE_INIT = 26
FUSE_INTERRUPT = 36
FUSE_MINOR = 31  # the protocol minor we answer with, at most; fuse_init_out has been 64 bytes since 7.23
IN_HEADER = struct.Struct("<IIQQIIII")  # fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, padding
OUT_HEADER = struct.Struct("<IiQ")  # fuse_out_header: len, error, unique
INIT_IN = struct.Struct("<IIII")  # the start of fuse_init_in: major, minor, max_readahead, flags
# fuse_init_out: major, minor, max_readahead, flags, max_background, congestion_threshold, max_write,
# time_gran, max_pages, map_alignment, flags2, unused[7]
INIT_OUT = struct.Struct("<IIIIHHIIHHI7I")
INTERRUPT_IN = struct.Struct("<Q")  # fuse_interrupt_in: the unique of the request to give up
# The kernel refuses a read that could not hold a request with max_write bytes of data: room for 1 MiB.
READ_SIZE = 1024 * 1024 + 4096
CONNECTIONS = Path("/sys/fs/fuse/connections")  # fusectl, where it is mounted: one directory per connection

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


@contextlib.contextmanager
def hung_mount(mountpoint: Path) -> Iterator[Path]:
    """Mount a never-answering FUSE filesystem on `mountpoint` (an existing empty directory) while in the context.

    Yields the resolved mount point once the kernel's INIT handshake is done, so the first stat already hangs
    rather than merely waiting for the handshake. Raises OSError where mount(2) is refused, RuntimeError where
    the handshake does not complete within 5 s.
    """
    path = Path(mountpoint).resolve()  # before mounting: resolving it afterwards would stat the hung root
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK)
    options = b"fd=%d,rootmode=40000,user_id=0,group_id=0" % fd
    if _libc.mount(b"stepscope-hung", os.fsencode(path), b"fuse", MS_NOSUID | MS_NODEV, options) != 0:
        error = ctypes.get_errno()
        os.close(fd)
        raise OSError(error, f"mount(2) of a FUSE filesystem refused: {os.strerror(error)}", str(path))
    abort = CONNECTIONS / str(_device(path)) / "abort"
    stop, initialized = threading.Event(), threading.Event()
    reader = threading.Thread(target=_serve, args=(fd, stop, initialized), name=f"hung-mount {path}", daemon=True)
    reader.start()
    try:
        if not initialized.wait(5):
            raise RuntimeError(f"the FUSE INIT handshake for {path} did not complete within 5 s")
        yield path
    finally:
        stop.set()
        with contextlib.suppress(OSError):  # fusectl is not mounted everywhere; closing the fd aborts too
            abort.write_text("1")
        reader.join(1)
        os.close(fd)  # the last reference to the connection: the kernel aborts it, failing what waits with ENOTCONN
        if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"umount2(MNT_DETACH) failed: {os.strerror(error)}", str(path))


@functools.cache
def hung_mount_available() -> str | None:
    """None where `hung_mount` works on this machine, else a one-line reason why not, for `pytest.skip`.

    Ends with a trial mount, since a container may hold every capability and still have mount(2) refused.
    """
    if not _has_cap_sys_admin():
        return "hung_mount needs root (CAP_SYS_ADMIN) to mount a FUSE filesystem"
    try:  # opening /dev/fuse also loads the fuse module where it is not loaded yet
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"hung_mount cannot open /dev/fuse: {e.strerror}"
    if "fuse" not in (line.split()[-1] for line in Path("/proc/filesystems").read_text().splitlines() if line):
        return "hung_mount needs the kernel's fuse filesystem, which /proc/filesystems does not list"
    with tempfile.TemporaryDirectory(prefix="hung-mount-probe-") as probe:
        try:
            with hung_mount(Path(probe)):
                pass
        except (OSError, RuntimeError) as e:
            return f"hung_mount cannot mount a FUSE filesystem here: {e}"
    return None


def _serve(fd: int, stop: threading.Event, initialized: threading.Event) -> None:
    """Answer INIT and interrupts, read every other request and leave it unanswered; return once stopped or aborted.

    Polls with a timeout rather than blocking in read(2): a read blocked on /dev/fuse would keep the file open
    past os.close, and with it the connection the close is meant to abort.
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not stop.is_set():
        if not poller.poll(100):
            continue
        try:
            request = os.read(fd, READ_SIZE)
        except BlockingIOError:  # the request was withdrawn (its caller signalled) before we read it
            continue
        except OSError:  # ENODEV: the connection was aborted
            return
        _, opcode, unique, *_ = IN_HEADER.unpack_from(request)
        if opcode == FUSE_INIT:
            _, minor, max_readahead, _ = INIT_IN.unpack_from(request, IN_HEADER.size)
            init = INIT_OUT.pack(7, min(minor, FUSE_MINOR), max_readahead, 0, 16, 12, 65536, 1, 0, 0, 0, *[0] * 7)
            _reply(fd, unique, 0, init)
            initialized.set()
        elif opcode == FUSE_INTERRUPT:
            (interrupted,) = INTERRUPT_IN.unpack_from(request, IN_HEADER.size)
            with contextlib.suppress(OSError):  # ENOENT: the request was answered (aborted) meanwhile
                _reply(fd, interrupted, -errno.EINTR)


def _reply(fd: int, unique: int, error: int, body: bytes = b"") -> None:
    """Write one fuse_out_header (and body) answering request `unique`: the kernel wants it in a single write."""
    os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), error, unique) + body)


def _device(path: Path) -> int:
    """The kernel's device number of the FUSE mount on `path` (fusectl's name for the connection), from mountinfo.

    Read from /proc/self/mountinfo because stat(2) on the mount point would wait for the filesystem.
    """
    device = 0
    for line in Path("/proc/self/mountinfo").read_bytes().splitlines():
        fields = line.split()
        point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])  # \040 is a space
        if point == os.fsencode(path) and fields[fields.index(b"-") + 1] == b"fuse":
            major, minor = map(int, fields[2].split(b":"))
            device = major << 20 | minor  # the last such line is the topmost mount
    return device


def _has_cap_sys_admin() -> bool:
    """Whether this process holds CAP_SYS_ADMIN, which mount(2) wants (root's, or a capable container's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    return os.geteuid() == 0
