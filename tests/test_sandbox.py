"""grpo.envs.sandbox: each test is an escape attempt that must fail and leave this process (the
trainer) running. Tests that need namespaces skip with the kernel's reason where it refuses them."""
import collections
import ctypes
import http.server
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo.envs import cgroups, sandbox
from grpo.envs.sandbox import Sandbox

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

NS, REASON = sandbox.namespaces()
needs_ns = pytest.mark.skipif(NS is None, reason=f"the kernel refused namespaces: {REASON}")
SECRET = f"hf_{uuid.uuid4().hex}"  # a token the trainer holds in its environment
ROOT = os.geteuid() == 0
SECCOMP = os.uname().machine == "x86_64"  # the filter's syscall numbers are x86_64's; elsewhere it is missing
needs_seccomp = pytest.mark.skipif(not SECCOMP, reason=f"no seccomp filter for {os.uname().machine}")
# the subprocess tests' trainers import the sandbox.py this test imported, wherever it is installed from
IMPORT = ("import importlib.util\nspec = importlib.util.spec_from_file_location('sandbox', "
          f"{sandbox.__file__!r})\nsandbox = importlib.util.module_from_spec(spec)\n"
          "spec.loader.exec_module(sandbox)\nSandbox = sandbox.Sandbox\n")
LIBC = ctypes.CDLL(None, use_errno=True)
# for the code: raw syscalls, every argument a long (syscall() is variadic)
SYSCALL = ("import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
           "def sys_(nr, *args):\n"
           "    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]\n"
           "    r = libc.syscall(ctypes.c_long(nr), *args)\n"
           "    return r if r >= 0 else errno.errorcode[ctypes.get_errno()]\n")


@pytest.fixture(scope="module")
def sb():
    os.environ["GRPO_SANDBOX_TEST_SECRET"] = SECRET  # set before any worker starts
    try:
        with Sandbox(workers=4, memory_mb=1024, allow_network=NS is None, allow_missing=not SECCOMP) as box:
            yield box
    finally:
        del os.environ["GRPO_SANDBOX_TEST_SECRET"]


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _per_uid() -> collections.Counter:
    """Processes per uid, the sandbox's only (the range its calls' uids come from)."""
    n = collections.Counter()
    for pid in _pids():
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
        n[uid] += uid >= sandbox.UID_BASE
    return n


def test_stdout_then_stderr_and_a_fresh_interpreter(sb):
    out = sb.run("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\nx = 1 / 0")
    assert out.startswith("to stdout\nto stderr\nTraceback"), out
    assert out.endswith("ZeroDivisionError: division by zero\n") and "sandbox.py" not in out, out
    assert "NameError: name 'x' is not defined" in sb.run("print(x)")  # nothing survives a call
    assert sb.run("import sys\nprint(__name__, sys.argv, [k for k in globals() if k[0] != '_'])") == \
        "__main__ ['-c'] ['sys']\n"
    assert sb.run("import numpy, sympy\nprint(numpy.arange(4).sum(), sympy.sqrt(8))") == "6 2*sqrt(2)\n"
    assert sb.run("import sys\nsys.exit('bye')") == "bye\n"
    assert "SyntaxError" in sb.run("def f(:")
    if NS is not None:
        assert sb.isolation.startswith("network, mount, pid, ipc, uts and cgroup namespaces"), sb.isolation


@needs_ns
def test_an_interpreter_under_tmp_keeps_its_packages(tmp_path):
    """A virtual environment made under /tmp (as on a fresh machine): the call's private /tmp must
    not hide its site-packages, and the rest of the real /tmp stays hidden."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    site = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    site = tmp_path / "venv" / site.split(str(venv) + "/", 1)[1]
    (site / "probe_in_venv.py").write_text("X = 41\n")
    # --system-site-packages shows the base interpreter's packages, not those of a virtual environment this
    # suite may run in (the README's): its site folders, .pth files included (grpo's editable install), too
    (site / "outer_env.pth").write_text(f"import site; list(map(site.addsitedir, {sitepackages()!r}))\n")
    (tmp_path / "outside.txt").write_text("the trainer's")
    code = (f"import os\nimport probe_in_venv\nprint(probe_in_venv.X + 1, os.path.exists({str(tmp_path / 'outside.txt')!r}))")
    script = IMPORT + (f"with Sandbox(workers=1, allow_missing={not SECCOMP}) as box:\n"
                       f"    print(box.run({code!r}), end='')\n")
    r = subprocess.run([venv / "bin" / "python", "-c", script], capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines()[-1:] == ["42 False"], (r.stdout, r.stderr[-2000:])  # after the start line


def sitepackages() -> list[str]:
    import site
    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def test_run_code_default_pool(monkeypatch):
    if not SECCOMP:  # the default refuses where a layer is missing
        monkeypatch.setenv("GRPO_SANDBOX_ALLOW_MISSING", "1")
    assert sandbox.run_code("print(6 * 7)", timeout=5) == "42\n"


@needs_ns
def test_no_connection_to_a_socket_the_trainer_listens_on(sb):
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)  # abstract unix sockets belong to the network namespace too
    unix.bind(f"\0grpo-sandbox-test-{uuid.uuid4().hex}")
    unix.listen()
    code = (f"import socket\nfor family, address in [(socket.AF_INET, {tcp.getsockname()!r}), "
            f"(socket.AF_UNIX, {unix.getsockname()!r})]:\n"
            "    try:\n        socket.socket(family).connect(address)\n        print('connected', address)\n"
            "    except OSError as e:\n        print('blocked:', e.strerror)")
    out = sb.run(code, timeout=5)
    assert "connected" not in out and out.count("blocked") == 2, out
    for listener in (tcp, unix):
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came
        listener.close()


@needs_ns
def test_no_dns_and_no_fetch(sb):
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"the trainer's page")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    code = ("import socket, urllib.request\n"
            "try:\n    print(socket.getaddrinfo('example.com', 80))\n"
            "except OSError as e:\n    print('no dns:', e)\n"
            f"for url in ['http://example.com/', 'http://127.0.0.1:{port}/', 'http://localhost:{port}/']:\n"
            "    try:\n        print(urllib.request.urlopen(url, timeout=3).read())\n"
            "    except Exception as e:\n        print('failed:', url, type(e).__name__)")
    out = sb.run(code, timeout=15)
    server.shutdown()
    assert "no dns" in out and out.count("failed") == 3 and "page" not in out and hits == [], out


@needs_ns
def test_writes_stay_in_the_working_folder(sb, tmp_path):
    name = f"grpo-escape-{uuid.uuid4().hex}"
    targets = [str(tmp_path / name), f"/var/tmp/{name}", f"/dev/shm/{name}", os.path.join(os.getcwd(), name),
               os.path.join(os.path.expanduser("~"), name), os.path.join(sys.prefix, name)]
    code = (f"import os\nfor path in {targets!r}:\n    try:\n        open(path, 'w').write('escaped')\n"
            "    except OSError as e:\n        print('refused:', e.strerror)\n"
            "open('mine.txt', 'w').write('for this call only')\nprint(os.getcwd(), os.listdir('.'))")
    out = sb.run(code)
    assert "mine.txt" in out, out
    for path in targets:
        assert not os.path.exists(path), (path, out)
    assert "mine.txt" not in sb.run("import os\nprint(os.listdir('.'))")  # the folder went with the call


def test_environment_has_nothing_of_the_trainer(sb):
    code = "import os\nprint(dict(os.environ))"
    if NS is not None:  # the trainer's own /proc entry: not even visible from the pid namespace
        code += (f"\nfor pid in (1, os.getppid(), {os.getpid()}):\n    try:\n"
                 "        print(open(f'/proc/{pid}/environ').read())\n"
                 "    except OSError as e:\n        print(pid, e.strerror)")
    out = sb.run(code)
    assert SECRET not in out and "GRPO_SANDBOX_TEST_SECRET" not in out and "PYTEST" not in out, out


@needs_ns
def test_fork_bomb_under_an_outer_cap():
    script = (IMPORT + f"with Sandbox(workers=1, allow_missing={not SECCOMP}) as sb:\n"
              "    print(repr(sb.run('import os\\nwhile True:\\n    os.fork()', timeout=3)))\n"
              "    print(repr(sb.run('print(6 * 7)')))")
    # the outer cap, in case the sandbox fails: the bomb's trainer runs in a pid namespace of the test's
    # that the test kills whole if the machine gains 1000 processes (or after 60 s)
    outer = ["unshare", "--pid", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        outer[1:1] = ["--user", "--map-root-user"]
    p = subprocess.Popen([*outer, sys.executable, "-c", script],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    base, peak, per_uid, deadline = len(_pids()), 0, 0, time.monotonic() + 60
    while p.poll() is None:
        peak = max(peak, len(_pids()))
        per_uid = max(per_uid, *_per_uid().values(), 0) if ROOT else 0
        if peak > base + 1000 or time.monotonic() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pytest.fail(f"the outer cap fired: {peak - base} more processes")
        time.sleep(0.01)
    out, err = p.communicate()
    assert p.returncode == 0, err
    bomb, after = out.strip().splitlines()[-2:]
    assert "timed out" in bomb or "Resource temporarily unavailable" in bomb, bomb
    assert after == repr("42\n")
    assert per_uid <= sandbox.LIMITS["RLIMIT_NPROC"]  # as root: the dropped uid's RLIMIT_NPROC held


def test_memory_bomb(sb):
    assert "MemoryError" in sb.run("x = bytearray(1 << 40)")
    out = sb.run("blocks = []\nwhile True:\n    blocks.append(b'x' * (64 << 20))", timeout=30)
    assert "MemoryError" in out, out


def test_infinite_loop(sb):
    t = time.monotonic()
    assert sb.run("print('started')\nwhile True:\n    pass", timeout=1) == "started\n[timed out after 1 s]"
    assert time.monotonic() - t < 4


@needs_ns
def test_killing_the_parent_or_the_trainer(sb):
    code = (f"import os\nfor pid in (os.getppid(), {os.getpid()}, 1):\n    try:\n"
            "        os.kill(pid, 9)\n        print('sent', pid)\n"
            "    except OSError as e:\n        print('refused:', pid, e.strerror)")
    out = sb.run(code)
    assert f"refused: {os.getpid()} No such process" in out, out  # the trainer is not even visible
    # the worker's init: root's (EPERM) or, in a user namespace, an init that ignores its own namespace
    assert sb.run("print('alive')") == "alive\n"


@needs_ns
def test_no_process_outlives_its_call(sb):
    def sleepers() -> list[int]:
        found = []
        for pid in _pids():
            try:
                if b"987.25" in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(pid)
            except OSError:
                pass
        return found

    code = ("import os, subprocess\nsubprocess.Popen(['sleep', '987.25'], start_new_session=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '987.25'])\n"
            "print('started')")
    assert sb.run(code) == "started\n"
    deadline = time.monotonic() + 5
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sleepers()


def test_100_mb_of_output(sb):
    out = sb.run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\nprint('end')", 30)
    assert len(out) <= sb.max_output + 400, len(out)
    assert "[output truncated to 8192 bytes: stdout was 16777216 bytes" in out, out[-600:]
    assert "File too large" in out  # the file size limit stopped it at 16 MiB


def test_segfault(sb):
    out = sb.run("print('before')\nimport ctypes\nctypes.string_at(0)")
    assert out == "before\n[crashed: SIGSEGV (segmentation fault)]", out
    assert sb.run("print('next')") == "next\n"


def test_concurrent_calls(sb):
    codes = [f"import time\ntime.sleep(0.3)\nprint({i} * {i})" for i in range(8)]
    t = time.monotonic()
    with ThreadPoolExecutor(8) as pool:  # as the sampler's tool threads call it
        outs = list(pool.map(sb.run, codes))
    assert outs == [f"{i * i}\n" for i in range(8)]
    assert time.monotonic() - t < 8 * 0.3  # they overlapped


def test_a_lost_worker_is_replaced(sb, monkeypatch):
    idle = [sb._ready.get() for _ in range(2)]  # killed while waiting in the pool
    for w in idle:
        os.killpg(w.pid, signal.SIGKILL)
        w.wait()
        sb._ready.put(w)
    assert [sb.run(f"print({i})") for i in range(6)] == [f"{i}\n" for i in range(6)]
    taken, take = [], sb._take  # killed while running a call: an error line, not an exception
    monkeypatch.setattr(sb, "_take", lambda: taken.append(take()) or taken[-1])
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(sb.run, "import time\ntime.sleep(10)")
        while not taken:
            time.sleep(0.01)
        time.sleep(0.3)
        os.killpg(taken[0].pid, signal.SIGKILL)
        assert result.result(timeout=5).startswith("[sandbox error: the worker exited without a result")
    assert sb.run("print('next')") == "next\n"


def test_refuses_to_start_without_network_isolation():
    if NS is None:  # this kernel refuses already
        with pytest.raises(RuntimeError, match="GRPO_SANDBOX_ALLOW_NETWORK"):
            Sandbox(workers=1)
        return
    # a kernel that refuses: a user namespace whose limits allow no new network or user namespace
    script = ("import os\n" + IMPORT + "try:\n    Sandbox(workers=1)\n"
              "except RuntimeError as e:\n    print('refused:', e)\n"
              "os.environ['GRPO_SANDBOX_ALLOW_NETWORK'] = '1'\ntry:\n    Sandbox(workers=1)\n"
              "except RuntimeError as e:\n    print('refused again:', e)\n"
              "os.environ['GRPO_SANDBOX_ALLOW_MISSING'] = '1'\n"
              "with Sandbox(workers=1) as sb:\n"
              "    print('ran:', sb.run('print(6 * 7)').strip(), sb.isolation)")
    limit = ("echo 0 > /proc/sys/user/max_net_namespaces && echo 0 > /proc/sys/user/max_user_namespaces"
             " && exec \"$@\"")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_SANDBOX_ALLOW")}
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc",
                        "sh", "-c", limit, "sh", sys.executable, "-c", script],
                       capture_output=True, text=True, timeout=60, env=env)
    if r.returncode != 0 and "refused:" not in r.stdout:
        pytest.skip(f"cannot make a refusing kernel here: {r.stderr.strip()[-300:]}")
    assert "refused: grpo.envs.sandbox: cannot isolate the network here" in r.stdout, r.stdout + r.stderr
    assert "No space left on device" in r.stdout and "allow_network=True" in r.stdout  # the kernel's reason
    # without namespaces, calls share one uid (0 of this user namespace), a layer missing of its own
    assert "refused again: grpo.envs.sandbox: isolation layers missing here: a uid of its own per call" in \
        r.stdout and "GRPO_SANDBOX_ALLOW_MISSING=1" in r.stdout, r.stdout + r.stderr
    assert "ran: 42" in r.stdout and "namespaces refused" in r.stdout, r.stdout + r.stderr
    assert "(missing: a uid of its own per call" in r.stdout, r.stdout
    assert "sockets AF_UNIX only" in r.stdout or not SECCOMP, r.stdout


@needs_seccomp
def test_refuses_to_start_without_seccomp():
    # a kernel that refuses seccomp filters: this test's trainer runs under a filter of the sandbox's own
    # making, where seccomp() (317) and prctl (157) PR_SET_SECCOMP (22) answer EINVAL
    script = (IMPORT + "s = sandbox\nassert s._install(s._bpf([(s.LD, 0, 0, s.NR), (s.JEQ, 'no', 0, 317), "
              "(s.JEQ, 0, 'yes', 157), (s.LD, 0, 0, s.ARG0), (s.JEQ, 'no', 'yes', 22), "
              "'yes', (s.RET, 0, 0, s.ALLOW), 'no', (s.RET, 0, 0, 0x50000 | 22)])) == ''\n"
              "try:\n    Sandbox(workers=1, allow_network=True)\n"
              "except RuntimeError as e:\n    print('refused:', e)\n"
              "with Sandbox(workers=1, allow_network=True, allow_missing=True) as sb:\n"
              "    print('ran:', sb.run('import socket\\nsocket.socket()\\nprint(6 * 7)').strip())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_SANDBOX_ALLOW")}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert "refused: grpo.envs.sandbox: isolation layers missing here: seccomp filter (Invalid argument)" in \
        r.stdout, r.stdout + r.stderr
    assert "ran: 42" in r.stdout, r.stdout + r.stderr  # allowed: it runs, and sockets are not filtered


def test_own_session_keyring():
    # the trainer's token in its session keyring: the worker inherits that keyring, and setuid keeps it
    sys_ = lambda *a: LIBC.syscall(*(ctypes.c_long(x) if isinstance(x, int) else x for x in a))  # noqa: E731
    if sys_(250, 1, None) < 0:  # KEYCTL_JOIN_SESSION_KEYRING: a new one for this test process
        pytest.skip(f"no keyrings here: {os.strerror(ctypes.get_errno())}")
    key = sys_(248, b"user", b"grpo-test-token", SECRET.encode(), len(SECRET), -3)  # add_key to @s
    assert key > 0, os.strerror(ctypes.get_errno())
    code = (SYSCALL + "buf = ctypes.create_string_buffer(256)\n"
            f"print('read:', sys_(250, 11, {key}, buf, 256), buf.value)\n"  # KEYCTL_READ the trainer's key
            "print('search:', sys_(250, 10, -3, b'user', b'grpo-test-token', 0))\n"  # KEYCTL_SEARCH @s
            "for ring in (-3, -4, -5):\n"  # add_key to @s, @u, @us
            "    print('add:', sys_(248, b'user', b'planted', b'x', 1, ring))\n"
            "print(open('/proc/keys').read())")
    try:
        with Sandbox(workers=1, memory_mb=1024, allow_network=NS is None, allow_missing=not SECCOMP) as box:
            out = box.run(code)
    finally:
        sys_(250, 3, key)  # KEYCTL_REVOKE
    assert SECRET not in out and "grpo-test-token" not in out, out
    if SECCOMP:  # keyctl denied outright
        assert out.count("add: EPERM") == 3 and "search: EPERM" in out, out
    assert sys_(250, 10, -3, b"user", b"planted", 0) < 0  # nothing planted in the trainer's keyring


@needs_ns
def test_namespaces_of_its_own(sb):
    kinds = ["net", "mnt", "pid", "ipc", "uts", "cgroup"]
    code = (f"import os, time\nprint(' '.join(os.readlink(f'/proc/self/ns/{{k}}') for k in {kinds!r}))\n"
            "time.sleep(0.5)")
    with ThreadPoolExecutor(2) as pool:  # two rows of one rollout: both alive at once
        outs = list(pool.map(sb.run, [code, code]))
    for kind, *ns in zip(kinds, *(out.split() for out in outs)):
        assert os.readlink(f"/proc/self/ns/{kind}") not in ns and ns[0] != ns[1], (kind, outs)


@pytest.mark.skipif(not ROOT or NS is None, reason="per-call uids are root's (a user namespace has one uid)")
def test_two_pools_share_no_uid():  # as the trainers of two ranks on one machine each start one
    code = "import os\nprint(os.getuid())"
    kw = {"workers": 1, "memory_mb": 1024, "allow_missing": not SECCOMP}
    with Sandbox(**kw) as a, Sandbox(**kw) as b:
        uids = [int(box.run(code)) for box in (a, b, a, b)]
    assert len(set(uids)) == 4 and min(uids) >= sandbox.UID_BASE, uids


def test_uid_blocks_claimed_at_random_and_through_a_shared_lock_folder(tmp_path, monkeypatch):
    """Two trainers on one kernel that share no network namespace (two containers): their claims by socket
    name never meet, so each starts at a random block, and a lock folder both see keeps them apart for sure.
    The second trainer is modelled by a claim made in a child process with a network namespace of its own."""
    firsts = {sandbox._claim_uids()[1] for _ in range(8)}  # each claim freed when its handles are collected
    assert len(firsts) > 1 and all((f - sandbox.UID_BASE) % sandbox.UID_BLOCK == 0 for f in firsts), firsts
    monkeypatch.setenv("GRPO_SANDBOX_UID_LOCKS", str(tmp_path))
    monkeypatch.setattr(sandbox.random, "SystemRandom", lambda: types.SimpleNamespace(randrange=lambda n: 5))
    handles, first = sandbox._claim_uids()  # held by this test until the end
    assert first == sandbox.UID_BASE + 5 * sandbox.UID_BLOCK and (tmp_path / f"grpo-sandbox-uids-{first}.lock").exists()
    other = sandbox._claim_uids()  # in the same namespace: the name is taken, the next block
    assert other[1] == first + sandbox.UID_BLOCK
    if NS is None:
        return
    script = (IMPORT + "import random, types\n"
              "random.SystemRandom = lambda: types.SimpleNamespace(randrange=lambda n: 5)\n"
              "print(sandbox._claim_uids()[1])")  # the same start, in a network namespace of its own
    r = subprocess.run([*NS[:1], *(["--user", "--map-root-user"] if not ROOT else []), "--net", sys.executable,
                        "-c", script], capture_output=True, text=True, env={**os.environ}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) not in (first, first + sandbox.UID_BLOCK), r.stdout  # the locks kept it off both
    for h in handles + other[0]:
        h.close()


@needs_ns
def test_ipc_objects_do_not_outlive_a_call(sb):
    key = random.randrange(1 << 20, 1 << 30)
    make = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.shmget({key}, 8 << 20, 0o1666) >= 0, libc.msgget({key}, 0o1666) >= 0, "
            f"libc.semget({key}, 1, 0o1666) >= 0)")
    find = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.shmget({key}, 0, 0), libc.msgget({key}, 0), libc.semget({key}, 0, 0))")
    try:
        assert sb.run(make) == "True True True\n"
        assert sb.run(find) == "-1 -1 -1\n"  # the next call (a fresh worker) finds none of them
        left = [LIBC.shmget(key, 0, 0), LIBC.msgget(key, 0), LIBC.semget(key, 0, 0)]
        assert left == [-1, -1, -1], left  # nor does the trainer: nothing pins memory after the call
    finally:  # a failed run must not leave 8 MiB of shared memory on this machine
        for get, ctl in ((LIBC.shmget, LIBC.shmctl), (LIBC.msgget, LIBC.msgctl)):
            if (i := get(key, 0, 0)) >= 0:
                ctl(i, 0, None)  # IPC_RMID
        if (i := LIBC.semget(key, 0, 0)) >= 0:
            LIBC.semctl(i, 0, 0)


@needs_ns
def test_ipc_namespace_limits(sb):
    """SysV shared memory: 16 MiB in all per call, and a segment no process holds is gone at once
    (one held 2,400 MiB past a 2,048 MiB address-space limit with the kernel's defaults)."""
    code = ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "get = lambda mb: libc.shmget(0, ctypes.c_size_t(mb << 20), 0o1600)\n"
            "print(get(64) < 0 and errno.errorcode[ctypes.get_errno()], get(12) >= 0, get(4) >= 0, "
            "get(1) < 0 and errno.errorcode[ctypes.get_errno()])\n"
            "print(open('/proc/sys/kernel/shm_rmid_forced').read().strip())")
    host = open("/proc/sys/kernel/shmmax").read()
    assert sb.run(code) == "EINVAL True True ENOSPC\n1\n"  # over shmmax; then the 16 MiB are spent
    assert open("/proc/sys/kernel/shmmax").read() == host  # the namespace's own sysctls, not the host's


@needs_ns
def test_a_dev_of_its_own(sb):
    """Only null, zero, full, random, urandom and tty of the host's device nodes; /dev itself read-only."""
    code = ("import os, subprocess\nprint(sorted(os.listdir('/dev')))\n"
            "open('/dev/null', 'w').write('x')\nprint(open('/dev/zero', 'rb').read(2), len(os.urandom(4)))\n"
            "print(subprocess.run(['echo', 'ok'], stdin=subprocess.DEVNULL, capture_output=True).stdout)\n"
            "try:\n    open('/dev/made', 'w')\nexcept OSError as e:\n    print(e.strerror)\n"
            "for name in %r:\n    print(name, os.path.exists('/dev/' + name))")
    others = [n for n in os.listdir("/dev") if n not in sandbox.DEV_NODES and n not in sandbox.DEV_LINKS
              and n not in ("pts", "shm")][:20]  # e.g. disks, consoles, kvm, a GPU's nvidia*
    if not others:
        pytest.skip("this machine's /dev holds nothing but what the sandbox's keeps: no node to find missing")
    out = sb.run(code % others)
    nodes = [n for n in sandbox.DEV_NODES if os.path.exists(f"/dev/{n}")]  # those this machine has
    assert out.startswith(str(sorted([*nodes, *sandbox.DEV_LINKS, "pts", "shm"])) + "\n"), out
    assert "b'\\x00\\x00' 4\nb'ok\\n'\nRead-only file system\n" in out, out
    assert all(f"{n} False\n" in out for n in others), out


@needs_ns
def test_own_devpts(sb):
    master, slave = os.openpty()  # a pty of the trainer's that anyone may write to
    name = os.ttyname(slave)
    os.chmod(name, 0o666)
    code = (f"import os\nprint(sorted(os.listdir('/dev/pts')))\n"
            f"try:\n    fd = os.open({name!r}, os.O_WRONLY)\n"
            "    os.write(fd, b'from the sandbox')\n    print('wrote')\n"
            "except OSError as e:\n    print('refused:', e.strerror)\n"
            "m, s = os.openpty()\nos.write(m, b'own\\n')\nprint('own pty:', os.ttyname(s), os.read(s, 9))")
    try:
        out = sb.run(code)
        os.set_blocking(master, False)
        with pytest.raises(BlockingIOError):
            os.read(master, 100)  # nothing came in
    finally:
        os.close(master)
        os.close(slave)
    assert out.startswith("['ptmx']\nrefused:") and "own pty: /dev/pts/0 b'own\\n'" in out, out


@needs_ns
@needs_seccomp
def test_sockets_are_unix_only(sb):
    code = ("import socket\nfor family, kind in [('AF_INET', 'SOCK_DGRAM'), ('AF_INET6', 'SOCK_STREAM'), "
            "('AF_NETLINK', 'SOCK_RAW'), ('AF_PACKET', 'SOCK_RAW'), ('AF_VSOCK', 'SOCK_STREAM'), "
            "('AF_ALG', 'SOCK_SEQPACKET')]:\n"
            "    try:\n        s = socket.socket(getattr(socket, family), getattr(socket, kind))\n"
            "        if family == 'AF_VSOCK':\n            s.bind((socket.VMADDR_CID_ANY, 0))\n"
            "        print(family, 'made')\n    except OSError as e:\n        print(family, e.strerror)\n"
            "a, b = socket.socketpair()\na.send(b'unix')\n"
            "print(b.recv(4), socket.socket(socket.AF_UNIX).family)")
    out = sb.run(code)
    assert "made" not in out and out.count("Operation not permitted") == 6, out
    assert out.endswith("b'unix' 1\n"), out  # AF_UNIX works


@needs_ns
@needs_seccomp
def test_escape_syscalls_denied(sb):
    code = (SYSCALL + "import threading, subprocess\n"
            "print('unshare', sys_(272, 0x10000000))\n"  # CLONE_NEWUSER: every capability back
            "print('clone', sys_(56, 0x10000000 | 17, 0, 0, 0, 0))\n"  # clone(CLONE_NEWUSER | SIGCHLD)
            "print('clone3', sys_(435, 0, 0))\n"
            "print('ptrace', sys_(101, 0, 0, 0, 0))\n"  # PTRACE_TRACEME
            "print('bpf', sys_(321, 0, 0, 0))\nprint('perf_event_open', sys_(298, 0, 0, -1, -1, 0))\n"
            "print('userfaultfd', sys_(323, 0))\nprint('io_uring_setup', sys_(425, 1, 0))\n"
            "print('x32 getpid', sys_(0x40000000 + 39))\nprint('modify_ldt', sys_(154, 0, 0, 0))\n"
            "t = threading.Thread(target=print, args=('a thread',))\nt.start()\nt.join()\n"
            "print(subprocess.run(['echo', 'a process'], capture_output=True, text=True).stdout.strip())")
    out = sb.run(code)
    for name in ["unshare", "clone", "ptrace", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
                 "x32 getpid", "modify_ldt"]:
        assert f"{name} EPERM\n" in out, (name, out)
    assert "clone3 ENOSYS\n" in out and out.endswith("a thread\na process\n"), out  # libc falls back


@needs_ns
@needs_seccomp
def test_state_the_kernel_shares_is_refused(sb):
    """flock on a readable host file, Linux AIO, the page cache's probes, inotify, fcntl's leases and
    dnotify: EPERM; syscalls outside the allow-list answer ENOSYS, as a kernel without them would
    (preadv2, whose RWF_NOWAIT probes the page cache; syslog's read of the kernel log). Each of these
    succeeds without the filter (fanotify, refused to non-root anyway, is not checked)."""
    host_file = os.path.realpath(sys.executable)  # visible in every call, wherever the checkout lives (/tmp: not)
    code = (SYSCALL + f"fd = os.open({host_file!r}, os.O_RDONLY)\n"
            "ctx = ctypes.c_ulong(0)\nbuf = ctypes.create_string_buffer(4096)\n"
            "iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 4096)\n"
            "print('flock', sys_(73, fd, 2))\n"  # LOCK_EX with a read-only descriptor
            "print('io_setup', sys_(206, 8, ctypes.byref(ctx)))\nprint('fadvise64', sys_(221, fd, 0, 0, 4))\n"
            "print('mincore', sys_(27, 0, 4096, buf))\nprint('cachestat', sys_(451, fd, 0, 0, 0))\n"
            "print('inotify_init1', sys_(294, 0))\n"
            "print('preadv2', sys_(327, fd, iov, 1, 0, 0, 8))\nprint('syslog', sys_(103, 3, buf, 64))\n"
            "mine = os.open('/tmp/mine', os.O_RDONLY | os.O_CREAT, 0o600)\n"
            "print('lease', sys_(72, mine, 1024, 0))\n"  # F_SETLEASE, F_RDLCK on its own file
            "print('dnotify', sys_(72, os.open('/tmp', os.O_RDONLY), 1026, 1))")  # F_NOTIFY, DN_ACCESS
    out = sb.run(code)
    for name in ["flock", "io_setup", "fadvise64", "mincore", "cachestat", "inotify_init1", "lease", "dnotify"]:
        assert f"{name} EPERM\n" in out, (name, out)
    assert "preadv2 ENOSYS\nsyslog ENOSYS\n" in out, out


@needs_ns
@needs_seccomp
def test_the_allow_list_runs_the_usual_python(sb):
    """What model-written code reaches for under the allow-list: numpy, sympy, threads, processes,
    multiprocessing, subprocess, sqlite3 on a file (fcntl's record locks), asyncio, mmap, signals."""
    code = ("import numpy as np, sympy, threading, subprocess, sqlite3, asyncio, mmap, signal, time, tempfile, os\n"
            "import multiprocessing as mp, concurrent.futures as cf\n"
            "print(round(float(np.linalg.inv(np.eye(3) * 2)[0, 0]), 2), sympy.solve(sympy.Symbol('x') ** 2 - 4))\n"
            "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
            "def sq(v):\n    return v * v\n"
            "fork = mp.get_context('fork')\n"  # forkserver is 3.14's default: it would look for sq in a new __main__
            "with fork.Pool(2) as p:\n    print(p.map(sq, range(4)))\n"
            "with cf.ProcessPoolExecutor(2, mp_context=fork) as ex:\n    print(list(ex.map(sq, range(3))))\n"
            "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())\n"
            "db = sqlite3.connect(os.path.join(tempfile.mkdtemp(), 'x.db'))\n"
            "db.execute('create table t(a)')\ndb.execute('insert into t values (7)')\ndb.commit()\n"
            "print(db.execute('select a from t').fetchone())\n"
            "async def co():\n    await asyncio.sleep(0.01)\n    return 'async'\nprint(asyncio.run(co()))\n"
            "m = mmap.mmap(-1, 4096)\nm[:2] = b'mm'\nprint(m[:2])\n"
            "signal.signal(signal.SIGALRM, lambda *a: print('alarm'))\nsignal.setitimer(signal.ITIMER_REAL, 0.01)\n"
            "time.sleep(0.05)\n"
            # a timed wait stopped and continued resumes through restart_syscall (SIGSTOP/SIGCONT, a frozen cgroup)
            "import select\npid = os.fork()\nif pid == 0:\n    try:\n        select.poll().poll(400)\n"
            "        os._exit(0)\n    except OSError:\n        os._exit(3)\n"
            "time.sleep(0.1)\nos.kill(pid, signal.SIGSTOP)\ntime.sleep(0.1)\nos.kill(pid, signal.SIGCONT)\n"
            "print('resumed', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
            "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')])")
    out = sb.run(code, timeout=60)
    assert out == ("0.5 [-2, 2]\nthread\n[0, 1, 4, 9]\n[0, 1, 4]\nchild\n(7,)\nasync\nb'mm'\nalarm\n"
                   "resumed 0\n['0000000000000000']\n"), out  # no capability left, whichever way it dropped


@pytest.mark.skipif(not ROOT or NS is None, reason="per-call uids are root's (a user namespace has one uid)")
def test_one_call_cannot_take_the_processes_of_another(sb):
    hog = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
           "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
           "except OSError as e:\n    print(os.getuid(), n, e.strerror)\ntime.sleep(3)")
    with ThreadPoolExecutor(1) as pool:
        hogged = pool.submit(sb.run, hog, 8)
        deadline = time.monotonic() + 8
        while not hogged.done() and max(_per_uid().values(), default=0) < sandbox.LIMITS["RLIMIT_NPROC"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        other = sb.run("import os, threading, subprocess\n"
                       "t = threading.Thread(target=print, args=('thread',))\n"
                       "t.start()\nt.join()\nprint(os.getuid(), subprocess.run(['true']).returncode)")
        uid, n, why = hogged.result().split(maxsplit=2)
    assert int(n) >= sandbox.LIMITS["RLIMIT_NPROC"] - 2 and why == "Resource temporarily unavailable\n", why
    assert other.startswith("thread\n") and other.endswith(" 0\n") and other.split()[1] != uid, other


@needs_ns
@pytest.mark.parametrize("view", [True, False], ids=["allow-list view", "deny-list view"])
@pytest.mark.parametrize("on_path", ["a folder under home", "home and a folder under it"])
def test_home_hidden_even_on_sys_path(on_path, view, monkeypatch):
    home = os.path.expanduser("~")
    if home in ("/", "/tmp") or not os.access(home, os.W_OK):
        pytest.skip(f"no home of this user's to hide: {home}")
    folder = tempfile.mkdtemp(dir=home, prefix=".grpo-sandbox-test-")
    try:
        os.chmod(folder, 0o755)
        with open(os.path.join(folder, "token"), "w") as f:
            f.write(SECRET)
        os.chmod(os.path.join(folder, "token"), 0o644)
        monkeypatch.setattr(sys, "path", [home, folder] if on_path.startswith("home") else
                            [folder, *sys.path])
        monkeypatch.setattr(sandbox, "VIEW", view)
        with Sandbox(workers=1, memory_mb=1024, allow_missing=not SECCOMP) as box:
            out = box.run(f"import os\nprint('home:', os.listdir({home!r}) if os.path.isdir({home!r}) else [])\n"
                          f"print(open({os.path.join(folder, 'token')!r}).read())")
    finally:
        shutil.rmtree(folder)
    listed = out.splitlines()[0]  # not there, or an empty folder with at most the Python install's folders
    assert listed.startswith("home: [") and os.path.basename(folder) not in listed, out
    assert SECRET not in out and "FileNotFoundError" in out, out


def test_oom_score_adj(sb):
    assert sb.run("print(open('/proc/self/oom_score_adj').read().strip())") == "1000\n"


def test_a_failed_respawn_is_retried(monkeypatch):
    with Sandbox(workers=1, memory_mb=1024, allow_network=NS is None, allow_missing=not SECCOMP) as box:
        spawn, fails = box._spawn, []

        def failing_once():
            if not fails:
                fails.append(1)
                raise OSError(11, "Resource temporarily unavailable")
            return spawn()
        monkeypatch.setattr(box, "_spawn", failing_once)
        assert box.run("print(1)") == "1\n"  # its replacement failed to start: retried in the background
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(box.run, "print(2)").result(timeout=10) == "2\n"
        assert fails == [1]


def test_waiting_for_a_worker_has_a_timeout(monkeypatch):
    with Sandbox(workers=1, memory_mb=1024, allow_network=NS is None, allow_missing=not SECCOMP) as box:
        box.ready_timeout = 0.5
        def failing():
            raise OSError(12, "Cannot allocate memory")
        monkeypatch.setattr(box, "_spawn", failing)
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(box.run, "print(1)").result(timeout=10) == "1\n"
            t = time.monotonic()
            out = pool.submit(box.run, "print(2)").result(timeout=10)
        assert out == "[sandbox error: RuntimeError: no worker became ready within 0.5 s (workers fail to " \
                      "start: see stderr)]", out
        assert time.monotonic() - t < 5
        box._closed = True  # stop the retries before the real _spawn comes back


# ----------------------------------------------------------------------------- second round


@needs_ns
def test_a_real_time_signal_is_reported(sb):
    """A child killed by a signal signal.Signals does not name (real-time ones) used to make the
    worker raise: the call's output was lost. Any number is named now."""
    out = sb.run("print('before', flush=True)\nimport os\nos.kill(os.getpid(), 40)")
    assert out == f"before\n[crashed: SIGRTMIN+{40 - int(signal.SIGRTMIN)} (signal)]", out
    assert sandbox.signal_name(11) == "SIGSEGV" and sandbox.signal_name(200) == "signal 200"


@needs_ns
def test_every_rlimit_is_the_sandboxs_own(sb):
    """Set, not inherited from the trainer: no locked memory, real-time priority, raised niceness or
    message-queue bytes; pending signals and the stack bounded."""
    want = {"RLIMIT_MEMLOCK": 0, "RLIMIT_RTPRIO": 0, "RLIMIT_NICE": 0, "RLIMIT_MSGQUEUE": 0,
            "RLIMIT_SIGPENDING": 256, "RLIMIT_STACK": 8 << 20}
    code = "import resource\n" + "".join(f"print(resource.getrlimit(resource.{n})[0])\n" for n in want)
    got = [int(x) for x in sb.run(code).split()]
    hard = [resource.getrlimit(getattr(resource, n))[1] for n in want]  # never raised past the trainer's
    assert got == [v if h == resource.RLIM_INFINITY else min(v, h) for v, h in zip(want.values(), hard)], got


def test_mountinfo_paths_unescaped():
    assert sandbox.unescape(r"/mnt/a\040b\011c\012d\134e") == "/mnt/a b\tc\nd\\e"
    assert sandbox.unescape("/plain/path") == "/plain/path"


def test_a_mount_left_writable_or_a_folder_left_visible_is_a_missing_layer(monkeypatch, tmp_path):
    """The view is built with mount(2) mocked (nothing is mounted here): a read-only remount that
    fails, or a folder that cannot be covered, is named as missing (the pool then refuses to start
    unless allowed), where it used to lower a count or be skipped."""
    calls = []

    def mount(source, target, fstype, flags, data=None):
        calls.append(target)
        return not (flags & sandbox.MS_REMOUNT and target == "/")  # the root's remount fails

    monkeypatch.setattr(sandbox, "_mount", mount)
    monkeypatch.setattr(sandbox, "_cover", lambda path, options, keep: path != str(tmp_path))
    monkeypatch.setattr(sandbox, "_private_dev", lambda dev: ([], []))  # its mounts are mocked: leave /dev be
    report, missing = sandbox._deny_list_view([str(tmp_path), "/dev/shm"], [])
    assert any(m.startswith("read-only '/'") for m in missing), missing
    assert any(m.startswith(f"hiding {tmp_path}") for m in missing), missing
    assert "/" in calls and "covered: /dev/shm" in report


@needs_ns
@pytest.mark.parametrize("how", ["symlinked home", "HF_HOME", "XDG_CACHE_HOME"])
def test_home_and_named_caches_hidden_at_their_real_paths(how, monkeypatch):
    """A home that is a symlink used to be skipped (the call read ~/.cache/huggingface/token through
    its real path); the caches the environment names are covered too, wherever they are."""
    base = tempfile.mkdtemp(dir="/var/tmp", prefix="grpo-sandbox-test-")  # outside /tmp (the call's own)
    try:
        real = os.path.join(base, "real")
        os.makedirs(os.path.join(real, "sub"))
        with open(os.path.join(real, "sub", "token"), "w") as f:
            f.write(SECRET)
        os.chmod(base, 0o755), os.chmod(real, 0o755), os.chmod(os.path.join(real, "sub"), 0o755)
        os.chmod(os.path.join(real, "sub", "token"), 0o644)
        link = os.path.join(base, "link")
        os.symlink(real, link)
        monkeypatch.setenv({"symlinked home": "HOME", "HF_HOME": "HF_HOME", "XDG_CACHE_HOME": "XDG_CACHE_HOME"}[how],
                           link)
        assert real in sandbox.hidden_paths()
        monkeypatch.setattr(sandbox, "VIEW", False)  # the fallback's deny-list (the allow-list shows none of them)
        with Sandbox(workers=1, memory_mb=1024, allow_missing=not SECCOMP) as box:
            out = box.run(f"print(open({os.path.join(real, 'sub', 'token')!r}).read())\n")
            assert "hiding" not in box.isolation and "the deny-list view" in box.isolation, box.isolation
    finally:
        shutil.rmtree(base)
    assert SECRET not in out and "FileNotFoundError" in out, out


CGROUPS, NO_CGROUPS = cgroups.where()


@needs_ns
@pytest.mark.skipif(not CGROUPS, reason=f"no cgroup per call here: {NO_CGROUPS}")
def test_a_cgroup_bounds_the_whole_call():
    """Four processes of 150 MiB each fit the address-space limit (256 MiB a process) but not the call's
    cgroup (256 + 64 MiB in all): the kernel kills some. Without the cgroup all four finish (exit 0). The
    code sees its cgroup as the root of its namespace; a timed-out call's folder goes with the pool."""
    code = ("import os, time\npids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
            "        b = bytearray(150 << 20)\n        b[::4096] = b'x' * len(b[::4096])\n"
            "        time.sleep(1)\n        os._exit(0)\n    pids.append(pid)\n"
            "print(sorted(os.waitpid(p, 0)[1] for p in pids))\n"
            "print(sorted({l.strip().split(':')[2] for l in open('/proc/self/cgroup') if 'memory' in l or 'pids' in l}))")
    with Sandbox(workers=1, memory_mb=256, allow_network=NS is None, allow_missing=not SECCOMP) as box:
        assert "a cgroup per call" in box.isolation and "256 + 64 MiB in all" in box.isolation, box.isolation
        w = box._ready.queue[0]
        limits = {"memory.limit_in_bytes": 320 << 20, "memory.max": 320 << 20, "pids.max": 65}
        for folder in w.cgroups:  # the trainer's view: the limits written, the worker inside
            for name, value in limits.items():
                if os.path.exists(os.path.join(folder, name)):
                    assert int(open(os.path.join(folder, name)).read()) == value, (folder, name)
            deadline = time.monotonic() + 10  # the launcher writes itself in as it starts
            while not open(os.path.join(folder, "cgroup.procs")).read().split():
                assert time.monotonic() < deadline, f"the worker never joined {folder}"
                time.sleep(0.05)
        lines = box.run(code, timeout=30).splitlines()
        assert signal.SIGKILL in eval(lines[0]), lines  # the cgroup's OOM killer took some
        assert lines[1] == "['/']", lines  # the call's cgroup namespace is rooted at its own cgroup
        assert box.run("import time\ntime.sleep(5)", timeout=0.5).startswith("[timed out")
        pools = {os.path.dirname(f) for f in w.cgroups}
    assert not any(os.path.exists(p) for p in pools), pools  # its calls' folders, killed ones too, and the pool


def test_cgroup_folders_found_and_written(tmp_path):
    """where() on faked /proc files: v1 where memory and pids are mounted, else a v2 parent that hands them
    down; the limits written to that version's files (a faked cgroupfs is plain folders: no kernel)."""
    proc, fs = tmp_path / "proc", tmp_path / "fs"
    proc.mkdir()
    job = fs / "v2" / "user.slice" / "job"
    job.mkdir(parents=True)
    (job / "cgroup.controllers").write_text("cpu memory pids\n")
    (job.parent / "cgroup.procs").write_text("")
    (proc / "cgroup").write_text("0::/user.slice/job\n")
    (proc / "mountinfo").write_text(f"30 25 0:26 / {fs}/v2 rw shared:9 - cgroup2 cgroup2 rw,nsdelegate\n")
    roots, why = cgroups.where(str(proc))
    assert roots == {"memory": (str(job.parent), 2), "pids": (str(job.parent), 2)}, why  # beside the trainer's
    pool, words = cgroups.make_pool(roots)
    assert open(f"{pool['memory'][0]}/cgroup.subtree_control").read() == "+memory +pids"
    assert words == "v2, swap not limited (not accounted here)"  # no memory.swap.max in the pool
    call = cgroups.make_call(pool, "call-7-1", 320 << 20, 65)
    assert len(call) == 1 and open(f"{call[0]}/memory.max").read() == str(320 << 20)
    assert open(f"{call[0]}/pids.max").read() == "65"
    assert cgroups.join_argv(call) == ["/bin/sh", "-c", cgroups.JOIN, "sh", call[0], "--"]
    (job / "cgroup.controllers").write_text("cpu io\n")
    assert cgroups.where(str(proc)) == ({}, f"cgroup v2: {job.parent} does not hand memory and pids down (cpu io)")
    (proc / "cgroup").write_text("0::/\n")
    assert "at its namespace's root" in cgroups.where(str(proc))[1]
    (fs / "memory" / "abc").mkdir(parents=True)  # v1; memory's mount is of /docker (a container's view)
    (fs / "pids" / "docker" / "abc").mkdir(parents=True)
    (proc / "cgroup").write_text("4:memory:/docker/abc\n8:pids:/docker/abc\n0::/\n")
    (proc / "mountinfo").write_text(f"31 25 0:27 /docker {fs}/memory rw - cgroup cgroup rw,memory\n"
                                    f"32 25 0:28 / {fs}/pids rw - cgroup  rw,pids\n")  # an empty source field
    roots, why = cgroups.where(str(proc))
    assert roots == {"memory": (f"{fs}/memory/abc", 1), "pids": (f"{fs}/pids/docker/abc", 1)}, why
    pool, words = cgroups.make_pool(roots)
    call = cgroups.make_call(pool, "call-8-2", 128 << 20, 65)
    assert [open(f"{d}/{f}").read() for d, f in zip(call, ["memory.limit_in_bytes", "pids.max"])] == \
        [str(128 << 20), "65"]
    (proc / "mountinfo").write_bytes(b"31 25 0:27 /\xff /x rw - cgroup cgroup rw,memory\n")  # not UTF-8
    assert cgroups.where(str(proc))[0] == {}
