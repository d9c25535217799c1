"""PyTorch reference for the ckptd benchmark: the training-loop stall of
torch.distributed.checkpoint.async_save for a state of the given size (fp32 tensors shaped
like an optimizer shard: weights and two moments). Prints one JSON line. Exits 3 with a
message when torch is missing, so the caller can report the comparison as skipped.

    python3 ops/bench/dcp_async_save.py --bytes 40000000 --out /tmp/dcp --repeats 5
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
    except ImportError as missing:
        print(f"skipped: {missing}", file=sys.stderr)
        sys.exit(3)

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    elements = args.bytes // 4 // 3
    state = {
        "params": torch.randn(elements),
        "exp_avg": torch.randn(elements),
        "exp_avg_sq": torch.rand(elements),
    }
    out = args.out or tempfile.mkdtemp(prefix="dcp-")
    stalls = []
    pending = None
    for i in range(args.repeats):
        # Like a training loop: the state changes between saves.
        state["params"].add_(1e-3)
        if pending is not None:
            pending.result()
        started = time.perf_counter()
        pending = dcp.async_save(state, checkpoint_id=os.path.join(out, f"step{i}"))
        stalls.append(time.perf_counter() - started)
    pending.result()
    dist.destroy_process_group()
    print(json.dumps({
        "bytes": elements * 12,
        "stall_ms_median": statistics.median(stalls) * 1e3,
        "stall_ms_max": max(stalls) * 1e3,
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
