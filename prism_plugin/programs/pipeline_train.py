"""A pipeline-parallel program (1F1B over send/recv, as Megatron-core schedules it) on plain torch.distributed.

It knows nothing of prism: run it for real (``torchrun --nproc-per-node 2 -m
prism_plugin.programs.pipeline_train``) or emulated (``prism run --world-size 64 --real-ranks 0 -m
prism_plugin.programs.pipeline_train --dp 32``). Layout: Megatron's dense grid with tp=1, so rank =
dp_index + dp * stage and stage s talks to ranks +-dp. Each stage is a linear + tanh block trained with real
autograd on micro-batches; ``--fwd-ms`` / ``--bwd-ms`` add a sleep per micro-batch and stage, standing for
heavier layers with compute time that a 2-core machine keeps steady. Gradients are summed over the
data-parallel group before the SGD step (which ends the iteration). Each step prints its time.

Schedule (`forward_backward_pipelining_without_interleaving`): warm-up of ``pp - stage - 1`` forward passes,
a steady phase of one forward and one backward (the paired transfers ``send_forward_recv_backward`` and
``send_backward_recv_forward`` issued together with ``batch_isend_irecv``, then waited), a cool-down of the
remaining backward passes.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def _per_stage(text: str, pp: int, name: str) -> list[float]:
    values = [float(v) for v in text.split(",")]
    if len(values) == 1:
        values *= pp
    if len(values) != pp:
        raise SystemExit(f"{name}: give one value or one per stage ({pp}), got {text!r}")
    return values


class Stage:
    """One pipeline stage of one data-parallel replica and its point-to-point transfers."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.dp = args.dp
        self.pp = world // args.dp
        self.stage = rank // self.dp
        self.first, self.last = self.stage == 0, self.stage == self.pp - 1
        self.prev, self.next = rank - self.dp, rank + self.dp
        self.shape = (args.batch, args.hidden)
        self.fwd_s = _per_stage(args.fwd_ms, self.pp, "--fwd-ms")[self.stage] / 1e3
        self.bwd_s = _per_stage(args.bwd_ms, self.pp, "--bwd-ms")[self.stage] / 1e3
        torch.manual_seed(100 + self.stage)
        self.weight = torch.nn.Parameter(torch.randn(args.hidden, args.hidden) / args.hidden**0.5)
        self.data = torch.Generator().manual_seed(7 + rank % self.dp)

    # -- transfers (Megatron's p2p_communication names) ---------------------------------------
    def recv_forward(self) -> torch.Tensor | None:
        if self.first:
            return None
        x = torch.empty(self.shape)
        dist.recv(x, self.prev)
        return x

    def send_forward(self, y: torch.Tensor) -> None:
        if not self.last:
            dist.send(y, self.next)

    def recv_backward(self) -> torch.Tensor | None:
        if self.last:
            return None
        g = torch.empty(self.shape)
        dist.recv(g, self.next)
        return g

    def send_backward(self, g: torch.Tensor | None) -> None:
        if not self.first:
            dist.send(g, self.prev)

    def _exchange(self, out: torch.Tensor, peer: int) -> torch.Tensor:
        got = torch.empty(self.shape)
        ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, got, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return got

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        return None if self.last else self._exchange(y, self.next)

    def send_backward_recv_forward(self, g: torch.Tensor | None) -> torch.Tensor | None:
        return None if self.first else self._exchange(g, self.prev)

    # -- compute ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x is None:
            x = torch.randn(self.shape, generator=self.data)
        x = x.detach().requires_grad_(not self.first)
        y = torch.tanh(x @ self.weight)
        if self.last:
            y = torch.nn.functional.mse_loss(y, torch.randn(self.shape, generator=self.data))
        time.sleep(self.fwd_s)
        return x, y, y.detach()

    def backward(self, x: torch.Tensor, y: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor | None:
        y.backward(g)
        time.sleep(self.bwd_s)
        return None if self.first else x.grad

    def train_step(self, num_microbatches: int) -> None:
        """One iteration of 1F1B: warm-up, steady 1F1B, cool-down."""
        warmup = min(self.pp - self.stage - 1, num_microbatches)
        remaining = num_microbatches - warmup
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(warmup):  # warm-up: forward passes only
            x, y, out = self.forward(self.recv_forward())
            self.send_forward(out)
            saved.append((x, y))
        x_in = self.recv_forward() if remaining else None
        for i in range(remaining):  # steady state: one forward, one backward
            x, y, out = self.forward(x_in)
            saved.append((x, y))
            g = self.send_forward_recv_backward(out)
            x, y = saved.pop(0)
            dx = self.backward(x, y, g)
            if i == remaining - 1:
                self.send_backward(dx)
            else:
                x_in = self.send_backward_recv_forward(dx)
        for _ in range(warmup):  # cool-down: backward passes only
            x, y = saved.pop(0)
            self.send_backward(self.backward(x, y, self.recv_backward()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size (pp = world size / dp)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--fwd-ms", default="2", help="sleep per forward pass, one value or one per stage")
    ap.add_argument("--bwd-ms", default="4", help="sleep per backward pass, one value or one per stage")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--init-method", default=None,
                    help="rendezvous of a plain run, e.g. file:///tmp/store (default env://; prism ignores it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.init_method:
        dist.init_process_group("gloo", init_method=args.init_method, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"world size {world} is not divisible by --dp {args.dp}")
    stage = Stage(args, rank, world)
    dp_group = None
    for s in range(stage.pp):  # every rank creates every group, as torch requires
        g = dist.new_group(list(range(s * args.dp, (s + 1) * args.dp)))
        if s == stage.stage:
            dp_group = g
    opt = torch.optim.SGD([stage.weight], lr=0.01)
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        stage.train_step(args.microbatches)
        if args.dp > 1:
            dist.all_reduce(stage.weight.grad, group=dp_group)
        opt.step()
        print(f"[rank {rank}] step {step} stage {stage.stage} step_time_ms {1e3 * (time.perf_counter() - t0):.3f}",
              flush=True)
    dist.barrier()
    dist.destroy_process_group() if os.environ.get("PRISM_CONFIG") is None else None


if __name__ == "__main__":
    main()
