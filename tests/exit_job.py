"""One process of the interpreter-exit check (tests/test_faults.py): rank ``argv[1]`` of a gloo
group of 2 (port ``argv[2]``) runs six packed calls (``argv[3]``: the pack mode), destroys the
group and exits; the test requires exit code 0 from both ranks."""

import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if __name__ == "__main__":
    rank, port, mode, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    import dist_fault_jobs

    dist_fault_jobs.packed_exit_sequence(seed, mode)
    dist.destroy_process_group()
