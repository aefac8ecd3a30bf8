"""grpo.envs.sandbox: each test is an escape attempt that must fail and leave this process (the
trainer) running. Tests that need namespaces skip with the kernel's reason where it refuses them."""
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo.envs import sandbox
from grpo.envs.sandbox import Sandbox

NS, REASON = sandbox.namespaces()
needs_ns = pytest.mark.skipif(NS is None, reason=f"the kernel refused namespaces: {REASON}")
SECRET = f"hf_{uuid.uuid4().hex}"  # a token the trainer holds in its environment


@pytest.fixture(scope="module")
def sb():
    os.environ["GRPO_SANDBOX_TEST_SECRET"] = SECRET  # set before any worker starts
    try:
        with Sandbox(workers=4, memory_mb=1024, allow_network=NS is None) as box:
            yield box
    finally:
        del os.environ["GRPO_SANDBOX_TEST_SECRET"]


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _owned_by(uid: int) -> int:
    n = 0
    for pid in _pids():
        try:
            n += os.stat(f"/proc/{pid}").st_uid == uid
        except OSError:
            pass
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
        assert sb.isolation.startswith("network, mount and pid namespaces"), sb.isolation


def test_run_code_default_pool():
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
    script = ("from grpo.envs.sandbox import Sandbox\nwith Sandbox(workers=1) as sb:\n"
              "    print(repr(sb.run('import os\\nwhile True:\\n    os.fork()', timeout=3)))\n"
              "    print(repr(sb.run('print(6 * 7)')))")
    # the outer cap, in case the sandbox fails: the bomb's trainer runs in a pid namespace of the test's
    # that the test kills whole if the machine gains 1000 processes (or after 60 s)
    outer = ["unshare", "--pid", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        outer[1:1] = ["--user", "--map-root-user"]
    p = subprocess.Popen([*outer, sys.executable, "-c", script],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    base, peak, nobody, deadline = len(_pids()), 0, 0, time.monotonic() + 60
    while p.poll() is None:
        peak = max(peak, len(_pids()))
        nobody = max(nobody, _owned_by(sandbox.NOBODY)) if os.geteuid() == 0 else 0
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
    assert nobody <= sandbox.LIMITS["RLIMIT_NPROC"]  # as root: the dropped uid's RLIMIT_NPROC held


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
    script = ("import os\nfrom grpo.envs.sandbox import Sandbox\ntry:\n    Sandbox(workers=1)\n"
              "except RuntimeError as e:\n    print('refused:', e)\n"
              "os.environ['GRPO_SANDBOX_ALLOW_NETWORK'] = '1'\n"
              "with Sandbox(workers=1) as sb:\n    print('ran:', sb.run('print(6 * 7)').strip())")
    limit = ("echo 0 > /proc/sys/user/max_net_namespaces && echo 0 > /proc/sys/user/max_user_namespaces"
             " && exec \"$@\"")
    env = {k: v for k, v in os.environ.items() if k != "GRPO_SANDBOX_ALLOW_NETWORK"}
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc",
                        "sh", "-c", limit, "sh", sys.executable, "-c", script],
                       capture_output=True, text=True, timeout=60, env=env)
    if r.returncode != 0 and "refused:" not in r.stdout:
        pytest.skip(f"cannot make a refusing kernel here: {r.stderr.strip()[-300:]}")
    assert "refused: grpo.envs.sandbox: cannot isolate the network here" in r.stdout, r.stdout + r.stderr
    assert "No space left on device" in r.stdout and "allow_network=True" in r.stdout  # the kernel's reason
    assert "ran: 42" in r.stdout and "namespaces refused" in r.stdout, r.stdout + r.stderr
