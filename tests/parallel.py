"""Independent child processes of one test, started together. A child that runs one thread (the
tests' OMP_NUM_THREADS=1 runs, a Triton interpreter, a command that mostly imports torch) leaves the
second core of a 2-core machine idle while the test waits on it; two such children at once take the
time of one. Only for children that share nothing (folders, ports, files) and whose checks do not
depend on their timing."""
from concurrent.futures import ThreadPoolExecutor


def at_once(*calls):
    """Each zero-argument callable in a thread of its own, all started together -> their results, in
    order; the first exception, if any, raised once all have ended."""
    with ThreadPoolExecutor(max(1, len(calls))) as pool:
        futures = [pool.submit(call) for call in calls]
    return [f.result() for f in futures]
