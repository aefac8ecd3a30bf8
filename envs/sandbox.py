"""Run model-written Python in isolated, pre-started worker processes: `run_code(code, timeout) -> str`.

Each call gets a worker started earlier with `subprocess` (a fresh `python -I` interpreter, not a fork
of the trainer: no CUDA context, no model memory, no open files), which runs the code once and exits;
a replacement starts in the background, so a call costs milliseconds, not an interpreter start. The
answer is stdout then stderr (a traceback as python prints it), cut to `max_output` bytes (the
start of stdout, the end of stderr), then one bracketed line for a timeout, a crash or a truncation.
run_code never raises for anything the code does; it raises only when the sandbox cannot start.

What is covered (on Linux, where `unshare` may make namespaces; the start line says what was made):
- No network: a new network namespace holds only a loopback that is down, so no TCP/UDP, no DNS, no
  abstract unix sockets. Root uses it directly; other users through a user namespace.
- Files: a mount namespace remounts every mount read-only; /tmp is a private tmpfs (64 MiB), the
  working folder, gone when the call ends; /dev/shm, /run and the trainer's home are covered by empty
  tmpfs (tokens, caches, agent sockets), with the Python install re-bound if it lives there.
- Processes: a pid namespace (the trainer is invisible) whose init kills every process left when the
  code returns or times out; the trainer kills the worker's process group as a backstop.
- Privileges: run as root, the code drops to nobody (65534), since root ignores RLIMIT_NPROC; inside a
  user namespace it loses every capability instead; no_new_privs (no setuid binaries) either way.
- rlimits: CPU seconds (timeout + 1), address space (memory_mb), file size 16 MiB (output included),
  64 open files, 64 processes, no core files; an environment with nothing of the trainer's.

What is not covered:
- Reads: the code can read whatever its user may (world-readable files, the repository). It cannot
  send them anywhere, but it can print them into its observation. A unix socket file outside the
  covered folders stays connectable (read-only mounts do not stop that) if its user may write it.
- Memory is limited per process (address space), not in total: there is no cgroup, so tmpfs, memfd
  and many processes together can use more. The 64 processes of nobody are shared by all calls.
- The kernel: namespaces are not a VM (no seccomp filter); a kernel bug is an escape.
- Without namespaces (only with allow_network=True or GRPO_SANDBOX_ALLOW_NETWORK=1): network, files
  and processes that leave the process group are open; only rlimits, the uid and the folder remain.

About 340 lines, past the ~200 budget: the second half (the worker, after the separator) is the
isolation itself, and reads better beside the pool that starts it than in a file of its own.
"""
import atexit
import ctypes
import json
import os
import pwd
import queue
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types

NOBODY = 65534
NS = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
# the workers' whole environment, never the trainer's; one BLAS thread, since threads count as processes
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp",
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LIMITS = {"RLIMIT_FSIZE": 16 << 20, "RLIMIT_NOFILE": 64, "RLIMIT_NPROC": 64, "RLIMIT_CORE": 0}
GRACE = 5.0  # s past the timeout before the trainer kills a worker whose init did not answer
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
# per-mount flags a user namespace may not drop, so a read-only remount must repeat them
LOCKED = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
          "relatime": 1 << 21, "strictatime": 1 << 24}
_libc = ctypes.CDLL(None, use_errno=True)


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
                 memory_mb: int = 2048):
        self.prefix, reason = namespaces()
        allow_network = allow_network or os.environ.get("GRPO_SANDBOX_ALLOW_NETWORK") == "1"
        if self.prefix is None and not allow_network:
            raise RuntimeError(f"grpo.envs.sandbox: cannot isolate the network here ({reason}); pass allow_"
                               "network=True or set GRPO_SANDBOX_ALLOW_NETWORK=1 to run code without it")
        home = {os.path.expanduser("~"), pwd.getpwuid(os.getuid()).pw_dir} - {"/", "/tmp"}
        python = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable), *sys.path]
        python = {f(p) for p in python if os.path.isabs(p) for f in (os.path.abspath, os.path.realpath)}
        cfg = {"max_output": max_output, "limits": {**LIMITS, "RLIMIT_AS": memory_mb << 20},
               "hide": ["/dev/shm", "/run", *sorted(home)],  # covered by empty tmpfs in the worker
               "keep": sorted(p for p in python if not any(p.startswith(q + "/") for q in python))}
        self.max_output, self._closed, self._lock, self._exiting = max_output, False, threading.Lock(), []
        self._argv = [*(self.prefix or []), sys.executable, "-I", os.path.abspath(__file__), json.dumps(cfg)]
        self._ready = queue.SimpleQueue()
        for _ in range(workers):
            self._ready.put(self._spawn())
        text, report = self._call("print('ok')", 10.0)  # the first call: proves the workers work
        if text != "ok\n":
            self.close()
            raise RuntimeError(f"grpo.envs.sandbox: a worker failed at start: {text!r}")
        self.isolation = (f"{report}; rlimits: cpu timeout+1 s, address space {memory_mb} MiB, file size "
                          f"{LIMITS['RLIMIT_FSIZE'] >> 20} MiB, {LIMITS['RLIMIT_NOFILE']} files, "
                          f"{LIMITS['RLIMIT_NPROC']} processes; {workers} workers")
        if self.prefix is None:
            self.isolation += f" (namespaces refused: {reason})"
        print(f"grpo.envs.sandbox: {self.isolation}")

    def run(self, code: str, timeout: float = 10.0) -> str:
        """stdout, then stderr, then a bracketed status line if any; never raises."""
        try:
            return self._call(code, timeout)[0]
        except Exception as e:  # a lost worker is an observation for the model; the next call gets another
            return f"[sandbox error: {type(e).__name__}: {e}]"

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=ENV, cwd="/", start_new_session=True)

    def _take(self) -> subprocess.Popen:
        w = self._ready.get()
        while w.poll() is not None:  # it died waiting (killed, out of memory): replace it, take the next
            self._ready.put(self._spawn())
            w = self._ready.get()
        return w

    def _call(self, code: str, timeout: float) -> tuple[str, str]:
        w, raw = self._take(), None
        try:
            w.stdin.write(json.dumps({"code": code, "timeout": timeout}).encode())
            w.stdin.close()
            raw = _read(w.stdout.fileno(), time.monotonic() + timeout + GRACE, 8 * self.max_output + 65536)
        finally:
            if raw is None and w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)  # unshare --kill-child takes the whole pid namespace with it
            with self._lock:  # reaped by later calls, not waited for: an answered worker exits within ms
                self._exiting.append(w)
                for x in [x for x in self._exiting if x.poll() is not None]:
                    x.stdout.close()
                    self._exiting.remove(x)
            if not self._closed:  # the replacement starts after the answer, not competing with the call
                self._ready.put(self._spawn())
        if raw is None:
            return f"[timed out after {timeout:g} s: the worker was killed]", ""
        try:
            r = json.loads(raw)
        except ValueError:
            return f"[sandbox error: the worker exited without a result: {raw[-300:]!r}]", ""
        return r["text"][: self.max_output + 400], r["report"]

    def close(self) -> None:
        self._closed = True
        workers = self._exiting
        while not self._ready.empty():
            workers.append(self._ready.get())
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
            w.wait()
            w.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
# The worker: `python -I sandbox.py CFG`, pid 1 of its namespaces. It sets up the view of the files,
# reads one job from stdin, forks the child that runs it, waits, and prints one JSON result.

def _mount(source, target: str, fstype, flags: int, data: str | None = None) -> bool:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    return _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0


def _private_view(hide: list[str], keep: list[str]) -> str:
    ok = total = 0
    for line in open("/proc/self/mountinfo"):
        point, options = line.split()[4:6]
        point = point.replace("\\040", " ")
        flags = sum(f for o, f in LOCKED.items() if o in options.split(","))
        total += 1
        ok += _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
    assert _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777"), "no private /tmp"
    hidden = []
    for path in hide:
        if not os.path.isdir(path) or os.path.islink(path) or path in keep:
            continue
        inside = [k for k in keep if k.startswith(path + "/") and os.path.isdir(k)]
        handles = [os.open(k, os.O_PATH) for k in inside]  # still reachable once the tmpfs covers them
        mode = "1777" if path == "/dev/shm" else "755"  # multiprocessing needs a writable /dev/shm
        if _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size=16m,mode={mode}"):
            hidden.append(path)
        for k, fd in zip(inside, handles):
            os.makedirs(k, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)  # a bind keeps the read-only flag
    return (f"network, mount and pid namespaces; {ok}/{total} mounts read-only; private /tmp 64 MiB; "
            f"covered: {' '.join(hidden)}")


def _worker(cfg: dict) -> None:
    _libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the code may not ptrace this init
    isolated = os.getpid() == 1
    report = _private_view(cfg["hide"], cfg["keep"]) if isolated else "no namespaces"
    work = "/tmp" if isolated else tempfile.mkdtemp(prefix="grpo-sandbox-")
    drop = os.geteuid() == 0 and any(int(a) <= NOBODY < int(a) + int(n) for a, _, n in
                                     (line.split() for line in open("/proc/self/uid_map")))
    if drop and not isolated:
        os.chown(work, NOBODY, NOBODY)
    report += "; code runs as uid 65534" if drop else "; code runs without capabilities"
    data = sys.stdin.buffer.read()
    if not data:  # the pool closed before using this worker
        return
    job = json.loads(data)
    out, err = os.memfd_create("stdout"), os.memfd_create("stderr")
    sys.stdout.flush()  # nothing buffered may be copied into the child
    pid = os.fork()
    if pid == 0:
        _child(job["code"], {**cfg["limits"], "RLIMIT_CPU": int(job["timeout"]) + 1}, out, err, work, drop)
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
        sig = signal.Signals(os.WTERMSIG(status))
        why = {"SIGSEGV": "segmentation fault", "SIGXCPU": "CPU time limit", "SIGXFSZ": "file size limit",
               "SIGKILL": "killed", "SIGABRT": "aborted", "SIGBUS": "bus error"}.get(sig.name, "signal")
        notes.append(f"[crashed: {sig.name} ({why})]")
    text = _output(out, err, cfg["max_output"], notes)
    if not isolated:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"text": text, "report": report}), flush=True)


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


def _child(code: str, limits: dict, out: int, err: int, work: str, drop: bool) -> None:
    os.setsid()  # its own process group, killed as one
    for fd, target in ((os.open(os.devnull, os.O_RDONLY), 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    os.closerange(3, 1 << 16)  # the worker's pipes to the trainer and everything else
    os.chdir(work)
    os.environ["HOME"] = work
    for name, value in limits.items():  # CPU: the soft limit's SIGXCPU names the cause, SIGKILL would not
        resource.setrlimit(getattr(resource, name), (value, value + (name == "RLIMIT_CPU")))
    if drop:  # root ignores RLIMIT_NPROC; nobody does not
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    else:  # root of a user namespace: no capability left, none regained by exec (could undo the mounts)
        for cap in range(64):
            _libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
        _libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())
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
    _worker(json.loads(sys.argv[1]))
