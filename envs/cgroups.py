"""A memory and pids cgroup per sandbox call, where this machine lets the trainer make them.

rlimits bound each process of a call; a cgroup bounds the call: every process it starts, its tmpfs pages,
memfds and SysV shared memory count against one memory limit (no swap), and against one process count.
The trainer makes a folder per pool (`grpo-sandbox-<pid>-<random>`) under its own cgroup and, per worker,
a folder `call-<uid>` with the limits written; the worker joins it (writes 0 to cgroup.procs) before it
runs anything, so everything the code starts is inside. The folder is removed once its worker is reaped.

Where the cgroups live: cgroup v1's memory and pids hierarchies where they are mounted and writable (as
root in most containers), else cgroup v2 where the trainer's cgroup lets its children have the memory
and pids controllers (a delegated cgroup: v2 gives controllers to children only of a cgroup holding no
process, so the trainer must sit in a leaf below the one that delegates them). Neither: no cgroup per
call, and the sandbox's start line says why (not a missing layer: most unprivileged machines have none).
"""
import os
import random
import time

# per controller and version: the files that hold the limits, in the order they must be written
# (v1 accepts memsw only at or above the memory limit, so memory first; no file for swap means no swap)
FILES = {("memory", 1): ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"],
         ("memory", 2): ["memory.max", "memory.swap.max"], ("pids", 1): ["pids.max"], ("pids", 2): ["pids.max"]}
PREFIX = "grpo-sandbox-"


def where(proc: str = "/proc/self") -> tuple[dict[str, tuple[str, int]], str]:
    """The trainer's own cgroup folder per controller: {"memory": (folder, version), "pids": ...}, for
    both controllers or for neither; and, for neither, why. `proc` is read for /proc/self (tests fake it)."""
    from grpo.envs.sandbox import unescape  # mountinfo's octal escapes (sandbox imports this module)
    mine = {}  # controller ("" for v2) -> this process's cgroup path
    for line in open(f"{proc}/cgroup"):
        _, controllers, path = line.rstrip("\n").split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            mine[c] = path
    mounts = {}  # controller ("" for v2) -> (mount point, the cgroup path mounted there)
    for line in open(f"{proc}/mountinfo"):
        fields = line.split()
        tail = fields[fields.index("-") + 1:]
        if tail[0] == "cgroup":
            for c in set(tail[2].split(",")) & {"memory", "pids"}:
                mounts.setdefault(c, (unescape(fields[4]), unescape(fields[3])))
        elif tail[0] == "cgroup2":
            mounts.setdefault("", (unescape(fields[4]), unescape(fields[3])))

    def folder(c: str) -> str | None:  # this process's cgroup as a folder, if its hierarchy is mounted
        if c not in mounts or c not in mine:
            return None
        point, root = mounts[c]
        rel = os.path.relpath(mine[c], root)
        return None if rel.startswith("..") else os.path.normpath(os.path.join(point, rel))

    v1 = {c: folder(c) for c in ("memory", "pids")}
    if all(v1.values()):
        if all(os.access(d, os.W_OK) for d in v1.values()):
            return {c: (d, 1) for c, d in v1.items()}, ""
        return {}, f"cgroup v1's memory and pids folders are not writable here ({v1['memory']})"
    v2 = folder("")
    if v2 is None:
        return {}, "neither cgroup v1's memory and pids nor cgroup v2 is mounted for this process"
    try:
        controllers = open(os.path.join(v2, "cgroup.controllers")).read().split()
    except OSError as e:
        return {}, f"cgroup v2 at {v2}: {e.strerror}"
    if not {"memory", "pids"} <= set(controllers):
        return {}, f"cgroup v2 at {v2} is not given the memory and pids controllers ({' '.join(controllers)})"
    if not os.access(v2, os.W_OK):
        return {}, f"cgroup v2 at {v2} is not delegated to this user"
    return {"memory": (v2, 2), "pids": (v2, 2)}, ""


def make_pool(roots: dict[str, tuple[str, int]]) -> tuple[dict[str, tuple[str, int]], str]:
    """A folder per controller for one pool's calls, under the trainer's own cgroup, and "" ; or {} and
    why not. Leftovers of a trainer that died (its pid gone) are removed first, where empty."""
    for parent, _ in set(roots.values()):
        _sweep(parent)
    tag = f"{PREFIX}{os.getpid()}-{random.randrange(1 << 32):08x}"
    pool = {}
    try:
        for c, (parent, version) in roots.items():
            d = os.path.join(parent, tag)
            if not os.path.isdir(d):  # v2: one folder holds both controllers
                os.mkdir(d)
            pool[c] = (d, version)
            if version == 2:  # v2: a child has a controller only if its parent hands it down
                _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
                _write(os.path.join(d, "cgroup.subtree_control"), "+memory +pids")
    except OSError as e:
        remove(pool)
        why = " (it holds processes: v2 delegates to the children of a cgroup with none)" \
            if e.errno == 16 else ""  # EBUSY
        return {}, f"cannot make a cgroup for the calls: {e.strerror}: {e.filename}{why}"
    return pool, ""


def make_call(pool: dict[str, tuple[str, int]], name: str, memory: int, pids: int) -> list[str]:
    """One call's folders (one on v2, one per controller on v1) with `memory` bytes (no swap) and `pids`
    processes written: the folders whose cgroup.procs its worker writes itself into."""
    made = {}
    for c, (parent, version) in pool.items():
        d = os.path.join(parent, name)
        if d not in made:
            os.makedirs(d, exist_ok=True)  # it exists if its last worker's was still busy when reaped
            made[d] = version
        value = {"memory": memory, "pids": pids}[c]
        for i, file in enumerate(FILES[c, version]):
            path = os.path.join(d, file)
            if i == 0 or os.path.exists(path):  # the swap files exist only where swap accounting is on
                _write(path, str(0 if file == "memory.swap.max" else value))
    return list(made)


def remove(folders, wait: float = 0.0) -> None:
    """rmdir each folder: a call's list, or a pool's dict. A cgroup folder goes by rmdir once no process
    is in it; a killed process leaves it a few ms after its parent reaped it, so this retries for up to
    `wait` seconds; one still busy then stays for the next pool's sweep."""
    deadline = time.monotonic() + wait
    for d in dict.fromkeys(d for d, _ in folders.values()) if isinstance(folders, dict) else folders:
        while not _rmdir(d) and time.monotonic() < deadline:
            time.sleep(0.01)


def _sweep(parent: str) -> None:
    """Remove the pool folders of trainers that are gone (a crash leaves them: empty cgroups cost little,
    but they should not pile up)."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return
    for n in names:
        pid = n[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            d = os.path.join(parent, n)
            for child in os.listdir(d):
                if os.path.isdir(os.path.join(d, child)):
                    _rmdir(os.path.join(d, child))
            _rmdir(d)


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
    with open(path, "w") as f:
        f.write(text)
