"""Progress bars for long work (a sampler call, an update): tqdm's, or none where tqdm is not installed
(a bare GPU box: bench/gpu_check.py needs torch and triton only). The callers show one on rank 0 only."""
import time
from typing import Callable


def bar(total: int, desc: str, unit: str, mininterval: float = 0.1):
    """A tqdm bar that leaves nothing behind when done, or None without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, leave=False, mininterval=mininterval)


class Progress:
    """Rows finished (tqdm: rate and ETA) and, every 2 s, the tokens decoded and tokens/s: in one
    call all rows decode together and finish near its end, so the row count alone barely moves."""
    def __init__(self, total: int, enabled: bool, desc: str = "sampling", unit: str = "seq"):
        self.bar = bar(total, desc, unit) if enabled else None
        self.t0 = self.shown = time.time()

    def update(self, k: int):
        if self.bar is not None:
            self.bar.update(k)

    def tokens(self, count: Callable[[], int]):
        now = time.time()
        if self.bar is not None and now - self.shown >= 2.0:
            n, self.shown = count(), now
            self.bar.set_postfix_str(f"{n} tok, {n / max(now - self.t0, 1e-9):.0f} tok/s")

    def close(self):
        if self.bar is not None:
            self.bar.close()
