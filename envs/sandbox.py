"""Run model-written Python in isolated, pre-started worker processes: `run_code(code, timeout) -> str`.

Each call gets a worker started earlier with `subprocess` (a fresh `python -I` interpreter, not a fork
of the trainer: no CUDA context, no model memory, no open files), which runs the code once and exits;
a replacement starts in the background, so a call costs milliseconds, not an interpreter start. The
answer is stdout then stderr (a traceback as python prints it), cut to `max_output` bytes (the
start of stdout, the end of stderr), then one bracketed line for a timeout, a crash or a truncation.
Both streams are memfds the trainer holds too: a worker killed at its deadline or by the OOM killer
still gives what the code printed. run_code never raises for anything the code does; it raises only
when the sandbox cannot start.

What is covered (on Linux, where `unshare` may make namespaces; the start line says what was made):
- No network: a new network namespace holds only a loopback that is down, so no TCP/UDP, no DNS, no
  abstract unix sockets. Root uses it directly; other users through a user namespace. A seccomp filter
  (x86_64) allows sockets of AF_UNIX only: no AF_VSOCK (the host's port space), netlink, packet, alg.
- Files, an allow-list view: the call's root is a tmpfs of its own (pivot_root; the host's root is
  detached) holding only /usr, /bin, /sbin and /lib* (SYSTEM), the /etc files CPython and its standard
  library read (ETC; passwd, group and hosts written per call), the interpreter's own folders at their
  real paths (sys.prefix, the base prefix, the executable's folder, sysconfig's paths: a virtual
  environment's and its base's, even under home or /tmp; no other sys.path entry: not a checkout, an
  editable install or the user's site), a private /tmp (64 MiB, the working folder, gone with the call),
  /proc and /dev of its own. No home, project, data set, cache, token, /sys, /run or /var. Every mount
  is nosuid, read-only but /tmp, /dev/shm and /dev/pts, and nodev but /dev's own (a read-only mount does
  not stop a device node's reads and writes: one made on a host folder does not open). A cache or
  credential the environment names inside the interpreter's folders is covered.
  Where it cannot be built (no pivot_root number for this machine, or the kernel refuses), the
  deny-list view instead, sealed the same way: the host's files, with /dev/shm, /run, /sys/fs/cgroup,
  the trainer's home, the caches and the credential files the environment names (hidden_paths:
  HF_TOKEN_PATH, NETRC, ... CREDENTIALS) each covered at its real path by an empty tmpfs (folders) or
  /dev/null (files), the interpreter's folders under them bound back. The start line says which view is
  in force, and why.
- Devices: /dev is a read-only tmpfs of its own holding null, zero, full, random, urandom and tty (made
  anew as root, inodes of the call's own; the host's, bound in, in a user namespace), a devpts instance of
  its own (the ptys of the trainer and of other calls are not there) and a /dev/shm of 16 MiB: no GPU,
  RDMA, disk, KVM or console node is there to open (a GPU's /dev/nvidia* is mode 0666 by default).
- Processes: a pid namespace (the trainer is invisible) whose init kills every process left when the
  code returns or times out; the trainer kills the worker's process group as a backstop. The OOM killer
  takes the code first (oom_score_adj 1000; the worker keeps the trainer's value): a process of the
  call killed at its cgroup's limit is named "out of memory" in the answer, and a worker lost that way
  answers with the output so far. In a user namespace the worker ignores SIGINT (the code has its uid).
- IPC, UTS, cgroup: namespaces of its own. SysV shared memory, message queues, semaphores and POSIX
  message queues die with the call (so does the memory they hold) and are never seen by another call.
  The IPC namespace's limits are set low (IPC_LIMITS): 16 MiB of SysV shared memory in all, removed once
  no process has it attached (shm_rmid_forced; one never attached, when its creator exits), so it cannot
  outlive the processes it counts against. Under a user namespace, kernels before ~6.12 let only the
  host's root set these: there the start line says the kernel's defaults remain (not a missing layer).
  /sys/fs/cgroup, which listed every other call's cgroup and the trainer's, is not in the allow-list
  view (an empty tmpfs in the deny-list view).
- Privileges: run as root, the code drops to a uid of its own (from 2000000000 up, a block per pool
  claimed on the machine (_claim_uids: a random block, held by name and, with GRPO_SANDBOX_UID_LOCKS, by a
  file lock), no passwd entry of the host's, no files): RLIMIT_NPROC and the kernel's other per-user counts
  are then the call's own, not shared with concurrent calls; a uid is reused only after its worker is
  gone. Inside a user namespace (not root) the code loses every capability, and the namespace is the
  call's own. A session keyring of its own (the trainer's is inherited otherwise, and setuid keeps it);
  no_new_privs (no setuid binaries) either way.
- seccomp (x86_64), an allow-list (ALLOWED: what CPython, its standard library, numpy and sympy call,
  traced): anything else answers ENOSYS, as on a kernel without it (clone3: libc falls back to clone; a
  syscall newer than the list cannot pass it). EPERM for DENIED: keys, unshare, setns, clone with a
  namespace flag, mount and the new mount API, ptrace and other processes' memory, bpf, perf_event_open,
  userfaultfd, io_uring, modules, kexec, modify_ldt, uselib, and the state the kernel shares machine-wide:
  flock on any readable file, Linux AIO (fs.aio-max-nr), the page cache's direct probes (fadvise,
  readahead, mincore, cachestat; preadv2's RWF_NOWAIT is outside the list), inotify, fanotify, and
  fcntl's leases (which stall another process's open of the file) and dnotify. EPERM by argument too:
  fcntl's F_GETLK and F_OFD_GETLK (they read another call's record locks), huge pages (memfd_create's
  MFD_HUGETLB, mmap's MAP_HUGETLB, shmget's SHM_HUGETLB: the machine's reserved pool, outside the
  cgroup), prlimit64 on another process (the worker's limits). Sockets of AF_UNIX only; other arches'
  and x32 syscalls are refused.
- A cgroup per call where the trainer may make one (grpo.envs.cgroups: v1's memory and pids hierarchies
  writable, or a v2 cgroup delegated to the trainer's user): memory_mb + 64 MiB in all (every process,
  tmpfs page, memfd and shared memory of the call, the worker's interpreter; no swap where the kernel
  accounts it) and RLIMIT_NPROC + 1 processes. The worker's launcher joins it before it execs unshare, so
  the call's cgroup namespace is rooted there: the code cannot leave it. Its memory is reclaimed before
  it is removed (memory.force_empty, memory.reclaim): no dying cgroup is left, and no charge moves to the
  trainer's cgroup. The start line says whether it was made, and why not (not a missing layer: most
  unprivileged machines cannot make one; a worker that cannot join it never starts). Not made where the
  code would run as the trainer's own user without namespaces.
- rlimits, every one the code could use set rather than inherited (never raised past the trainer's):
  CPU seconds (timeout + 1), address space (memory_mb), file size 16 MiB (output included), 64 open
  files, 64 processes, no core files (RLIMIT_CORE 1, soft and hard: a pipe core_pattern still dumps at
  0), no locked memory, real-time priority, raised niceness or POSIX message-queue bytes, 256 pending
  signals, an 8 MiB stack; an environment with nothing of the trainer's. A child killed by any signal,
  real-time ones included, is reported as "[crashed: NAME ...]".
- A layer the kernel or the privileges refuse is named at start, and the sandbox refuses to start
  unless told (allow_missing=True or GRPO_SANDBOX_ALLOW_MISSING=1): the seccomp filter (not x86_64,
  or refused), a mount's read-only remount (mountinfo's escaped paths read as the kernel means them),
  a covered path, the /dev of its own, the devpts instance, the IPC limits, a uid of its own per call (no
  namespaces, or root whose uid map lacks the block), the session keyring (only matters without
  seccomp), oom_score_adj. The deny-list view in place of the allow-list one is said, not refused.

What a call can still reach:
- Reads, in the allow-list view: the system's files (/usr, /lib: those of the machine's image), the ETC
  files, the interpreter's folders (its packages, and whatever else is written there), and /proc: its
  own processes, and the machine's meminfo, cpuinfo, loadavg, uptime, kernel version and /proc/sys,
  read-only. It cannot send them anywhere, but it can print them into its observation. In the deny-list
  view: whatever its user may read outside the covered paths (the repository, data sets), and a unix
  socket file there stays connectable (read-only mounts do not stop that) if its user may write it.
- Without a cgroup per call, memory is limited per process (address space), not in total: 64
  processes, the tmpfs (/tmp's 64 and /dev/shm's 16 MiB), memfds (16 MiB each) and 16 MiB of SysV
  shared memory of one call can use about 64 x memory_mb while it runs. All of it is freed when the
  call ends (its processes, mounts and IPC die with it). CPU is limited per process (timeout + 1 s
  each), with a cgroup or without: the call's CPU share is not (a busy call slows the others on the
  same cores).
- State the kernel still shares: record locks (F_SETLK, F_OFD_SETLK: sqlite3 needs them) on a file two
  calls both see: one call's lock makes another's conflicting attempt fail. On the host's read-only files
  only read locks can be taken, which conflict with none; but a device node opens for writing: in a user
  namespace /dev/null and the others are the host's inodes, so write locks on them are a channel between
  concurrent calls (as root each call has its own). The page cache by timing: a read that is fast was
  cached (by another call, or the trainer). In a user namespace the code may lower its oom_score_adj back
  to the trainer's value (the kernel lets an unprivileged process return to the value it inherited).
  Where the trainer's own hard RLIMIT_CORE is 0 the code's is 0 too, which a pipe core_pattern ignores.
  Two trainers in two containers on one kernel claim their uid blocks apart only through a folder both
  see (GRPO_SANDBOX_UID_LOCKS); otherwise by chance (a random block of ~36,000). What would close these:
  a VM, or a filesystem and devices per call.
- The kernel: namespaces and a seccomp filter are not a VM; a kernel bug in what stays allowed is an
  escape.
- Without seccomp: other socket families and the calls above are open, and a uid's user keyring can
  pass keys to the next call that gets the same uid.
- Without namespaces (only with allow_network=True or GRPO_SANDBOX_ALLOW_NETWORK=1): network, files
  and processes that leave the process group are open; only rlimits, the uid and the folder remain.
"""
import atexit
import collections
import ctypes
import fcntl
import json
import os
import pwd
import queue
import random
import re
import resource
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import types

UID_BASE, UID_BLOCK = 2_000_000_000, 4096  # run as root, each pool's code runs as uids of a block from here
NS = ["unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--cgroup", "--fork", "--kill-child",
      "--mount-proc"]
# the workers' whole environment, never the trainer's; one BLAS thread, since threads count as processes
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "USER": "sandbox",
       "LOGNAME": "sandbox",  # getpass.getuser() without a passwd entry: the code's uid has none
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# every rlimit the code could use to reach past its call, set here rather than inherited from the trainer
# (lowered only: a hard limit below one of these, the trainer's, stays): no locked memory, real-time
# priority, raised niceness or POSIX message-queue bytes; bounded pending signals; an 8 MiB stack. No core
# dumps: 1, not 0 (soft and hard), since the kernel skips a pipe core_pattern's dump (systemd-coredump,
# apport) only at a limit of 1, and a file's at anything below a page (fs/coredump.c)
LIMITS = {"RLIMIT_FSIZE": 16 << 20, "RLIMIT_NOFILE": 64, "RLIMIT_NPROC": 64, "RLIMIT_CORE": 1,
          "RLIMIT_MEMLOCK": 0, "RLIMIT_RTPRIO": 0, "RLIMIT_NICE": 0, "RLIMIT_MSGQUEUE": 0,
          "RLIMIT_SIGPENDING": 256, "RLIMIT_STACK": 8 << 20}
# the IPC namespace's own limits (the kernel's defaults are near unlimited): SysV shared memory 16 MiB in all,
# destroyed once no process holds it (shm_rmid_forced: memory detached from every process counts against no
# address-space limit), 16 message queues of 64 KiB, a few semaphores
IPC_LIMITS = {"shmmax": 16 << 20, "shmall": 4096, "shmmni": 16, "shm_rmid_forced": 1, "msgmni": 16,
              "msgmnb": 64 << 10, "msgmax": 8192, "sem": "32 1024 32 32"}
CGROUP_PIDS = LIMITS["RLIMIT_NPROC"] + 1  # a call's cgroup: its processes (threads count) and its worker
# a call's cgroup holds memory_mb and this much more: the worker's own interpreter, and room for one process
# at its address-space limit to get MemoryError rather than the cgroup's OOM kill
CGROUP_HEADROOM_MB = 64
GRACE = 5.0  # s past the timeout before the trainer kills a worker whose init did not answer
READY_TIMEOUT = 60.0  # s a call waits for a ready worker (one starts in well under 1 s) before an error
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
# per-mount flags a user namespace may not drop, so a read-only remount must repeat them
LOCKED = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
          "relatime": 1 << 21, "strictatime": 1 << 24}
# the credentials a trainer's environment may name, files or folders (KUBECONFIG a list): covered in every call
CREDENTIALS = ["HF_TOKEN_PATH", "HF_STORED_TOKENS_PATH", "NETRC", "GOOGLE_APPLICATION_CREDENTIALS",
               "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "KUBECONFIG", "DOCKER_CONFIG", "SSH_AUTH_SOCK"]
VIEW = True  # False: every call gets the deny-list view, the fallback (its tests set it)
_libc = ctypes.CDLL(None, use_errno=True)
if __name__ != "__main__":  # the trainer's side only: a worker runs this file as a script, without the package
    from grpo.envs import cgroups


def namespaces() -> tuple[list[str] | None, str]:
    """The `unshare` prefix that isolates a worker on this machine, or None and the kernel's reason."""
    prefix = NS if os.geteuid() == 0 else [NS[0], "--user", "--map-root-user", *NS[1:]]
    try:
        r = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30, env=ENV)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"
    return (prefix, "") if r.returncode == 0 else (None, r.stderr.strip() or f"unshare exit {r.returncode}")


class Sandbox:
    """A pool of `workers` ready worker processes; `run` takes one per call and starts its replacement."""

    def __init__(self, workers: int = 4, allow_network: bool = False, max_output: int = 8192,
                 memory_mb: int = 2048, allow_missing: bool = False, ready_timeout: float = READY_TIMEOUT):
        self.prefix, reason = namespaces()
        allow_network = allow_network or os.environ.get("GRPO_SANDBOX_ALLOW_NETWORK") == "1"
        allow_missing = allow_missing or os.environ.get("GRPO_SANDBOX_ALLOW_MISSING") == "1"
        if self.prefix is None and not allow_network:
            raise RuntimeError(f"grpo.envs.sandbox: cannot isolate the network here ({reason}); pass allow_"
                               "network=True or set GRPO_SANDBOX_ALLOW_NETWORK=1 to run code without it")
        # the install's own folders only (a virtual environment's and its base's): a sys.path entry
        # elsewhere (a project, a checkout, an editable install) is not in the call's view
        python = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  os.path.dirname(sys.executable), *sysconfig.get_paths().values()]
        python = {f(p) for p in python if os.path.isabs(p) for f in (os.path.abspath, os.path.realpath)} - {"/"}
        cfg = {"max_output": max_output, "limits": {**LIMITS, "RLIMIT_AS": memory_mb << 20},
               "hide": ["/dev/shm", "/run", "/sys/fs/cgroup", *hidden_paths()],  # the deny-list view's
               "keep": sorted(p for p in python if not any(p.startswith(q + "/") for q in python)),
               "userns": "--user" in (self.prefix or []), "view": VIEW}
        self.max_output, self.ready_timeout, self._closed, self._lock = max_output, ready_timeout, False, \
            threading.Lock()
        self._exiting, self._uids, self._busy, self._spawned = [], collections.deque(), [], 0
        self._claim, self._next_uid = _claim_uids()
        self._last_uid = self._next_uid + UID_BLOCK - 1
        if self.prefix is None and os.geteuid() != 0:  # the code would run as the user that owns the folders
            self._cgroups, cgroup = {}, "the code would run as this user, without namespaces: it could lift them"
        else:
            roots, cgroup = cgroups.where()
            self._cgroups, cgroup = cgroups.make_pool(roots) if roots else ({}, cgroup)
        self._memory = (memory_mb + CGROUP_HEADROOM_MB) << 20
        self._argv = [*(self.prefix or []), sys.executable, "-I", os.path.abspath(__file__), json.dumps(cfg)]
        self._ready = queue.Queue()
        # one thread removes the calls' cgroups, off the calls' path: reclaiming one's memory takes ~1 ms
        self._removals, self._remover = queue.Queue(), threading.Thread(target=self._remove, daemon=True)
        self._remover.start()
        try:
            for _ in range(workers):
                self._ready.put(self._spawn())
            text, report, missing = self._call("print('ok')", 10.0)  # the first call: proves the workers work
        except BaseException:
            self.close()
            raise
        if text != "ok\n":
            self.close()
            raise RuntimeError(f"grpo.envs.sandbox: a worker failed at start: {text!r}")
        if missing and not allow_missing:
            self.close()
            raise RuntimeError(f"grpo.envs.sandbox: isolation layers missing here: {'; '.join(missing)}; "
                               "pass allow_missing=True or set GRPO_SANDBOX_ALLOW_MISSING=1 to run code "
                               "without them")
        cgroup = (f"a cgroup per call ({cgroup}): {memory_mb} + {CGROUP_HEADROOM_MB} MiB in all, {CGROUP_PIDS} "
                  "processes" if self._cgroups else f"no cgroup per call ({cgroup})")
        self.isolation = (f"{report}; {cgroup}; rlimits: cpu timeout+1 s, address space {memory_mb} MiB, file size "
                          f"{LIMITS['RLIMIT_FSIZE'] >> 20} MiB, {LIMITS['RLIMIT_NOFILE']} files, "
                          f"{LIMITS['RLIMIT_NPROC']} processes, {LIMITS['RLIMIT_STACK'] >> 20} MiB stack, "
                          f"{LIMITS['RLIMIT_SIGPENDING']} pending signals, no memlock, rtprio, nice or "
                          f"message queues; {workers} workers")
        if self.prefix is None:
            self.isolation += f" (namespaces refused: {reason})"
        if missing:
            self.isolation += f" (missing: {'; '.join(missing)})"
        print(f"grpo.envs.sandbox: {self.isolation}")

    def run(self, code: str, timeout: float = 10.0) -> str:
        """stdout, then stderr, then a bracketed status line if any; never raises."""
        try:
            return self._call(code, timeout)[0]
        except Exception as e:  # a lost worker is an observation for the model; the next call gets another
            return f"[sandbox error: {type(e).__name__}: {e}]"

    def _spawn(self) -> subprocess.Popen:
        """A new worker with a uid no other live worker has: RLIMIT_NPROC (and every other per-user count
        of the kernel's) is then per call. A uid comes back only once its worker was reaped (its pid
        namespace is gone by then) and 8 starts later, so a killed one has long finished dying."""
        with self._lock:
            while len(self._uids) < 8 and self._next_uid <= self._last_uid:
                if not _has_user(self._next_uid):  # never the uid of a user of this machine
                    self._uids.append(self._next_uid)
                self._next_uid += 1
            if not self._uids:
                raise RuntimeError(f"all {UID_BLOCK} uids of this pool are in use")
            uid = self._uids.popleft()
            self._spawned += 1
            name = f"call-{uid}-{self._spawned}"  # never reused: a killed worker's stays busy a few ms
        folders, fds = [], []
        try:
            if self._closed:
                raise RuntimeError("the sandbox is closed")
            if self._cgroups:
                folders = cgroups.make_call(self._cgroups, name, self._memory, CGROUP_PIDS)
            # the code's stdout and stderr, held here too: what it printed survives its worker (killed at a
            # timeout, or by the OOM killer)
            fds = [os.memfd_create("stdout"), os.memfd_create("stderr")]
            # the launcher joins the call's cgroup, then execs unshare: the worker, the code and the root of
            # the call's cgroup namespace are inside it
            w = subprocess.Popen([*cgroups.join_argv(folders), *self._argv, str(uid), *map(str, fds)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
                                 cwd="/", start_new_session=True, pass_fds=fds)
        except BaseException:
            self._uids.append(uid)
            cgroups.remove(folders)
            for fd in fds:
                os.close(fd)
            raise
        w.uid, w.cgroups, w.out, w.err = uid, folders, *fds
        return w

    def _refill(self, attempt: int = 0) -> None:
        """Start a replacement; if that fails (out of memory or processes), retry in the background with a
        backoff, so a failed start never loses a place in the pool."""
        if self._closed:
            return
        try:
            w = self._spawn()
        except Exception as e:
            delay = min(0.1 * 2 ** attempt, 10.0)
            print(f"grpo.envs.sandbox: starting a worker failed ({type(e).__name__}: {e}); retry "
                  f"{attempt + 1} in {delay:g} s", file=sys.stderr, flush=True)
            retry = threading.Timer(delay, self._refill, (attempt + 1,))
            retry.daemon = True
            retry.start()
            return
        self._ready.put(w)
        if self._closed:  # close() ran while it started: it did not see this one
            self.close()

    def _take(self) -> subprocess.Popen:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                w = self._ready.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"no worker became ready within {self.ready_timeout:g} s (workers fail to "
                                   "start: see stderr)") from None
            if w.poll() is None:
                return w
            self._retire(w)  # it died waiting (killed, out of memory): replace it, take the next
            self._refill()

    def _retire(self, w: subprocess.Popen) -> None:
        """Reap the workers that have exited (an answered one exits within ms; it is not waited for)."""
        with self._lock:
            self._exiting.append(w)
            for x in [x for x in self._exiting if x.poll() is not None]:
                x.stdout.close()
                os.close(x.out)  # the memfds before the cgroup's removal: their pages are charged to it
                os.close(x.err)
                self._exiting.remove(x)
                self._busy += x.cgroups  # a killed worker's pid namespace dies a few ms after unshare
                self._uids.append(x.uid)
            if self._busy:
                self._removals.put(self._busy)
                self._busy = []

    def _remove(self) -> None:
        """The remover thread: removes the folders it is given until given None; those still busy go
        back for the next retire."""
        for folders in iter(self._removals.get, None):
            left = cgroups.remove(folders)
            with self._lock:
                self._busy += left
            self._removals.task_done()
        self._removals.task_done()

    def _call(self, code: str, timeout: float) -> tuple[str, str, list[str]]:
        w, raw = self._take(), None
        try:
            w.stdin.write(json.dumps({"code": code, "timeout": timeout}).encode())
            w.stdin.close()
            raw = _read(w.stdout.fileno(), time.monotonic() + timeout + GRACE, 8 * self.max_output + 65536)
            if raw is None and w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)  # unshare --kill-child takes the whole pid namespace with it
            if raw is None:
                return _output(w.out, w.err, self.max_output, [f"[timed out after {timeout:g} s: the worker was "
                                                               "killed]"]), "", []
            return self._answer(w, raw)
        finally:
            if raw is None and w.poll() is None:  # an error on the way: no worker outlives its call
                os.killpg(w.pid, signal.SIGKILL)
            self._retire(w)
            self._refill()  # the replacement starts after the answer, not competing with the call

    def _answer(self, w: subprocess.Popen, raw: bytes) -> tuple[str, str, list[str]]:
        """The worker's result, with an OOM kill of the call's cgroup named as such; where the worker left
        none, what the code printed so far and why (an OOM kill), or what the worker said."""
        oom = cgroups.oom_killed(w.cgroups)
        limit = f"out of memory: the call may use {self._memory >> 20} MiB"
        try:
            r = json.loads(raw)
        except ValueError:
            if oom:
                return _output(w.out, w.err, self.max_output, [f"[crashed: {limit}; its worker was killed]"]), "", []
            return f"[sandbox error: the worker exited without a result: {raw[-300:]!r}]", "", []
        text = r["text"]
        if oom and text.endswith("[crashed: SIGKILL (killed)]"):
            text = text.removesuffix("killed)]") + f"{limit})]"
        elif oom:  # the code went on: one of its other processes was killed
            text += ("\n" if text and not text.endswith("\n") else "") + f"[{limit}: a process of it was killed]"
        return text[: self.max_output + 400], r["report"], r["missing"]

    def close(self) -> None:
        self._closed = True
        for handle in self._claim:
            handle.close()
        with self._lock:
            workers, self._exiting = self._exiting, []
        while not self._ready.empty():
            workers.append(self._ready.get())
        busy = []
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
            w.wait()
            w.stdout.close()
            os.close(w.out)
            os.close(w.err)
            busy += w.cgroups
        if self._remover.is_alive():
            self._removals.put(None)
            self._remover.join()
        with self._lock:
            busy, self._busy = busy + self._busy, []
        cgroups.remove(busy, wait=1.0)
        cgroups.remove(self._cgroups, wait=1.0)  # what is still busy after 1 s: the next pool's sweep

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _claim_uids() -> tuple[list, int]:
    """The first uid of a block of UID_BLOCK no other pool uses (trainers of several ranks each start one),
    held by an abstract unix socket's name (the pools of this network namespace) and, where
    GRPO_SANDBOX_UID_LOCKS names a folder that trainers share (a volume mounted into each container on one
    kernel), by an exclusive lock on a file there: the kernel frees both when the process ends. The search
    starts at a random block, so two trainers that share neither (two containers on one kernel) pick the
    same block with odds of about 1 in 36,000 (a claim by name alone always collided: both took the first).
    -> the handles to keep open, the block's first uid."""
    blocks, folder = (2**31 - 1 - UID_BASE) // UID_BLOCK, os.environ.get("GRPO_SANDBOX_UID_LOCKS")
    start = random.SystemRandom().randrange(blocks)
    for i in range(blocks):
        first = UID_BASE + (start + i) % blocks * UID_BLOCK
        claim = socket.socket(socket.AF_UNIX)
        try:
            claim.bind(f"\0grpo-sandbox-uids-{first}")
        except OSError:
            claim.close()
            continue
        if not folder:
            return [claim], first
        lock = open(os.path.join(folder, f"grpo-sandbox-uids-{first}.lock"), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return [claim, lock], first
        except OSError:  # another trainer's, on this kernel
            lock.close()
            claim.close()
    raise RuntimeError("grpo.envs.sandbox: every block of uids is taken")


def _has_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


_default: Sandbox | None = None  # the one global: run_code's pool, started on first use
_default_lock = threading.Lock()


def run_code(code: str, timeout: float = 10.0) -> str:
    """Run `code` in a fresh interpreter of the default pool; stdout, then stderr, then a status line."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox()
            atexit.register(_default.close)
    return _default.run(code, timeout)


def _read(fd: int, deadline: float, limit: int) -> bytes | None:
    """Read `fd` to EOF or the end of a JSON line, at most `limit` bytes; None at the deadline. The JSON
    line is the worker's answer: not waiting for the EOF saves its namespaces' teardown (~8 ms).
    poll, not select: the trainer's fds may be > 1024."""
    chunks, n, poller = [], 0, select.poll()
    poller.register(fd, select.POLLIN)
    while n < limit:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return None
        chunk = os.read(fd, min(1 << 16, limit - n))
        if not chunk:
            break
        chunks.append(chunk)
        n += len(chunk)
        if chunks[0].startswith(b"{") and chunk.endswith(b"\n"):
            break
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------------------
# The worker: `python -I sandbox.py CFG UID OUT ERR`, started by unshare (after the launcher that joins its
# cgroup), pid 1 of its namespaces. It builds the call's view of the files and the seccomp filter, reads one
# job from stdin, forks the child that runs it as UID with stdout and stderr on the trainer's memfds OUT and
# ERR, waits, and prints one JSON result: the answer, what isolation it made, and which layers it could not make.

# the allow-list view: what a call's root holds of the host besides the interpreter's own folders: the system's
# programs and libraries, and the /etc files CPython and its standard library read (traced with strace: the
# dynamic linker's cache, NSS, the time zone, mimetypes, socket's services and protocols, platform's
# os-release; alternatives, which /usr/bin's links go through). passwd, group and hosts are written per call.
SYSTEM = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
ETC = ["ld.so.cache", "nsswitch.conf", "localtime", "timezone", "mime.types", "services", "protocols",
       "os-release", "alternatives"]
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}  # the syscall's number (glibc has no wrapper)
WRITABLE = {"/tmp", "/dev/shm", "/dev/pts"}  # the call's own mounts it may write; every other is read-only
MNT_DETACH = 2


def _mount(source, target: str, fstype, flags: int, data: str | None = None) -> bool:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731  (a path's bytes, as the kernel has them)
    return _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0


def _bind(fd: int, target: str) -> None:
    """Bind what the O_PATH `fd` names (opened before a mount covered it) at `target`, its mounts included
    (a user namespace refuses a bind that would uncover what a locked mount beneath hides)."""
    if not _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def _under(path: str, folders) -> bool:
    return any(path == f or path.startswith(f + "/") for f in folders)


def _allow_list_view(keep: list[str], hide: list[str], uid: int) -> tuple[str, list[str]] | str:
    """A root of the call's own, switched to with pivot_root: SYSTEM, the ETC files, the interpreter's
    folders (`keep`, each at its real path; a hidden path under one is covered), a private /tmp, /proc and
    a /dev of its own; nothing else of the host (no home, project or data). Every mount nosuid, read-only
    but WRITABLE, nodev but /dev's. -> (report, missing layers), or why it could not be built (nothing of
    it is left then: the deny-list view is made instead)."""
    nr = PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        return f"no pivot_root number for {os.uname().machine}"
    system = [p for p in SYSTEM if os.path.lexists(p)]
    etc = [f"/etc/{n}" for n in ETC if os.path.lexists(f"/etc/{n}")]
    python = [k for k in keep if os.path.isdir(k) and k != "/" and not _under(k, system)]
    # opened before the new root's tmpfs covers /tmp, where a virtual environment may live (a symlink among
    # SYSTEM and ETC is made again as one; an interpreter's folder reached through one is bound where it points)
    fds = {p: os.open(p, os.O_PATH) for p in [*system, *etc] if not os.path.islink(p)}
    fds |= {p: os.open(p, os.O_PATH) for p in [*python, "/proc"]}
    root = "/tmp"
    try:
        if not _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755"):
            return f"a tmpfs for its root ({os.strerror(ctypes.get_errno())})"
        try:
            bound, missing = _fill_root(root, system, etc, python, fds, uid)
            for h in hide:  # a cache or token the environment names, inside the interpreter's folders
                if _under(h, python) and os.path.lexists(root + h) and not _hide(root + h, []):
                    missing.append(f"hiding {h} ({os.strerror(ctypes.get_errno())})")
            os.chdir(root)  # pivot_root(".", "."): the old root stacks on the new, then goes with all its mounts
            if _libc.syscall(ctypes.c_long(nr), b".", b".") != 0 or _libc.umount2(b".", MNT_DETACH) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), "pivot_root")
            os.chdir("/")
        except OSError as e:
            os.chdir("/")
            _libc.umount2(root.encode(), MNT_DETACH)
            return f"{e.strerror}: {e.filename}"
    finally:
        for fd in fds.values():
            os.close(fd)
    ok, total, lost = _seal()
    shown = " ".join([*system, *python])
    return (f"files: an allow-list view ({shown}, {len(etc)} files of /etc, /proc, a private /tmp 64 MiB, a "
            f"/dev of its own: {' '.join(bound)}, private devpts); {ok}/{total} mounts read-only but /tmp, "
            "nosuid, nodev"), missing + lost


def _fill_root(root: str, system: list[str], etc: list[str], python: list[str], fds: dict, uid: int):
    """The new root's contents (see _allow_list_view); raises OSError on what fails. -> bound /dev nodes,
    missing layers."""
    os.mkdir(f"{root}/etc")
    for p in [*system, *etc]:  # a symlink (/lib -> usr/lib) as it is; a folder or file bound in
        if os.path.islink(p):
            os.symlink(os.readlink(p), root + p)
        elif os.path.isdir(p):
            os.mkdir(root + p)
            _bind(fds[p], root + p)
        else:
            open(root + p, "w").close()
            _bind(fds[p], root + p)
    users = "root:x:0:0:root:/tmp:/bin/sh\n" + (f"sandbox:x:{uid}:{uid}:sandbox:/tmp:/bin/sh\n" if uid else "")
    for name, text in {"passwd": users, "group": "root:x:0:\n" + (f"sandbox:x:{uid}:\n" if uid else ""),
                       "hosts": "127.0.0.1 localhost\n::1 localhost\n"}.items():
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    os.mkdir(f"{root}/tmp")
    if not _mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777"):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), "/tmp")
    for k in sorted(python):  # a virtual environment under /tmp lands in the private /tmp, read-only
        os.makedirs(root + k, exist_ok=True)
        _bind(fds[k], root + k)
    os.mkdir(f"{root}/proc")
    _bind(fds["/proc"], f"{root}/proc")
    os.mkdir(f"{root}/dev")
    bound, missing = _private_dev(f"{root}/dev")
    if not _mount("tmpfs", f"{root}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777"):
        missing.append(f"a /dev/shm of its own ({os.strerror(ctypes.get_errno())})")
    if not _mount("devpts", f"{root}/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                  "newinstance,ptmxmode=0666,mode=0620,max=64"):
        missing.append(f"a devpts instance of its own ({os.strerror(ctypes.get_errno())})")
    return bound, missing


def _deny_list_view(hide: list[str], keep: list[str]) -> tuple[str, list[str]]:
    """The fallback where the allow-list view cannot be built: the host's files, with `hide` covered
    (folders by an empty tmpfs, the `keep` folders under them bound back in; files by /dev/null), a
    private /tmp, /dev of its own, then every mount sealed as in the allow-list view."""
    # a bind of /proc over itself: the worker's open oom_score_adj counts as a writer of the mount beneath,
    # whose read-only remount it would refuse (EBUSY)
    _mount("/proc", "/proc", None, MS_BIND | MS_REC)
    # the interpreter may live under /tmp (a virtual environment made there): its folders come back
    assert _cover("/tmp", "size=64m,mode=1777", keep), "no private /tmp"
    bound, missing = _private_dev("/dev")
    # a devpts of its own: the host's lists (and lets the same uid open) the ptys of the trainer and of
    # concurrent calls; /dev/ptmx opens in the devpts mounted beside it (Linux >= 4.7). Without a
    # /dev/pts there are no ptys to reach.
    if os.path.isdir("/dev/pts") and not _mount(
            "devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,max=64"):
        missing.append(f"a devpts instance of its own ({os.strerror(ctypes.get_errno())})")
    hidden = []
    for path in hide:  # real paths (hidden_paths): a symlinked home is hidden where it points
        if not os.path.lexists(path) or path in keep:
            continue
        if _hide(path, keep):
            hidden.append(path)
        else:
            missing.append(f"hiding {path} ({os.strerror(ctypes.get_errno())})")
    ok, total, lost = _seal()
    return (f"files: the deny-list view (the host's, covered: {' '.join(hidden)}; private /tmp 64 MiB"
            f"{'' if missing else ', private devpts'}, a /dev of its own: {' '.join(bound)}); {ok}/{total} "
            "mounts read-only but /tmp, nosuid, nodev"), missing + lost


def _seal() -> tuple[int, int, list[str]]:
    """Remount every mount but WRITABLE read-only, nosuid and, but under /dev, nodev: a read-only mount
    does not stop a device node's writes, nodev stops its open (one made on a host folder by another
    process). A mount out of reach (under another user's 0700 folder, or covered) is out of the code's
    reach too. -> mounts sealed (WRITABLE and unreachable ones counted), mounts in all, those that failed."""
    ok = total = 0
    missing = []
    for line in open("/proc/self/mountinfo", errors="surrogateescape"):  # paths are bytes, not always UTF-8
        point, options = line.split()[4:6]
        point = unescape(point)
        total += 1
        try:
            os.close(os.open(point, os.O_PATH))
        except OSError:
            ok += 1
            continue
        locked = sum(f for o, f in LOCKED.items() if o in options.split(","))  # a user namespace must repeat them
        dev = point == "/dev" or point.startswith("/dev/")
        flags = locked | MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | (0 if dev else MS_NODEV)
        if point in WRITABLE or _mount(None, point, None, flags):
            ok += 1
        else:  # a mount left writable: a file written there outlives the call
            missing.append(f"read-only {point!r} ({os.strerror(ctypes.get_errno())})")
    return ok, total, missing


# the host's device nodes a call keeps, in a /dev of its own; no GPU, RDMA, disk, KVM or console node
DEV_NODES = ["null", "zero", "full", "random", "urandom", "tty"]
DEV_LINKS = {"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}


def _private_dev(dev: str) -> tuple[list[str], list[str]]:
    """A tmpfs over `dev` holding DEV_NODES, DEV_LINKS and empty pts and shm folders (the callers mount a
    devpts and a tmpfs there): a device node of the host (a GPU's /dev/nvidia* is mode 0666 by default; a
    read-only mount does not stop writes to a device) is not there to open. Each node is made anew where
    mknod is allowed (root: an inode of the call's own, so a record lock on it is not seen by another
    call), else the host's is bound in (a user namespace may not mknod). -> the nodes, what failed."""
    nodes = {}
    for name in DEV_NODES:
        try:
            nodes[name] = os.stat(f"/dev/{name}").st_rdev, os.open(f"/dev/{name}", os.O_PATH)
        except OSError:  # not on this machine
            pass
    made = _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    missing = [] if made else [f"a /dev of its own ({os.strerror(ctypes.get_errno())})"]
    bound = []
    for name, (rdev, fd) in nodes.items():
        path = f"{dev}/{name}"
        try:
            if made:
                try:
                    os.mknod(path, stat.S_IFCHR | 0o666, rdev)
                    os.chmod(path, 0o666)  # past the umask
                except PermissionError:
                    open(path, "w").close()
                    _bind(fd, path)
                bound.append(name)
        except OSError as e:
            missing.append(f"/dev/{name} ({e.strerror})")
        os.close(fd)
    if made:
        for name, target in DEV_LINKS.items():
            os.symlink(target, f"{dev}/{name}")
        os.mkdir(f"{dev}/pts")
        os.mkdir(f"{dev}/shm")
    return bound, missing


def _ipc_limits() -> str:
    """IPC_LIMITS written into this IPC namespace's sysctls (its own: the host's are untouched); '' or what failed."""
    failed = []
    for name, value in IPC_LIMITS.items():
        try:
            with open(f"/proc/sys/kernel/{name}", "w") as f:
                f.write(str(value))
        except OSError as e:
            failed.append(f"{name} ({e.strerror})")
    return f"the IPC namespace's limits: {', '.join(failed)}" if failed else ""


def unescape(field: str) -> str:
    """A mountinfo path as the kernel wrote it, octal escapes undone: space, tab, newline, backslash."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def hidden_paths() -> list[str]:
    """What the deny-list view covers besides /dev/shm, /run and /sys/fs/cgroup (and the allow-list view
    wherever it falls inside the interpreter's folders): the trainer's home, the caches the environment
    names (downloaded weights, compiled kernels) and the credentials it names (CREDENTIALS: files or
    folders, KUBECONFIG a list), each at its real path (a symlinked home is covered where it points).
    /tmp is the call's own already."""
    caches = ["HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME",
              "XDG_CONFIG_HOME", "XDG_DATA_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_HOME"]
    paths = {os.path.expanduser("~"), pwd.getpwuid(os.getuid()).pw_dir, *(os.environ.get(n, "") for n in caches)}
    paths |= {p for n in CREDENTIALS for p in os.environ.get(n, "").split(os.pathsep)}
    real = {os.path.realpath(p) for p in paths if p and os.path.isabs(p)}
    return sorted(p for p in real if p != "/" and p != "/tmp" and not p.startswith("/tmp/"))


def signal_name(number: int) -> str:
    """SIGSEGV, SIGRTMIN+6, ...: any number a child may die of (signal.Signals knows the classic ones only)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        low, high = int(signal.SIGRTMIN), int(signal.SIGRTMAX)
        return f"SIGRTMIN+{number - low}" if low <= number <= high else f"signal {number}"


def _hide(path: str, keep: list[str]) -> bool:
    """A folder under an empty tmpfs (_cover), a file (a token, a socket) under /dev/null, which the seal
    makes nodev: it does not even open. True when covered."""
    if os.path.isdir(path):
        return _cover(path, f"size=16m,mode={'1777' if path == '/dev/shm' else '755'}", keep)
    return _mount("/dev/null", path, None, MS_BIND)


def _cover(path: str, options: str, keep: list[str]) -> bool:
    """An empty tmpfs over `path`, with the `keep` folders under it bound back in (the interpreter's
    own, read-only once sealed): True when the tmpfs is mounted."""
    inside = [k for k in keep if k.startswith(path + "/") and os.path.isdir(k)]
    handles = [os.open(k, os.O_PATH) for k in inside]  # still reachable once the tmpfs covers them
    covered = _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
    for k, fd in zip(inside, handles):
        if covered:
            os.makedirs(k, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
        os.close(fd)
    return covered


# The seccomp filter is an allow-list (x86_64 numbers): the syscalls CPython, its standard library (threads,
# subprocess, multiprocessing, asyncio, sqlite3, mmap), numpy and sympy make, found by tracing them (strace -f)
# and rounded out by their families. A syscall not named here answers ENOSYS, as a kernel without it would
# (libc then falls back: clone3 -> clone, statx -> fstatat, preadv2 without flags -> preadv). socket and
# socketpair (AF_UNIX only), clone (no namespace flag), fcntl (no lease, dnotify or lock probe), mmap, shmget
# and memfd_create (no huge pages) and prlimit64 (its own process only) are checked by argument. Setting
# fcntl's record locks stays (sqlite3 needs them; see the header for what they still carry).
ALLOWED = dict((name, int(nr)) for name, nr in (pair.split("=") for pair in """
read=0 write=1 readv=19 writev=20 pread64=17 pwrite64=18 preadv=295 pwritev=296 open=2 openat=257 openat2=437
close=3 close_range=436 stat=4 fstat=5 lstat=6 newfstatat=262 statx=332 lseek=8 access=21 faccessat=269
faccessat2=439 readlink=89 readlinkat=267 getdents=78 getdents64=217 getcwd=79 chdir=80 fchdir=81 mkdir=83
mkdirat=258 rmdir=84 unlink=87 unlinkat=263 rename=82 renameat=264 renameat2=316 link=86 linkat=265 symlink=88
symlinkat=266 chmod=90 fchmod=91 fchmodat=268 chown=92 fchown=93 lchown=94 fchownat=260 truncate=76 ftruncate=77
fsync=74 fdatasync=75 utime=132 utimes=235 utimensat=280 futimesat=261 umask=95 dup=32 dup2=33 dup3=292 pipe=22
pipe2=293 ioctl=16 statfs=137 fstatfs=138 sendfile=40 copy_file_range=326 splice=275 tee=276 memfd_create=319
fallocate=285 mknod=133 mknodat=259 getxattr=191 lgetxattr=192 fgetxattr=193 listxattr=194 llistxattr=195
flistxattr=196 setxattr=188 lsetxattr=189 fsetxattr=190 removexattr=197 lremovexattr=198 fremovexattr=199 mmap=9
munmap=11 mprotect=10 mremap=25 madvise=28 brk=12 msync=26 mlock=149 munlock=150 mlock2=325 mlockall=151
munlockall=152 mbind=237 get_mempolicy=239 set_mempolicy=238 membarrier=324 fork=57 vfork=58 execve=59
execveat=322 exit=60 exit_group=231 wait4=61 waitid=247 kill=62 tkill=200 tgkill=234 pidfd_open=434
pidfd_send_signal=424 getpid=39 getppid=110 gettid=186 getuid=102 geteuid=107 getgid=104 getegid=108
getgroups=115 getresuid=118 getresgid=120 getpgrp=111 getpgid=121 getsid=124 setuid=105 setgid=106 setreuid=113
setregid=114 setresuid=117 setresgid=119 setgroups=116 setfsuid=122 setfsgid=123 setpgid=109 setsid=112
capset=126 capget=125 prctl=157 arch_prctl=158 set_tid_address=218 set_robust_list=273 get_robust_list=274
rseq=334 futex=202 futex_waitv=449 sched_yield=24 sched_getaffinity=204 sched_setaffinity=203 sched_getparam=143
sched_setparam=142 sched_getscheduler=145 sched_setscheduler=144 sched_get_priority_max=146
sched_get_priority_min=147 sched_rr_get_interval=148 sched_getattr=315 sched_setattr=314 getpriority=140
setpriority=141 prlimit64=302 getrlimit=97 setrlimit=160 getrusage=98 times=100 sysinfo=99 uname=63 getcpu=309
restart_syscall=219 uretprobe=335 rt_sigaction=13 rt_sigprocmask=14 rt_sigreturn=15 rt_sigpending=127
rt_sigtimedwait=128 rt_sigsuspend=130 rt_sigqueueinfo=129 rt_tgsigqueueinfo=297 sigaltstack=131 pause=34
alarm=37 setitimer=38 getitimer=36 timer_create=222 timer_settime=223 timer_gettime=224 timer_getoverrun=225
timer_delete=226 timerfd_create=283 timerfd_settime=286 timerfd_gettime=287 signalfd=282 signalfd4=289
eventfd=284 eventfd2=290 clock_gettime=228 clock_getres=229 clock_nanosleep=230 nanosleep=35 gettimeofday=96
time=201 poll=7 ppoll=271 select=23 pselect6=270 epoll_create=213 epoll_create1=291 epoll_ctl=233 epoll_wait=232
epoll_pwait=281 epoll_pwait2=441 connect=42 bind=49 listen=50 accept=43 accept4=288 getsockname=51
getpeername=52 sendto=44 recvfrom=45 sendmsg=46 recvmsg=47 sendmmsg=307 recvmmsg=299 shutdown=48 setsockopt=54
getsockopt=55 shmget=29 shmat=30 shmdt=67 shmctl=31 semget=64 semop=65 semctl=66 semtimedop=220 msgget=68
msgsnd=69 msgrcv=70 msgctl=71 mq_open=240 mq_unlink=241 mq_timedsend=242 mq_timedreceive=243 mq_notify=244
mq_getsetattr=245 getrandom=318""".split()))
# Outside the allow-list anyway, these answer EPERM rather than ENOSYS (a refusal, not a missing kernel
# feature, so no libc falls back to something else): keys (the kernel's keyrings are per uid and outlive the
# call), new namespaces (a user namespace gives back every capability in it), mounts and the new mount API,
# tracing and other processes' memory, modules and kexec, bpf, perf, userfaultfd, io_uring (which also makes
# sockets without socket()), modify_ldt, uselib; and the state the kernel shares machine-wide: flock on any
# readable file (the trainer's locks wait on it), Linux AIO contexts (fs.aio-max-nr is one pool for the
# machine), the page cache (fadvise evicts a readable file; mincore and cachestat tell whether another call read
# one; preadv2's RWF_NOWAIT, the third way, is outside the allow-list) and inotify/fanotify on readable folders
# (the names of files the trainer writes).
DENIED = {"ptrace": 101, "uselib": 134, "modify_ldt": 154, "pivot_root": 155, "mount": 165, "umount2": 166,
          "init_module": 175, "delete_module": 176, "kexec_load": 246, "add_key": 248, "request_key": 249,
          "keyctl": 250, "unshare": 272, "perf_event_open": 298, "open_by_handle_at": 304, "setns": 308,
          "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
          "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
          "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "open_tree_attr": 467,
          "name_to_handle_at": 303, "kcmp": 312, "process_vm_readv": 310, "process_vm_writev": 311,
          "pidfd_getfd": 438, "process_madvise": 440, "memfd_secret": 447,
          "flock": 73, "io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209, "io_cancel": 210,
          "io_pgetevents": 333, "fadvise64": 221, "readahead": 187, "mincore": 27, "cachestat": 451,
          "inotify_init": 253, "inotify_add_watch": 254, "inotify_rm_watch": 255,
          "inotify_init1": 294, "fanotify_init": 300, "fanotify_mark": 301}
SOCKET, SOCKETPAIR, CLONE, FCNTL, MMAP, SHMGET, MEMFD_CREATE, PRLIMIT64 = 41, 53, 56, 72, 9, 29, 319, 302
AF_UNIX = 1
CLONE_NEW = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
# fcntl commands refused: a lease stalls others' opens, dnotify watches folders, and F_GETLK / F_OFD_GETLK would
# read another call's record locks on a shared file (a channel between calls; sqlite3 only probes a hot journal)
F_GETLK, F_OFD_GETLK, F_SETLEASE, F_NOTIFY = 5, 36, 1024, 1026
# huge pages come from the machine's reserved pool, outside the call's memory cgroup
MFD_HUGETLB, MAP_HUGETLB, SHM_HUGETLB = 0x4, 0x40000, 0x800


LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x50000 | 1, 0x50000 | 38  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno
# offsets in struct seccomp_data; an ARG reads its low 32 bits (little-endian)
NR, ARCH, ARG0, ARG1, ARG2, ARG3 = 0, 4, 16, 24, 32, 40


def _bpf(lines: list) -> bytes:
    """Classic BPF as struct sock_filter {u16 code; u8 jt, jf; u32 k}[] from (code, jt, jf, k) tuples
    and labels: a string names the next instruction, a jump to it becomes the count of those skipped."""
    at, program = {}, []
    for line in lines:
        if isinstance(line, str):
            at[line] = len(program)
        else:
            program.append(line)
    skip = lambda to, i: to if isinstance(to, int) else at[to] - i - 1  # noqa: E731
    jumps = [(skip(jt, i), skip(jf, i)) for i, (_, jt, jf, _) in enumerate(program)]
    assert all(0 <= j <= 255 for pair in jumps for j in pair), "a BPF jump is one byte: 255 instructions at most"
    return b"".join(struct.pack("=HBBI", op, jt, jf, k) for (op, _, _, k), (jt, jf) in zip(program, jumps))


def _seccomp_filter() -> bytes:
    """Other arches and the x32 ABI (other numbers) get EPERM, so do DENIED and the calls refused by
    argument (_only, _refuse); ALLOWED passes; everything else, clone3 included, gets ENOSYS (clone3's flags
    are in memory a filter cannot read; libc then falls back to clone). Each number is a test and its own
    return, so no jump is longer than a byte holds."""
    verdict = lambda numbers, action: [x for n in sorted(numbers) for x in ((JEQ, 0, 1, n), (RET, 0, 0, action))]
    return _bpf([(LD, 0, 0, ARCH), (JEQ, 1, 0, 0xC000003E), (RET, 0, 0, EPERM),
                 (LD, 0, 0, NR), (JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM),
                 *_only(SOCKET, ARG0, AF_UNIX), *_only(SOCKETPAIR, ARG0, AF_UNIX),
                 *_only(PRLIMIT64, ARG0, 0),  # its own limits only (pid 0): not the worker's, in a user namespace
                 *_refuse(CLONE, ARG0, [(JSET, CLONE_NEW)]),
                 *_refuse(FCNTL, ARG1, [(JEQ, c) for c in (F_GETLK, F_OFD_GETLK, F_SETLEASE, F_NOTIFY)]),
                 *_refuse(MMAP, ARG3, [(JSET, MAP_HUGETLB)]), *_refuse(SHMGET, ARG2, [(JSET, SHM_HUGETLB)]),
                 *_refuse(MEMFD_CREATE, ARG1, [(JSET, MFD_HUGETLB)]),
                 *verdict(DENIED.values(), EPERM), *verdict(ALLOWED.values(), ALLOW), (RET, 0, 0, ENOSYS)])


def _only(nr: int, arg: int, value: int) -> list:
    """Syscall `nr` passes where argument `arg` (its low 32 bits) is `value`, else EPERM; others go on."""
    return [(JEQ, 0, f"not {nr}", nr), (LD, 0, 0, arg), (JEQ, 0, 1, value), (RET, 0, 0, ALLOW),
            (RET, 0, 0, EPERM), f"not {nr}"]


def _refuse(nr: int, arg: int, tests: list[tuple[int, int]]) -> list:
    """Syscall `nr` gets EPERM where argument `arg` meets any of `tests` ((JEQ, value) or (JSET, bits)),
    else passes; others go on (the accumulator still holds their number)."""
    return [(JEQ, 0, f"not {nr}", nr), (LD, 0, 0, arg), *[(op, f"refuse {nr}", 0, k) for op, k in tests],
            (RET, 0, 0, ALLOW), f"refuse {nr}", (RET, 0, 0, EPERM), f"not {nr}"]


def _install(program: bytes) -> str:
    """Install a seccomp filter on this process (and so on everything it forks); '' or why not."""
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("=HxxxxxxQ", len(program) // 8, ctypes.addressof(buf))  # struct sock_fprog
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, which an unprivileged filter needs
    if _libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        return f"seccomp filter ({os.strerror(ctypes.get_errno())})"
    return ""


def _seccomp() -> str:
    if os.uname().machine != "x86_64":
        return f"seccomp filter (its syscall numbers are x86_64's, this is {os.uname().machine})"
    return _install(_seccomp_filter())


def _worker(cfg: dict, uid: int, out: int, err: int) -> None:
    _libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the code may not ptrace this init
    # the code shares this init's uid in a user namespace: a SIGINT from it must not raise KeyboardInterrupt here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    oom, low, missing = _oom_score_adj()
    isolated = os.getpid() == 1
    drop = os.geteuid() == 0 and any(int(a) <= uid < int(a) + int(n) for a, _, n in
                                     (line.split() for line in open("/proc/self/uid_map")))
    ipc = _ipc_limits() if isolated else ""  # before /proc is remounted read-only
    report = "no namespaces"
    if isolated:
        view = _allow_list_view(cfg["keep"], cfg["hide"], uid if drop else 0) if cfg["view"] else "turned off"
        if isinstance(view, str):  # the deny-list where the allow-list view cannot be built, and why
            report, lost = _deny_list_view(cfg["hide"], cfg["keep"])
            report += f" (no allow-list view: {view})"
        else:
            report, lost = view
        report = f"network, mount, pid, ipc, uts and cgroup namespaces; {report}"
        missing += lost
    if isolated and not ipc:
        report += f"; SysV IPC {IPC_LIMITS['shmall'] * 4 >> 10} MiB of shared memory, freed when detached"
    elif ipc and cfg["userns"]:  # kernels before ~6.12 let only the host's root set them: said, not refused
        report += f"; the kernel's IPC limits (this kernel refused a user namespace {ipc})"
    elif ipc:
        missing.append(ipc)
    if isolated:  # its own UTS namespace: the machine's name is not the code's business either
        _libc.sethostname(b"sandbox", 7)
    work = "/tmp" if isolated else tempfile.mkdtemp(prefix="grpo-sandbox-")
    # the trainer's session keyring is inherited, and setuid keeps it: join a new, empty one
    joined = _libc.syscall(ctypes.c_long(250), ctypes.c_long(1), None) >= 0  # KEYCTL_JOIN_SESSION_KEYRING
    keyring = "" if joined else f"a session keyring of its own ({os.strerror(ctypes.get_errno())})"
    if drop and not isolated:
        os.chown(work, uid, uid)
    if drop:
        report += f"; code runs as uid {uid}, this call's own"
    elif cfg["userns"]:  # its own user namespace: RLIMIT_NPROC counts its uid 0 there, per call
        report += "; code runs without capabilities, in a user namespace of its own"
    else:
        report += f"; code runs as uid {os.getuid()}" + ("" if os.geteuid() else " without capabilities")
        missing.append(f"a uid of its own per call (calls share uid {os.getuid()} and its process count)")
    no_filter = _seccomp()  # last: the setup above needs mount and keyctl
    if no_filter:  # keyctl stays open to the code: then its own session keyring is a layer of its own
        missing += [no_filter, keyring] if keyring else [no_filter]
    else:
        report += (f"; seccomp: an allow-list of {len(ALLOWED)} syscalls, sockets AF_UNIX only, EPERM for "
                   f"{len(DENIED)} (keys, namespaces, mounts, ptrace, flock, aio, inotify, page cache...) and "
                   "by argument (lock probes, huge pages, another process's rlimits)")
    report += ("" if keyring else "; its own session keyring") + ("" if oom is None else
                                                                  f"; oom_score_adj 1000 for the code, {low} here")
    data = sys.stdin.buffer.read()
    if not data:  # the pool closed before using this worker
        return
    job = json.loads(data)
    sys.stdout.flush()  # nothing buffered may be copied into the child
    _set(oom, b"1000")  # inherited by the child: the OOM killer takes the code, not this init and the output
    pid = os.fork()
    if pid == 0:
        _child(job["code"], {**cfg["limits"], "RLIMIT_CPU": int(job["timeout"]) + 1}, out, err, work,
               uid if drop else None)
    _set(oom, str(low).encode())  # back down: raising needs no privilege, lowering to the inherited value neither
    done = select.poll()
    done.register(os.pidfd_open(pid), select.POLLIN)
    timed_out = not done.poll(job["timeout"] * 1000)
    if isolated:
        os.kill(-1, signal.SIGKILL)  # everything in this pid namespace but us: what the code left running
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    status = os.waitpid(pid, 0)[1]
    notes = [f"[timed out after {job['timeout']:g} s]"] if timed_out else []
    if not timed_out and os.WIFSIGNALED(status):
        name = signal_name(os.WTERMSIG(status))
        why = {"SIGSEGV": "segmentation fault", "SIGXCPU": "CPU time limit", "SIGXFSZ": "file size limit",
               "SIGKILL": "killed", "SIGABRT": "aborted", "SIGBUS": "bus error"}.get(name, "signal")
        notes.append(f"[crashed: {name} ({why})]")
    text = _output(out, err, cfg["max_output"], notes)
    if not isolated:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"text": text, "report": report, "missing": missing}), flush=True)


def _oom_score_adj() -> tuple[int | None, int, list[str]]:
    """This worker's oom_score_adj, open for writing while /proc still may be written: the fd (None where
    it cannot), its value (inherited from the trainer, kept while idle), the missing layer if any."""
    try:
        fd = os.open("/proc/self/oom_score_adj", os.O_RDWR)
        return fd, int(os.read(fd, 16)), []
    except OSError as e:
        return None, 0, [f"oom_score_adj 1000 for the code ({e.strerror})"]


def _set(fd: int | None, value: bytes) -> None:
    if fd is not None:
        try:
            os.pwrite(fd, value, 0)
        except OSError:  # lowering past what the kernel allows: this init stays at 1000, as it used to
            pass


def _output(out: int, err: int, max_output: int, notes: list[str]) -> str:
    """stdout's start and stderr's end (a traceback's last line says what went wrong), then the notes."""
    sizes = [os.fstat(fd).st_size for fd in (out, err)]
    n_err = min(sizes[1], max_output // 2)
    n_out = min(sizes[0], max_output - n_err)
    text = (os.pread(out, n_out, 0) + os.pread(err, n_err, sizes[1] - n_err)).decode("utf-8", "replace")
    if n_out < sizes[0] or n_err < sizes[1]:  # each stream stops at the file size limit, 16 MiB
        notes.insert(0, f"[output truncated to {max_output} bytes: stdout was {sizes[0]} bytes, "
                        f"stderr {sizes[1]}]")
    if notes and text and not text.endswith("\n"):
        text += "\n"
    return text + " ".join(notes)


def _child(code: str, limits: dict, out: int, err: int, work: str, uid: int | None) -> None:
    os.setsid()  # its own process group, killed as one
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any interpreter (the worker ignores it)
    for fd, target in ((os.open(os.devnull, os.O_RDONLY), 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    os.closerange(3, 1 << 16)  # the worker's pipes to the trainer and everything else
    os.chdir(work)
    os.environ["HOME"] = work
    for name, value in limits.items():  # CPU: the soft limit's SIGXCPU names the cause, SIGKILL would not
        which = getattr(resource, name)
        hard = resource.getrlimit(which)[1]
        hard = value + (name == "RLIMIT_CPU") if hard == resource.RLIM_INFINITY else min(
            value + (name == "RLIMIT_CPU"), hard)  # never raised: a user namespace's root may not
        resource.setrlimit(which, (min(value, hard), hard))
    if uid is not None:  # root ignores RLIMIT_NPROC; a uid of its own does not, and shares it with no call
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:  # root of a user namespace: no capability left, none regained by exec (could undo the mounts)
        for cap in range(64):
            _libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
        if _libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()) != 0:
            os.write(2, f"[sandbox: capabilities not dropped ({os.strerror(ctypes.get_errno())})]\n".encode())
            os._exit(1)  # never run the code with them
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binaries or file capabilities
    _libc.prctl(4, 1, 0, 0, 0)  # dumpable again, so /proc/self belongs to the code's own user
    sys.stdout.reconfigure(line_buffering=True)  # what was printed survives a timeout or a crash
    main = types.ModuleType("__main__")  # a fresh __main__, as `python -c` would have
    sys.modules["__main__"], sys.argv = main, ["-c"]
    status = 0
    try:
        exec(compile(code, "<code>", "exec"), main.__dict__)
    except SystemExit as e:  # as the interpreter reads it: None is 0, a number is the status, else printed
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this frame
        status = 1
    # what the interpreter's exit does that the code can see, without tearing down every module (10 ms)
    threading._shutdown()  # joins the code's non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]), *map(int, sys.argv[2:5]))
