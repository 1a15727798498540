"""Real DCP saves on CPU over gloo, 2 ranks: DDP state via dcp.save, FSDP2 (fully_shard, DTensor)
via dcp.save, and dcp.async_save. Run by tests/unit/test_dcp_saves.py under torchrun."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

out = sys.argv[1]
dist.init_process_group("gloo")
torch.manual_seed(0)



def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))



def train(m: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(2):
        m(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return opt, sched


# DDP
ddp = torch.nn.parallel.DistributedDataParallel(model())
opt, sched = train(ddp)
msd, osd = get_state_dict(ddp, opt)
dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict(), "step": 2, "rng": torch.get_rng_state(),
          "extra": {"epoch": 1, "name": "x", "lr": 0.1}}, checkpoint_id=f"{out}/ddp")
# FSDP2
m = model()
for layer in m:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(m)
opt, sched = train(m)
msd, osd = get_state_dict(m, opt)
dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=f"{out}/fsdp2")
# the same FSDP2 state as one process would write it (world size 1): whole tensors, no shards; and
# a copy with one element of one parameter's exp_avg changed
full = StateDictOptions(full_state_dict=True, cpu_offload=True)
msd_full, osd_full = get_state_dict(m, opt, options=full)
if dist.get_rank() == 0:
    dcp.save({"model": msd_full, "optim": osd_full, "step": 2}, checkpoint_id=f"{out}/fsdp2_whole", no_dist=True)
    osd_full["state"]["2.weight"]["exp_avg"][1, 3] += 1e-3
    dcp.save({"model": msd_full, "optim": osd_full, "step": 2}, checkpoint_id=f"{out}/fsdp2_whole_moved", no_dist=True)
dist.barrier()
# async_save (FSDP2 state)
fut = dcp.async_save({"model": msd, "optim": osd, "step": 3}, checkpoint_id=f"{out}/async")
fut.result()
dist.barrier()
dist.destroy_process_group()
