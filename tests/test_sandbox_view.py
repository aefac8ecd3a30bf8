"""grpo.envs.sandbox, third round: what a call could still reach after tests/test_sandbox.py's escapes were
closed. Each test failed on the sandbox before it: files of the project, a data set and named credentials
were readable; a device node made on a host folder opened; /sys/fs/cgroup listed every call; removed
cgroups stayed dying with their charge; an OOM kill lost the output; lock probes, huge pages, raising the
core limit and (in a user namespace) signalling the worker passed."""
import ctypes
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo.envs import cgroups, sandbox
from grpo.envs.sandbox import Sandbox

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

NS, REASON = sandbox.namespaces()
needs_ns = pytest.mark.skipif(NS is None, reason=f"the kernel refused namespaces: {REASON}")
SECCOMP = os.uname().machine == "x86_64"  # the filter's syscall numbers are x86_64's; elsewhere it is missing
needs_seccomp = pytest.mark.skipif(not SECCOMP, reason=f"no seccomp filter for {os.uname().machine}")
ROOT = os.geteuid() == 0
CGROUPS, NO_CGROUPS = cgroups.where()
needs_cgroups = pytest.mark.skipif(not CGROUPS, reason=f"no cgroup per call here: {NO_CGROUPS}")
SECRET = f"hf_{uuid.uuid4().hex}"
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout this suite runs from
VIEWS = pytest.mark.parametrize("view", [True, False], ids=["allow-list view", "deny-list view"])
# for the code: raw syscalls, every argument a long (syscall() is variadic)
SYSCALL = ("import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
           "def sys_(nr, *args):\n"
           "    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]\n"
           "    r = libc.syscall(ctypes.c_long(nr), *args)\n"
           "    return r if r >= 0 else errno.errorcode[ctypes.get_errno()]\n")
KW = {"allow_missing": not SECCOMP}


@pytest.fixture(scope="module")
def sb():
    with Sandbox(workers=2, memory_mb=1024, **KW) as box:
        yield box


def _readable(paths: dict[str, str]) -> str:
    """Code that prints, per name, what it read of the path or why it could not."""
    return (f"for name, path in {paths!r}.items():\n    try:\n        print(name, open(path).read()[:60])\n"
            "    except OSError as e:\n        print(name, 'refused:', e.strerror)")


def _secret_folder(parent: str) -> str:
    """A world-readable folder under `parent` holding `secret` (SECRET), as a data set or a token would be."""
    folder = tempfile.mkdtemp(dir=parent, prefix="grpo-sandbox-test-")
    os.chmod(folder, 0o755)
    with open(os.path.join(folder, "secret"), "w") as f:
        f.write(SECRET)
    os.chmod(os.path.join(folder, "secret"), 0o644)
    return folder


@needs_ns
@VIEWS
def test_project_data_and_named_credentials_are_not_readable(view, monkeypatch):
    """The project, a data folder beside it (an answer key) and the credential files the environment names:
    none in the allow-list view; the deny-list view, the fallback, still covers the credentials."""
    data, creds = _secret_folder(os.path.dirname(PROJECT)), _secret_folder("/var/tmp")
    try:
        paths = {"project": os.path.abspath(__file__), "data": os.path.join(data, "secret"),
                 "HF_TOKEN_PATH": os.path.join(creds, "secret"), "NETRC": os.path.join(creds, "netrc")}
        shutil.copy(paths["HF_TOKEN_PATH"], paths["NETRC"])
        monkeypatch.setenv("HF_TOKEN_PATH", paths["HF_TOKEN_PATH"])
        monkeypatch.setenv("NETRC", paths["NETRC"])
        monkeypatch.setattr(sandbox, "VIEW", view, raising=False)  # the deny-list alone, where False
        with Sandbox(workers=1, memory_mb=1024, **KW) as box:
            out, isolation = box.run(_readable(paths)), box.isolation
    finally:
        shutil.rmtree(data)
        shutil.rmtree(creds)
    assert ("files: an allow-list view" if view else "files: the deny-list view") in isolation, isolation
    for name in paths if view else ["HF_TOKEN_PATH", "NETRC"]:  # the fallback shows the host's other files
        assert f"{name} refused:" in out, out
    assert SECRET not in out or not view, out


@needs_ns
def test_the_allow_list_view_holds_the_interpreter_and_the_system_only(sb):
    """/ lists the system's folders, /etc, the call's /tmp, /dev and /proc, and the way to the interpreter:
    no home, project, data, /sys, /run or /var; numpy and sympy import (the ReTool recipe's)."""
    code = ("import os, numpy, sympy, time, mimetypes, socket\nprint(sorted(os.listdir('/')))\n"
            "print(sorted(os.listdir('/etc')))\n"
            "print(numpy.arange(4).sum(), sympy.sqrt(8), socket.getservbyname('http'), "
            "time.localtime().tm_year > 2000)")
    out = sb.run(code).splitlines()
    shown = {p.split("/")[1] for p in sandbox.SYSTEM if os.path.lexists(p)} | {"etc", "tmp", "dev", "proc"}
    python = {p.split("/")[1] for p in (sys.prefix, sys.base_prefix)}  # the first folder on its way
    assert shown <= set(eval(out[0])) <= shown | python, out
    etc = {n for n in sandbox.ETC if os.path.lexists(f"/etc/{n}")} | {"passwd", "group", "hosts"}
    assert set(eval(out[1])) == etc, out
    assert out[2] == "6 2*sqrt(2) 80 True", out
    assert os.path.basename(PROJECT) not in out[0]


@needs_ns
@VIEWS
@pytest.mark.skipif(not ROOT, reason="mknod needs root")
def test_a_device_node_on_a_host_folder_does_not_open(view, monkeypatch):
    """A read-only mount does not stop a device's reads or writes: every mount is nodev now. The node sits
    in the interpreter's folder, which both views show."""
    folder = tempfile.mkdtemp(dir=sys.prefix, prefix=".grpo-sandbox-test-")
    try:
        os.chmod(folder, 0o755)
        node = os.path.join(folder, "zero")
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero's numbers
        os.chmod(node, 0o666)
        monkeypatch.setattr(sandbox, "VIEW", view, raising=False)  # the deny-list alone, where False
        with Sandbox(workers=1, memory_mb=1024, **KW) as box:
            out = box.run(f"import os\nprint(os.path.exists({node!r}))\n"
                          f"try:\n    print(open({node!r}, 'rb').read(4))\n"
                          "except OSError as e:\n    print('refused:', e.strerror)")
    finally:
        shutil.rmtree(folder)
    assert out == "True\nrefused: Permission denied\n", out


@needs_ns
@VIEWS
def test_sys_fs_cgroup_shows_no_other_call(view, monkeypatch):
    """It listed every sibling call's cgroup and the trainer's: absent in the allow-list view, an empty
    tmpfs in the deny-list view."""
    code = ("import os, time\nnames = [n for _, folders, files in os.walk('/sys/fs/cgroup') for n in folders + files]\n"
            "print(len(names), [n for n in names if n.startswith(('call-', 'grpo-sandbox-'))][:3])\ntime.sleep(0.5)")
    monkeypatch.setattr(sandbox, "VIEW", view, raising=False)  # the deny-list alone, where False
    with Sandbox(workers=2, memory_mb=1024, **KW) as box:
        with ThreadPoolExecutor(2) as pool:  # two calls alive at once
            outs = list(pool.map(box.run, [code, code]))
    assert outs == ["0 []\n", "0 []\n"], outs


def _charge(folder: str) -> int:
    """Bytes charged to a memory cgroup itself: its own usage less its live children's (what its removed
    children left behind)."""
    def usage(d):
        for name in ("memory.usage_in_bytes", "memory.current"):  # v1, v2
            if os.path.exists(os.path.join(d, name)):
                return int(open(os.path.join(d, name)).read())
        return 0
    children = [e.path for e in os.scandir(folder) if e.is_dir()]
    return usage(folder) - sum(usage(c) for c in children)


def _dying(folder: str) -> int:
    """Dying memory cgroups: v2's count under `folder`; v1 has none per folder, so the machine's
    (/proc/cgroups counts dying ones too) less the live ones under `folder`: other processes that make
    and remove cgroups meanwhile are noise."""
    stat_file = os.path.join(folder, "cgroup.stat")
    if os.path.exists(stat_file):
        return int(dict(line.split() for line in open(stat_file))["nr_dying_descendants"])
    machine = next(int(line.split()[2]) for line in open("/proc/cgroups") if line.startswith("memory\t"))
    return machine - sum(1 for e in os.scandir(folder) if e.is_dir())


@needs_ns
@needs_cgroups
def test_calls_leave_no_dying_cgroup_and_no_charge():
    """Each of 20 calls reads a file no one had cached (its page cache is charged to the call's cgroup)
    and looks up 5,000 missing names (negative dentries, charged too). Removed as they were, every call's
    cgroup stayed dying, and the pool held ~4 MiB per call; memory.force_empty / memory.reclaim first
    leaves nothing."""
    folder = tempfile.mkdtemp(dir=sys.prefix, prefix=".grpo-sandbox-test-")  # in both views
    os.chmod(folder, 0o755)
    files = []
    for i in range(20):
        files.append(os.path.join(folder, f"data-{i}"))
        with open(files[-1], "wb") as f:
            f.write(os.urandom(4 << 20))
            f.flush()
            os.fsync(f.fileno())  # clean pages: posix_fadvise can drop them
        os.chmod(files[-1], 0o644)
    try:
        with Sandbox(workers=2, memory_mb=512, **KW) as box:
            pool = box._cgroups["memory"][0]
            before = _dying(pool), _charge(pool)
            for path in files:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # uncached: the call reads it first
                os.close(fd)
                code = (f"import os\nprint(len(open({path!r}, 'rb').read()) >> 20)\n"
                        f"print(sum(os.path.exists({folder!r} + f'/missing-{{i}}') for i in range(5000)))")
                assert box.run(code) == "4\n0\n"
            for _ in range(20):  # a worker exits after its answer: its cgroup goes at a later call, off its path
                time.sleep(0.2)
                box.run("pass")
                if hasattr(box, "_removals"):  # the remover thread is done with what it was given
                    box._removals.join()
                if not box._busy:
                    break
            after = _dying(pool), _charge(pool)
    finally:
        shutil.rmtree(folder)
    # v1's count is the machine's: a cgroup or two of other processes may be dying meanwhile
    assert after[0] - before[0] <= (0 if os.path.exists(os.path.join(pool, "cgroup.stat")) else 3), (before, after)
    assert after[1] - before[1] < 8 << 20, (before, after)  # 20 x 4 MiB of page cache, and the dentries


@needs_ns
@needs_cgroups
def test_an_oom_kill_is_named_with_the_output_so_far():
    """A child holds 120 MiB, then the code takes 200 MiB: the call's cgroup (256 + 64 MiB) is full and
    the kernel kills the largest process with oom_score_adj 1000: the code's, never the worker's."""
    code = ("import os, time\nprint('before', flush=True)\nif os.fork() == 0:\n    held = b'x' * (120 << 20)\n"
            "    time.sleep(30)\ntime.sleep(1)\nheld = b'x' * (200 << 20)\nprint('after')")
    with Sandbox(workers=1, memory_mb=256, **KW) as box:
        out = box.run(code, timeout=20)
        assert box.run("print(open('/proc/self/oom_score_adj').read().strip())") == "1000\n"
    assert out == "before\n[crashed: SIGKILL (out of memory: the call may use 320 MiB)]", out


@needs_ns
def test_a_worker_lost_to_the_oom_killer_keeps_the_output(sb, monkeypatch):
    """Where the OOM killer takes the worker itself (what the code left in tmpfs outweighs it), the
    trainer reads the output from the memfds it holds. Modelled: the worker is killed mid-call while its
    cgroup's OOM count is faked; without that count the same loss is a sandbox error, as before."""
    taken, take = [], sb._take
    monkeypatch.setattr(sb, "_take", lambda: taken.append(take()) or taken[-1])
    monkeypatch.setattr(cgroups, "oom_killed", lambda folders: True, raising=False)
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(sb.run, "import time\nprint('before', flush=True)\ntime.sleep(10)")
        deadline = time.monotonic() + 10
        while not taken or os.fstat(taken[0].out).st_size == 0:
            assert time.monotonic() < deadline, "the code never printed"
            time.sleep(0.01)
        os.killpg(taken[0].pid, signal.SIGKILL)
        out = result.result(timeout=10)
    limit = (1024 + sandbox.CGROUP_HEADROOM_MB)
    assert out == f"before\n[crashed: out of memory: the call may use {limit} MiB; its worker was killed]", out
    monkeypatch.undo()
    assert sb.run("print('next')") == "next\n"


@needs_ns
@needs_seccomp
def test_lock_probes_huge_pages_and_core_limits_refused(sb):
    """F_GETLK / F_OFD_GETLK read another call's record locks on a shared file (a channel between calls):
    refused; F_OFD_SETLK stays (sqlite3). Huge pages (memfd, mmap, SysV) come from the machine's pool:
    refused. RLIMIT_CORE is 1, soft and hard (a pipe core_pattern dumps at 0), and cannot be raised;
    prlimit64 on another process (the worker) is refused."""
    host_file = os.path.realpath(sys.executable)
    code = (SYSCALL + "import resource\n"
            f"fd = os.open({host_file!r}, os.O_RDONLY)\n"
            "lock = (ctypes.c_short * 16)(0)\n"  # struct flock, l_type F_RDLCK (0), whole file
            "print('F_GETLK', sys_(72, fd, 5, lock), 'F_OFD_GETLK', sys_(72, fd, 36, lock), "
            "'F_OFD_SETLK', sys_(72, fd, 37, lock))\n"
            "print('memfd', sys_(319, b'x', 4), 'mmap', sys_(9, 0, 2 << 20, 3, 0x22 | 0x40000, -1, 0), "
            "'shmget', sys_(29, 0, 2 << 20, 0o600 | 0x800))\n"
            "print('core', resource.getrlimit(resource.RLIMIT_CORE))\n"
            "try:\n    resource.setrlimit(resource.RLIMIT_CORE, (2, 2))\n    print('raised')\n"
            "except (ValueError, OSError) as e:\n    print('not raised:', e)\n"
            "print('prlimit worker', sys_(302, 1, 7, 0, 0), 'own', sys_(302, 0, 7, 0, lock))")
    out = sb.run(code).splitlines()
    assert out[0] == "F_GETLK EPERM F_OFD_GETLK EPERM F_OFD_SETLK 0", out
    assert out[1] == "memfd EPERM mmap EPERM shmget EPERM", out
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    core = 1 if hard == resource.RLIM_INFINITY else min(1, hard)
    assert out[2] == f"core ({core}, {core})" and out[3].startswith("not raised"), out
    assert out[4] == "prlimit worker EPERM own 0", out


@needs_ns
@pytest.mark.skipif(not ROOT, reason="the user-namespace path is modelled by a trainer run as uid 1000 in a "
                                     "user namespace of root's")
def test_user_namespace_worker_ignores_sigint_and_keeps_its_limits():
    """On the user-namespace path (a trainer that is not root) the code has its worker's uid: a SIGINT to
    pid 1 raised KeyboardInterrupt there (the output was lost), prlimit lowered the worker's limits."""
    code = ("import os, resource, signal, time\nos.kill(1, signal.SIGINT)\ntime.sleep(0.2)\nprint('sent')\n"
            "try:\n    resource.prlimit(1, resource.RLIMIT_NOFILE, (3, 3))\n    print('lowered')\n"
            "except OSError as e:\n    print('prlimit:', e.strerror)")
    script = ("import importlib.util\nspec = importlib.util.spec_from_file_location('sandbox', "
              f"{sandbox.__file__!r})\nsandbox = importlib.util.module_from_spec(spec)\n"
              "spec.loader.exec_module(sandbox)\n"
              f"with sandbox.Sandbox(workers=1, memory_mb=1024, allow_missing=True) as box:\n"
              f"    print(repr(box.run({code!r})), 'user namespace' in box.isolation)\n")
    r = subprocess.run(["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-c", script],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "Sandbox" not in r.stderr:
        pytest.skip(f"no user namespace for a trainer here: {r.stderr.strip()[-300:]}")
    want = "'sent\\nprlimit: Operation not permitted\\n' True" if SECCOMP else "'sent\\n"
    assert r.stdout.splitlines()[-1].startswith(want), (r.stdout, r.stderr[-2000:])
