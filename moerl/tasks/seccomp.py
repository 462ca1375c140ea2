"""A seccomp deny-list for the process that runs a sandboxed call (moerl/tasks/sandbox_child.py):
no new namespaces (unshare, setns, clone with a namespace flag; clone3, whose flags seccomp
cannot read, answers ENOSYS so libc falls back to clone), no mounts, no keyrings, bpf, ptrace,
perf_event_open, userfaultfd, io_uring, kernel modules or kexec, and no uid change (the call's
real uid is what its pids limit counts). Built with ctypes, installed with
prctl(PR_SET_SECCOMP) after no_new_privs; anything else fails with EPERM.

Limitations: x86_64 and aarch64 only (`available()` says why not elsewhere); a deny-list, so a
syscall added to a later kernel is allowed until listed here.
"""

from __future__ import annotations

import ctypes
import errno
import platform

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
# clone flags that make a namespace: NEWTIME NEWNS NEWCGROUP NEWUTS NEWIPC NEWUSER NEWPID NEWNET
NS_FLAGS = (
    0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
)

# denied with EPERM (clone3: ENOSYS; clone: only with NS_FLAGS)
_DENY = (
    "unshare setns mount umount2 pivot_root chroot move_mount open_tree fsopen fsconfig fsmount "
    "fspick mount_setattr keyctl add_key request_key bpf ptrace perf_event_open userfaultfd "
    "io_uring_setup io_uring_enter io_uring_register init_module finit_module delete_module "
    "kexec_load kexec_file_load process_vm_readv process_vm_writev setuid setreuid setresuid "
    "setfsuid setgid setregid setresgid setfsgid setgroups acct swapon swapoff reboot "
    "open_by_handle_at name_to_handle_at"
).split()
_ARCH = {  # machine -> (AUDIT_ARCH, {syscall: number})
    "x86_64": (
        0xC000003E,
        dict(
            clone=56,
            clone3=435,
            unshare=272,
            setns=308,
            mount=165,
            umount2=166,
            pivot_root=155,
            chroot=161,
            move_mount=429,
            open_tree=428,
            fsopen=430,
            fsconfig=431,
            fsmount=432,
            fspick=433,
            mount_setattr=442,
            keyctl=250,
            add_key=248,
            request_key=249,
            bpf=321,
            ptrace=101,
            perf_event_open=298,
            userfaultfd=323,
            io_uring_setup=425,
            io_uring_enter=426,
            io_uring_register=427,
            init_module=175,
            finit_module=313,
            delete_module=176,
            kexec_load=246,
            kexec_file_load=320,
            process_vm_readv=310,
            process_vm_writev=311,
            setuid=105,
            setreuid=113,
            setresuid=117,
            setfsuid=122,
            setgid=106,
            setregid=114,
            setresgid=119,
            setfsgid=123,
            setgroups=116,
            acct=163,
            swapon=167,
            swapoff=168,
            reboot=169,
            open_by_handle_at=304,
            name_to_handle_at=303,
        ),
    ),
    "aarch64": (
        0xC00000B7,
        dict(
            clone=220,
            clone3=435,
            unshare=97,
            setns=268,
            mount=40,
            umount2=39,
            pivot_root=41,
            chroot=51,
            move_mount=429,
            open_tree=428,
            fsopen=430,
            fsconfig=431,
            fsmount=432,
            fspick=433,
            mount_setattr=442,
            keyctl=219,
            add_key=217,
            request_key=218,
            bpf=280,
            ptrace=117,
            perf_event_open=241,
            userfaultfd=282,
            io_uring_setup=425,
            io_uring_enter=426,
            io_uring_register=427,
            init_module=105,
            finit_module=273,
            delete_module=106,
            kexec_load=104,
            kexec_file_load=294,
            process_vm_readv=270,
            process_vm_writev=271,
            setuid=146,
            setreuid=145,
            setresuid=147,
            setfsuid=151,
            setgid=144,
            setregid=143,
            setresgid=149,
            setfsgid=152,
            setgroups=159,
            acct=89,
            swapon=224,
            swapoff=225,
            reboot=142,
            open_by_handle_at=265,
            name_to_handle_at=264,
        ),
    ),
}


class _Insn(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def available() -> str:
    """ "" if this machine's filter is known, else why not."""
    m = platform.machine()
    return "" if m in _ARCH else f"no seccomp table for {m} (x86_64 and aarch64 only)"


def program() -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k): the architecture checked, x32 refused, then each denied
    syscall, clone with a namespace flag and clone3."""
    arch, nr = _ARCH[platform.machine()]
    eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    p = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, arch), (_RET_K, 0, 0, _RET_KILL_PROCESS)]
    p += [(_LD_W_ABS, 0, 0, 0)]
    if arch == 0xC000003E:  # x32 syscalls (bit 30) would bypass the numbers below
        p += [(_JGE_K, 0, 1, 0x40000000), (_RET_K, 0, 0, eperm)]
    for name in _DENY:
        p += [(_JEQ_K, 0, 1, nr[name]), (_RET_K, 0, 0, eperm)]
    p += [(_JEQ_K, 0, 1, nr["clone3"]), (_RET_K, 0, 0, enosys)]
    # clone: its flags are the low 32 bits of args[0] (offset 16, little-endian)
    p += [(_JEQ_K, 0, 4, nr["clone"]), (_LD_W_ABS, 0, 0, 16), (_JSET_K, 0, 1, NS_FLAGS)]
    p += [(_RET_K, 0, 0, eperm), (_RET_K, 0, 0, _RET_ALLOW)]
    p += [(_RET_K, 0, 0, _RET_ALLOW)]
    return p


def install() -> None:
    """Install the filter in this process (no_new_privs must be set); raises OSError if refused."""
    why = available()
    if why:
        raise OSError(why)
    insns = program()
    arr = (_Insn * len(insns))(*[_Insn(*i) for i in insns])
    prog = _Prog(len(insns), ctypes.cast(arr, ctypes.POINTER(_Insn)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {errno.errorcode.get(err, err)}")
