"""Run a command where the kernel refuses IPv6 sockets, as a kernel booted with `ipv6.disable=1` does.

    python -m stepscope_testkit.no_ipv6 COMMAND [ARG ...]

A seccomp filter (libseccomp, through ctypes) makes `socket(AF_INET6, ...)` fail with EAFNOSUPPORT, the error
such a kernel gives; every other call goes through. The filter is the kernel's own, so the command meets the
refusal exactly where it would on such a node, not a Python stand-in for it. Needs libseccomp (Debian's
libseccomp2) on Linux: `available()` says why not otherwise.
"""

import ctypes
import ctypes.util
import errno
import os
import socket
import sys

_ALLOW = 0x7FFF0000  # SCMP_ACT_ALLOW
_ERRNO = 0x00050000  # SCMP_ACT_ERRNO(x) is this | x
_CMP_EQ = 4  # SCMP_CMP_EQ in enum scmp_compare


class _ArgCmp(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp: argument `arg` compared with `op` to `datum_a`."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _library() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("seccomp")
    if not sys.platform.startswith("linux") or name is None:
        return None
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    return lib


def available() -> str:
    """Why commands cannot be run without IPv6 here ("" when they can)."""
    return "" if _library() is not None else "no libseccomp here (Linux with Debian's libseccomp2)"


def refuse_ipv6_sockets() -> None:
    """From now on, in this process and what it executes, socket(AF_INET6, ...) fails with EAFNOSUPPORT."""
    lib = _library()
    if lib is None:
        raise RuntimeError(available())
    context = lib.seccomp_init(_ALLOW)
    family = _ArgCmp(0, _CMP_EQ, socket.AF_INET6, 0)
    syscall = lib.seccomp_syscall_resolve_name(b"socket")
    if lib.seccomp_rule_add_array(context, _ERRNO | errno.EAFNOSUPPORT, syscall, 1, ctypes.byref(family)) != 0:
        raise RuntimeError("libseccomp refused the rule on socket()")
    if lib.seccomp_load(context) != 0:
        raise RuntimeError("libseccomp could not load the filter")


if __name__ == "__main__":
    refuse_ipv6_sockets()
    os.execvp(sys.argv[1], sys.argv[1:])
