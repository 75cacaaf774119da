"""Run a command on a machine that allows no TCP or UDP socket, as the TPU machine this project
measures on does: ``python -m tests.support.no_inet CMD ARGS...``.

A seccomp filter (Linux, x86-64 or aarch64) makes every ``socket()`` call for an IPv4 or IPv6
socket fail with EAFNOSUPPORT (errno 97, what the TPU machine answers), in this process and every
process it starts; unix sockets (AF_UNIX),
netlink and the rest are left alone. The filter cannot be lifted once installed
(``PR_SET_NO_NEW_PRIVS`` too): whatever runs under it opens no internet socket at all, neither
to listen nor to connect, and one that tries gets the error instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import socket
import struct
import sys

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
# BPF opcodes (linux/filter.h): load a word at an absolute offset, jump if equal, return.
LD_ABS_W = 0x20
JEQ_K = 0x15
RET_K = 0x06
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
NR_AT, ARCH_AT, ARG0_AT = 0, 4, 16
# (audit arch, socket syscall number) of the machines this runs on
ARCHES = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}


def supported() -> bool:
    return sys.platform == "linux" and platform.machine() in ARCHES


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def install() -> None:
    """Refuse every IPv4 and IPv6 socket() from now on, here and in every child."""
    arch, nr_socket = ARCHES[platform.machine()]
    deny = SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT
    program = b"".join((
        _insn(LD_ABS_W, 0, 0, ARCH_AT),
        _insn(JEQ_K, 0, 6, arch),  # another ABI: allow (not reached by a normal program)
        _insn(LD_ABS_W, 0, 0, NR_AT),
        _insn(JEQ_K, 0, 4, nr_socket),
        _insn(LD_ABS_W, 0, 0, ARG0_AT),  # the domain (the low word, little-endian)
        _insn(JEQ_K, 1, 0, socket.AF_INET),
        _insn(JEQ_K, 0, 1, socket.AF_INET6),
        _insn(RET_K, 0, 0, deny),
        _insn(RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ))
    n = len(program) // 8
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HxxxxxxQ", n, ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog, len(fprog))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog_buffer), 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m tests.support.no_inet CMD ARGS...")
    install()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
