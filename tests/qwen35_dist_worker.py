"""tests/dist_worker.py's check_fsdp on a Qwen3.5 hybrid checkpoint, under torchrun (2 gloo ranks):
    python -m torch.distributed.run --nproc_per_node=2 tests/qwen35_dist_worker.py MODEL_DIR EXPORT_DIR"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from dist_worker import check_fsdp  # noqa: E402

if __name__ == "__main__":
    check_fsdp(sys.argv[1], sys.argv[2])
