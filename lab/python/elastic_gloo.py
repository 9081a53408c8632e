"""torchrun's recovery from a lost worker, for `chorus bench recovery
--compare torchrun`: a Gloo all-reduce loop in which rank --kill-rank
SIGKILLs itself after --kill-after all-reduces of the first attempt; torchrun
(--max-restarts 1) then restarts every worker, and each prints when its first
all-reduce of the new attempt completed. Lines match chorus elastic-probe's.

usage: torchrun --standalone --nproc-per-node N --max-restarts 1 \
           elastic_gloo.py --kill-rank R --kill-after K --iterations I
"""
import argparse
import os
import signal
import time

import torch
import torch.distributed as dist


def now_us():
    return int(time.time() * 1e6)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-rank", type=int, required=True)
    parser.add_argument("--kill-after", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=150)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ones = torch.ones(1024)
    for step in range(1, args.iterations + 1):
        total = ones.clone()
        dist.all_reduce(total)
        if total[0].item() != world:
            raise SystemExit(f"rank {rank}: all_reduce gave {total[0].item()}, expected {world}")
        if attempt > 0 and step == 1:
            print(f"probe rank={rank} gen={attempt} world={world} event=restarted at_us={now_us()}", flush=True)
        if attempt == 0 and step == args.kill_after and rank == args.kill_rank:
            print(f"probe rank={rank} gen=0 event=killing at_us={now_us()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.005)
    print(f"probe rank={rank} gen={attempt} world={world} event=done iterations={args.iterations}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
