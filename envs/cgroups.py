"""A memory and pids cgroup per sandbox call, where this machine lets the trainer make them.

rlimits bound each process of a call; a cgroup bounds the call: every process it starts, its tmpfs pages,
memfds and SysV shared memory count against one memory limit (and no swap, where the kernel accounts it),
and against one process count. The trainer makes a folder per pool (`grpo-sandbox-<pid namespace>-<pid>-<random>`) and,
per worker, a folder `call-<uid>-<n>` with the limits written (never reused: a killed worker's folder
stays busy for a few ms after it is reaped). The worker's launcher joins it before it execs `unshare`
(join_argv), so the worker, everything the code starts, and the root of the call's cgroup namespace are
that folder: the code sees "/" as its cgroup and cannot move out of it. Folders are removed once empty,
after their memory is reclaimed: a removed memory cgroup that still holds page cache (files the call read
first) stays in the kernel as a dying cgroup, and its slab (negative dentries) moves its charge to the
parent; memory.force_empty (v1) or memory.reclaim (v2) first leaves none (20 calls that each read a 4 MiB
file no one had cached and looked up 5,000 missing names: 21 dying cgroups and 81 MiB left charged to the
pool before, none after; tests/test_sandbox_view.py).

Where the pools live:
- cgroup v1's memory and pids hierarchies, mounted and writable (as root in most containers): under the
  trainer's own cgroup there.
- else cgroup v2, delegated to the trainer's user: v2 hands controllers only to the children of a cgroup
  that holds no process, so a pool is a sibling of the trainer's cgroup, under its parent, where that
  parent hands memory and pids down (the trainer's cgroup.controllers lists them) and may be written. A
  trainer at its cgroup namespace's root has no such parent: it must run in a leaf of its own (say
  /trainer), which the start line says.
Neither: no cgroup per call, and the start line says why (not a missing layer: most unprivileged machines
have none). Nor where the code would run as the trainer's own user without namespaces: it could write its
own limits.
"""
import os
import random
import time

PREFIX = "grpo-sandbox-"
# the launcher of a worker: joins each folder given before "--" (echo 0: the writing process, this shell),
# then execs the rest, so unshare and everything after start inside; a refused join ends it with a line
JOIN = ('while [ "$1" != -- ]; do echo 0 > "$1/cgroup.procs" || { echo "[sandbox: cannot join the cgroup $1]"; '
        'exit 97; }; shift; done; shift; exec "$@"')


def where(proc: str = "/proc/self") -> tuple[dict[str, tuple[str, int]], str]:
    """The folder to make pools under, per controller: {"memory": (folder, version), "pids": ...}, for
    both or for neither; and, for neither, why. `proc` stands for /proc/self (tests fake it)."""
    try:
        return _where(proc)
    except (OSError, ValueError, IndexError) as e:  # a /proc this parser does not know: no cgroups, said why
        return {}, f"cannot read this process's cgroups ({type(e).__name__}: {e})"


def _where(proc: str) -> tuple[dict[str, tuple[str, int]], str]:
    from grpo.envs.sandbox import unescape  # mountinfo's octal escapes (sandbox imports this module)
    mine = {}  # controller ("" for v2) -> this process's cgroup path
    with open(f"{proc}/cgroup", errors="surrogateescape") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                mine[c] = path
    found = {}  # controller -> this process's cgroup folder: the last mount of its hierarchy that shows it
    with open(f"{proc}/mountinfo", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            tail = fields[fields.index("-") + 1:]  # fstype, source (maybe empty), super options
            kinds = {"cgroup2": [""], "cgroup": sorted(set(tail[-1].strip().split(",")) & {"memory", "pids"})}
            for c in (c for c in kinds.get(tail[0], []) if c in mine):
                rel = os.path.relpath(mine[c], unescape(fields[3]))  # the mount may show a subtree only
                if rel != ".." and not rel.startswith("../"):
                    found[c] = os.path.normpath(os.path.join(unescape(fields[4]), rel))
    if "memory" in found and "pids" in found:
        if all(os.access(found[c], os.W_OK) for c in ("memory", "pids")):
            return {c: (found[c], 1) for c in ("memory", "pids")}, ""
        return {}, f"cgroup v1's memory and pids folders are not writable here ({found['memory']})"
    if "" not in found:
        return {}, "neither cgroup v1's memory and pids nor cgroup v2 is mounted for this process"
    mine_v2 = found[""]
    if mine[""] == "/":
        return {}, (f"cgroup v2: this process is at its namespace's root ({mine_v2}); run the trainer in a leaf "
                    "cgroup of its own (v2 gives controllers only to the children of a cgroup with no process)")
    with open(os.path.join(mine_v2, "cgroup.controllers")) as f:
        controllers = f.read().split()
    parent = os.path.dirname(mine_v2)
    if not {"memory", "pids"} <= set(controllers):
        return {}, f"cgroup v2: {parent} does not hand memory and pids down ({' '.join(controllers) or 'none'})"
    if not (os.access(parent, os.W_OK) and os.access(os.path.join(parent, "cgroup.procs"), os.W_OK)):
        return {}, f"cgroup v2: {parent} is not delegated to this user"
    return {"memory": (parent, 2), "pids": (parent, 2)}, ""


def make_pool(roots: dict[str, tuple[str, int]]) -> tuple[dict[str, tuple[str, int]], str]:
    """A folder per controller for one pool's calls (one on v2), and the start line's words for it; or {}
    and why not. Leftovers of trainers that died (their pid gone) are removed first, where empty."""
    tag = f"{PREFIX}{_namespace()}-{os.getpid()}-{random.randrange(1 << 32):08x}"
    pool = {}
    try:
        for parent, _ in set(roots.values()):
            _sweep(parent)
        for c, (parent, version) in roots.items():
            d = os.path.join(parent, tag)
            if not os.path.isdir(d):  # v2: one folder holds both controllers
                os.mkdir(d)
            pool[c] = (d, version)
        version = pool["memory"][1]
        if version == 2:  # its children get the controllers it is handed (it holds no process)
            _write(os.path.join(pool["memory"][0], "cgroup.subtree_control"), "+memory +pids")
        swap = os.path.join(pool["memory"][0], "memory.memsw.limit_in_bytes" if version == 1 else "memory.swap.max")
    except OSError as e:
        remove(pool)
        return {}, f"cannot make a cgroup for the calls ({e.strerror}: {e.filename})"
    return pool, f"v{version}, " + ("no swap" if os.path.exists(swap) else "swap not limited (not accounted here)")


def make_call(pool: dict[str, tuple[str, int]], name: str, memory: int, pids: int) -> list[str]:
    """One call's folders (one on v2, one per controller on v1) with `memory` bytes, no swap where the
    kernel accounts it, and `pids` processes written. On a failure, what it made is removed."""
    made = []
    try:
        for c, (parent, version) in pool.items():
            d = os.path.join(parent, name)
            if d not in made:
                os.mkdir(d)
                made.append(d)
            limits = {("memory", 1): [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
                      ("memory", 2): [("memory.max", memory), ("memory.swap.max", 0)],
                      ("pids", 1): [("pids.max", pids)], ("pids", 2): [("pids.max", pids)]}[c, version]
            for i, (file, value) in enumerate(limits):  # v1: memsw only at or above the memory limit: after it
                if i == 0 or os.path.exists(os.path.join(d, file)):  # no swap file: the kernel accounts no swap
                    _write(os.path.join(d, file), str(value))
    except OSError:
        remove(made)
        raise
    return made


def join_argv(folders: list[str]) -> list[str]:
    """The launcher to put before a worker's argv: it joins `folders`, then execs the worker."""
    return ["/bin/sh", "-c", JOIN, "sh", *folders, "--"] if folders else []


def remove(folders, wait: float = 0.0) -> list[str]:
    """Reclaim each folder's memory, then rmdir it: a list, or a pool's dict. A cgroup folder goes once
    no process is in it; a killed worker leaves it ~10 ms after it was reaped, so this retries for up to
    `wait` seconds. -> the folders still there (busy: for a later call, or the next pool's sweep)."""
    deadline = time.monotonic() + wait
    left = []
    for d in dict.fromkeys(d for d, _ in folders.values()) if isinstance(folders, dict) else folders:
        while not (_reclaim(d) and _rmdir(d)) and time.monotonic() < deadline:
            time.sleep(0.005)
        if os.path.isdir(d):
            left.append(d)
    return left


def oom_killed(folders: list[str]) -> bool:
    """Whether the kernel's OOM killer killed a process of this call's memory cgroup (the oom_kill count
    of v1's memory.oom_control, v2's memory.events)."""
    for d in folders:
        for name in ("memory.oom_control", "memory.events"):
            try:
                with open(os.path.join(d, name)) as f:
                    counts = dict(line.split() for line in f if line.strip())
            except OSError:  # not this version's file, or the folder is gone
                continue
            return int(counts.get("oom_kill", 0)) > 0
    return False


def _reclaim(d: str) -> bool:
    """Drop what the memory cgroup `d` still has charged (page cache, slab), once no process is in it.
    False while one is (rmdir would fail anyway)."""
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            if f.read().strip():
                return False
        if os.path.exists(os.path.join(d, "memory.force_empty")):  # v1
            _write(os.path.join(d, "memory.force_empty"), "0")
        elif os.path.exists(os.path.join(d, "memory.reclaim")):  # v2 (Linux >= 5.19): how much to reclaim
            with open(os.path.join(d, "memory.current")) as f:
                current = int(f.read())
            if current:
                _write(os.path.join(d, "memory.reclaim"), str(current))
    except OSError:  # gone already (fine), or less reclaimed than asked (EAGAIN): remove it anyway
        pass
    return True


def _namespace() -> int:
    """This process's pid namespace: pools are named by it, since only there does a pid say who is alive."""
    return os.stat("/proc/self/ns/pid").st_ino


def _sweep(parent: str) -> None:
    """Remove the pool folders of trainers that are gone (a crash leaves them: empty cgroups cost little,
    but they should not pile up): those of this pid namespace whose pid is not alive. Another pool may
    sweep the same folders at once: gone is fine."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    mine = f"{PREFIX}{_namespace()}-"
    for n in names:
        pid = n[len(mine):].split("-")[0] if n.startswith(mine) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            d = os.path.join(parent, n)
            try:
                remove([os.path.join(d, child) for child in os.listdir(d) if os.path.isdir(os.path.join(d, child))])
            except OSError:
                pass
            remove([d])


def _rmdir(d: str) -> bool:
    """Whether `d` is gone (a folder still holding a process, EBUSY, is not)."""
    try:
        os.rmdir(d)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:  # cgroupfs refuses at the write's flush, where the error names no file
        raise OSError(e.errno, e.strerror, path) from None
