"""One rank of the DDP test (tests/test_multi_gpu.py): a small model with cupyln.torch's norms
under DistributedDataParallel (NCCL), one training step on this rank's shard of a fixed batch;
rank 0 saves the parameters' gradients. Run: python ddp_worker.py RANK WORLD PORT OUT."""

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cupyln.torch as ct  # noqa: E402


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), ct.LayerNorm(256, deterministic=True),
                               torch.nn.GELU(), torch.nn.Linear(256, 256),
                               ct.RMSNorm(256, deterministic=True))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)


def main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    net = torch.nn.parallel.DistributedDataParallel(model().cuda(rank), device_ids=[rank])
    x, target = (t.chunk(world)[rank].cuda(rank) for t in batch())
    torch.nn.functional.mse_loss(net(x), target).backward()
    if rank == 0:
        torch.save({n: p.grad.cpu() for n, p in net.module.named_parameters()}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
