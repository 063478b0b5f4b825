"""The syscall filter every sandboxed command runs under (bwrap `--seccomp FD`), modelled on Docker's default profile.

Namespaces, dropped capabilities and an unprivileged uid already make most of these calls fail; the filter is
the second wall, for kernel bugs and for per-uid kernel state that namespaces do not separate (all forks run as
one host uid). Everything not listed is allowed, so ordinary programs (compilers, test runners, package
managers, debuggers inside the sandbox) are unaffected; a denied call fails with EPERM, as under Docker.

The filter is built with libseccomp (through `pyseccomp`, a ctypes binding) rather than hand-written BPF, for the
native architecture; a syscall made through another ABI (32-bit `int 0x80` on x86-64, x32) kills the process, so
the list cannot be bypassed by switching ABIs. bwrap installs it after its own set-up, right before it execs the
command, so it does not need to allow anything bwrap itself uses.
"""

from __future__ import annotations

import errno

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
  "mount_setattr": "mounts", "unshare": "namespaces", "setns": "namespaces",
}


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
  for name in DENIED:
    if pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) < 0:
      continue  # not on this architecture (e.g. iopl on arm64)
    f.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
  with open(path, "wb") as out:
    f.export_bpf(out)
