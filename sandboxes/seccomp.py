"""The syscall filter every sandboxed command runs under (bwrap `--seccomp FD`), modelled on Docker's default profile.

Namespaces, dropped capabilities and an unprivileged uid already make most of these calls fail; the filter is
the second wall, for kernel bugs and for per-uid kernel state that namespaces do not separate (all forks run as
one host uid). Everything not listed is allowed, so ordinary programs (compilers, test runners, package
managers, debuggers inside the sandbox) are unaffected; a denied call fails with EPERM, as under Docker, and
the few that draw on a budget shared by all forks fail with ENOSYS, as if the kernel lacked them.

The filter is built with libseccomp (through `pyseccomp`, a ctypes binding) rather than hand-written BPF, for the
native architecture; a syscall made through another ABI (32-bit `int 0x80` on x86-64, x32) kills the process, so
the list cannot be bypassed by switching ABIs. bwrap installs it after its own set-up, right before it execs the
command, so it does not need to allow anything bwrap itself uses.
"""

from __future__ import annotations

import errno
import platform

from sandboxes.types import BackendUnavailableError

# name -> why it is denied. Names unknown to this kernel's architecture are skipped.
DENIED = {
  # the kernel keyring is per host uid, not per namespace: one fork could leave data for another
  "add_key": "keyring (cross-sandbox channel)", "keyctl": "keyring", "request_key": "keyring",
  # large kernel attack surface, no use to a test suite
  "bpf": "eBPF programs", "perf_event_open": "perf events (attack surface, side channels)",
  "userfaultfd": "used to widen kernel race windows", "io_uring_setup": "io_uring (attack surface)",
  "io_uring_enter": "io_uring", "io_uring_register": "io_uring",
  # the host's kernel itself
  "kexec_load": "load a new kernel", "kexec_file_load": "load a new kernel", "init_module": "kernel modules",
  "finit_module": "kernel modules", "delete_module": "kernel modules", "reboot": "reboot",
  "swapon": "swap", "swapoff": "swap", "acct": "process accounting", "syslog": "kernel log",
  "lookup_dcookie": "profiling", "quotactl": "quotas", "nfsservctl": "nfs", "uselib": "obsolete loader",
  "vhangup": "terminals", "iopl": "I/O ports", "ioperm": "I/O ports",
  "settimeofday": "host clock", "clock_settime": "host clock", "clock_adjtime": "host clock", "adjtimex": "host clock",
  # file handles bypass path-based checks (the "shocker" container escape)
  "open_by_handle_at": "file handles", "name_to_handle_at": "file handles",
  # new mounts and namespaces: bwrap has made every one the sandbox needs
  "mount": "mounts", "umount2": "mounts", "pivot_root": "mounts", "chroot": "mounts", "fsopen": "mounts",
  "fsconfig": "mounts", "fsmount": "mounts", "fspick": "mounts", "move_mount": "mounts", "open_tree": "mounts",
  "mount_setattr": "mounts", "open_tree_attr": "mounts", "unshare": "namespaces", "setns": "namespaces",
  # per-process LDT: 16-bit segments, the base of several kernel exploits; Docker denies it too
  "modify_ldt": "LDT (attack surface)",
}
# name -> why it fails with ENOSYS, as on a kernel built without it, so that programs take their fallback (EPERM
# would read as a fatal error to them). Each is a budget namespaces do not split.
ABSENT = {
  # AIO contexts come out of one system-wide budget (fs.aio-max-nr): one fork could take it all, from the host
  # and every other fork, and /proc/sys/fs/aio-nr would be a channel. glibc's aio_* use threads, not this.
  "io_setup": "system-wide AIO budget",
  # queue bytes are charged to the host uid, which all forks share (RLIMIT_MSGQUEUE, 800 KiB): 9 queues in one
  # fork made mq_open fail in every other. SysV queues, semaphores and shared memory are per ipc namespace.
  "mq_open": "per-uid message queue budget",
}
# Syscalls newer than some libseccomp releases know by name. Since Linux 5.1 (number 424) a new syscall has one
# number on every architecture but alpha, ia64 and mips; elsewhere an unknown name is skipped.
UNIFIED_NUMBERS = {"open_tree_attr": 467}
UNIFIED_ARCHES = ("x86_64", "aarch64", "riscv64", "s390x", "ppc64le", "ppc64", "loongarch64")


def syscall_number(name: str) -> int | None:
  """The native number of `name`, or None where this architecture has no such syscall (e.g. iopl on arm64)."""
  import pyseccomp

  nr = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
  if nr < 0 and name in UNIFIED_NUMBERS and platform.machine() in UNIFIED_ARCHES:
    return UNIFIED_NUMBERS[name]
  return nr if nr >= 0 else None


def build(path: str) -> None:
  """Writes the filter as BPF (what bwrap's `--seccomp FD` reads) to `path`.

  Raises:
    BackendUnavailableError: libseccomp or its binding is missing (with how to install them).
  """
  try:
    import pyseccomp
  except (ImportError, RuntimeError) as e:  # RuntimeError: the binding is there but libseccomp.so is not
    raise BackendUnavailableError(
      f"cannot build the sandbox's syscall filter ({e}): install libseccomp (Debian/Ubuntu: `apt-get install "
      "libseccomp2`, usually present) and `pip install pyseccomp==0.1.2` (a project dependency), or pass "
      "BwrapBackend(seccomp=False) to run without the filter") from e
  f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
  try:  # a binary search over syscall numbers (~6 checks per syscall) instead of one check per rule
    f.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, 2)
  except OSError:
    pass  # libseccomp < 2.5: the linear filter is as correct, a little slower per syscall
  for names, err in ((DENIED, errno.EPERM), (ABSENT, errno.ENOSYS)):
    for name in names:
      nr = syscall_number(name)
      if nr is not None:
        f.add_rule(pyseccomp.ERRNO(err), nr)
  with open(path, "wb") as out:
    f.export_bpf(out)
