#!/usr/bin/env python3
"""The peer of fsdp_strategies_bench: the same GPT-2-shaped model trained by PyTorch FSDP2
(`fully_shard` on the embeddings, on every block and on the head, then on the root) with
torch.optim.Muon on the blocks' 2-D matrices and AdamW on everything else.

    torchrun --standalone --nproc_per_node=2 bench/peers/fsdp2_muon.py --layers 4 --width 256

Shapes, names and groups are those of bench/strategies_model.cpp (GPT-2: ln_1, attn.c_attn
3d x d, attn.c_proj, ln_2, mlp.c_fc 4d x d, mlp.c_proj d x 4d with biases; learned positions;
an untied head, so that each group is used once per forward). Runs on the CPU with Gloo, or on
one GPU per rank with NCCL when --device cuda.

What it prints (rank 0), one line the benchmark parses:
  peer: name=fsdp2_muon world=W step_ms=<max over ranks of the mean step> ...
        peak_unsharded_bytes=<max over ranks> peak_staging_bytes=... model_bytes=...
step_ms: wall time of zero_grad + forward + backward + AdamW.step + Muon.step, every rank
  entering each step together (a barrier before, not timed), the median over --steps after
  --warmup, the slowest rank's (as the benchmark times its own steps).
peak_unsharded_bytes: the most bytes of unsharded parameter storage (FSDP2's all-gather
  outputs that back the unsharded parameters, counted by their storage, which FSDP2 frees by
  resizing it to 0) plus unsharded gradients (the unsharded parameters' .grad before FSDP2
  reduce-scatters and drops them) held at once by a rank. Sampled by wrapping FSDP2's own
  FSDPParamGroup.wait_for_unshard (after it: a group's parameters are unsharded), post_backward
  (on entry: the group's full gradients exist; on exit) and reshard: the moments the count
  changes. This is the quantity the library's unsharded_bytes() counts (model weights + full
  gradients), so the two are compared directly; activations are not in either.
peak_staging_bytes: FSDP2's flat communication buffers alive at the same sample points (the
  all-gather output kept for copy-out overlap, the reduce-scatter input kept until the next
  reduce-scatter); reported beside, not added in.
sharded_state_bytes: what stays sharded after a step (local shards of parameters and gradients,
  the optimizers' state), the counterpart of the benchmark's column of the same name.
--shard-size N: HSDP, the mesh (W / N, N) with dims ("replicate", "shard") (rank = replica * N +
  shard rank, as the library's DeviceMesh; N = W is the 1-D mesh): fully_shard shards over
  "shard", reduce-scatters there and all-reduces over "replicate". torch.optim.Muon takes the
  DTensors as they are and runs Newton-Schulz on them through DTensor's sharding propagation
  (collectives inside the matmuls and the norm, over both mesh dims); the run checks the HSDP
  placements and, after training, that every replica holds the same bits of every parameter and
  momentum, and fails otherwise. The line then carries mesh=<replicas>x<shard size>.
On CUDA it also prints cuda_peak_allocated_bytes, the caching allocator's peak over the timed
steps (everything: parameters, gradients, activations, optimizer states).
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--adamw-lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: as launched)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="FSDP2's ZeRO-2-like mode (parameters stay unsharded after forward)")
    p.add_argument("--shard-size", type=int, default=0,
                   help="HSDP: shard over this many ranks, replicate over world / shard-size "
                        "(0: every rank)")
    a = p.parse_args()
    if a.shard_size < 0:
        p.error(f"--shard-size must be >= 1 (or 0: every rank), got {a.shard_size}")
    if a.width % a.heads:
        p.error(f"--width ({a.width}) must be a multiple of --heads ({a.heads})")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return a


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        split = lambda z: z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embeddings(nn.Module):
    def __init__(self, vocab, seq_len, d):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq_len, d)

    def forward(self, tokens):
        pos = torch.arange(tokens.size(1), device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)


class Head(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class Gpt2(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embeddings = Embeddings(a.vocab, a.seq_len, a.width)
        self.h = nn.ModuleList(Block(a.width, a.heads) for _ in range(a.layers))
        self.head = Head(a.vocab, a.width)

    def forward(self, tokens):
        x = self.embeddings(tokens)
        for block in self.h:
            x = block(x)
        return self.head(x)


class UnshardedBytes:
    """Bytes of unsharded parameters + gradients (and, apart, staging buffers) FSDP2 holds,
    sampled where they change (see the module docstring)."""

    def __init__(self, groups):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        self.groups = groups
        self.peak = 0
        self.peak_staging = 0
        self.active = False
        tracker = self

        def wrap(name, before, after):
            original = getattr(pg.FSDPParamGroup, name)

            def wrapped(self_group, *args, **kwargs):
                if before:
                    tracker.sample()
                out = original(self_group, *args, **kwargs)
                if after:
                    tracker.sample()
                return out

            setattr(pg.FSDPParamGroup, name, wrapped)

        wrap("wait_for_unshard", False, True)
        wrap("post_backward", True, True)
        wrap("reshard", False, True)

    @staticmethod
    def _storage_bytes(t):
        return t.untyped_storage().nbytes() if t is not None else 0

    def current(self):
        held = staging = 0
        seen = set()
        for g in self.groups:
            for fp in g.fsdp_params:
                for out in fp.all_gather_outputs:
                    held += self._storage_bytes(out)
                up = getattr(fp, "_unsharded_param", None)
                if up is not None and up.grad is not None:
                    held += up.grad.untyped_storage().nbytes()
                if fp.unsharded_accumulated_grad is not None:
                    held += fp.unsharded_accumulated_grad.untyped_storage().nbytes()
            ctx = g.comm_ctx
            if id(ctx) in seen:
                continue
            seen.add(id(ctx))
            if getattr(ctx, "all_gather_state", None) is not None:
                staging += self._storage_bytes(ctx.all_gather_state.all_gather_result.all_gather_output)
            if getattr(ctx, "reduce_scatter_state", None) is not None:
                staging += self._storage_bytes(ctx.reduce_scatter_state.reduce_scatter_input)
        for g in self.groups:
            if g._all_gather_result is not None:
                staging += self._storage_bytes(g._all_gather_result.all_gather_output)
        return held, staging

    def sample(self):
        if not self.active:
            return
        held, staging = self.current()
        self.peak = max(self.peak, held)
        self.peak_staging = max(self.peak_staging, staging)


def make_mesh(init_device_mesh, device, world, shard_size):
    """FSDP2's mesh: 1-D over every rank, or for HSDP (replicas, shard_size) with dims
    ("replicate", "shard"), rank = replica * shard_size + shard rank, as the library's
    DeviceMesh. shard_size == world is the 1-D mesh, as make_device_mesh makes it."""
    if shard_size == 0 or shard_size == world:
        return init_device_mesh(device.type, (world,))
    if world % shard_size:
        raise SystemExit(f"fsdp2_muon.py: --shard-size {shard_size} does not divide the world "
                         f"size {world}; give a divisor of {world}, or 0 for every rank")
    return init_device_mesh(device.type, (world // shard_size, shard_size),
                            mesh_dim_names=("replicate", "shard"))


def check_hsdp(model, mesh, muon_params, muon):
    """Under HSDP: every parameter replicated over "replicate" and sharded over "shard"
    (FSDP2's HSDP placements), and after training every replica holds the same bits of every
    parameter and Muon momentum. torch.optim.Muon (torch/optim/_muon.py) runs its
    Newton-Schulz on the DTensors themselves: DTensor's sharding propagation turns the
    matmuls and the norm into collectives over both mesh dims (Partial sums reduced by two
    sequential all-reduces), which computes the full matrices' iteration but could let the
    replicas drift apart; that would be a silent error, so it is an error here."""
    from torch.distributed.tensor import Replicate, Shard

    want = (Replicate(), Shard(0))
    for name, p in model.named_parameters():
        if tuple(p.placements) != want:
            raise SystemExit(f"fsdp2_muon.py: parameter {name} has placements {p.placements} on "
                             f"mesh {mesh}, expected {want} (FSDP2 HSDP)")
    group = mesh.get_group("replicate")
    tensors = [p.to_local() for p in model.parameters()]
    tensors += [muon.state[p]["momentum_buffer"].to_local() for p in muon_params
                if "momentum_buffer" in muon.state[p]]
    spread = torch.zeros(2, dtype=torch.float64, device=tensors[0].device)  # [differ, largest]
    for t in tensors:
        t = t.detach().reshape(-1).float().clone()
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(lo, hi):
            spread[0] = 1
            spread[1] = max(spread[1].item(), (hi - lo).abs().max().item())
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)  # every rank decides alike
    if spread[0].item():
        raise SystemExit("fsdp2_muon.py: the replicas of an HSDP mesh hold different bits "
                         f"after training (largest spread {spread[1].item():.3e}); "
                         "torch.optim.Muon on these DTensors is not replica-consistent")


def main():
    a = parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if a.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(init_device_mesh, device, world, a.shard_size)
    replicas = world // a.shard_size if a.shard_size > 0 else 1

    torch.manual_seed(1)
    model = Gpt2(a).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    group_bytes = [sum(p.numel() * p.element_size() for p in m.parameters())
                   for m in [model.embeddings, *model.h, model.head]]
    reshard = not a.no_reshard_after_forward
    for m in [model.embeddings, *model.h, model.head]:
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    # fully_shard re-registered the parameters as DTensors: look them up again by name.
    by_name = dict(model.named_parameters())
    muon_params = [by_name[n] for n in by_name if n.startswith("h.") and by_name[n].ndim == 2]
    muon_ids = {id(p) for p in muon_params}
    adamw_params = [p for p in by_name.values() if id(p) not in muon_ids]
    muon = torch.optim.Muon(muon_params, lr=a.lr, weight_decay=0.0, momentum=0.95, nesterov=True,
                            adjust_lr_fn="original")
    adamw = torch.optim.AdamW(adamw_params, lr=a.adamw_lr, betas=(0.9, 0.95), weight_decay=0.0)

    groups = []
    for m in [model.embeddings, *model.h, model.head, model]:
        g = m._get_fsdp_state()._fsdp_param_group
        if g is not None:
            groups.append(g)
    tracker = UnshardedBytes(groups)
    hsdp = mesh.ndim == 2

    gen = torch.Generator().manual_seed(1000 + rank)
    times = []
    for step in range(a.warmup + a.steps):
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=gen).to(device)
        timed = step >= a.warmup
        tracker.active = timed
        if device.type == "cuda":
            torch.cuda.synchronize()
            if step == a.warmup:
                torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        t0 = time.perf_counter()
        muon.zero_grad(set_to_none=True)
        adamw.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        adamw.step()
        muon.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        tracker.sample()
        if timed:
            times.append(elapsed)

    # What stays sharded after a step: parameter and gradient shards and the optimizers' state
    # (AdamW's moments, Muon's momentum), the local pieces of the DTensors.
    seen_storages = set()

    def local_bytes(t):  # each storage once
        if not isinstance(t, torch.Tensor):
            return 0
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        if storage.data_ptr() in seen_storages or storage.nbytes() == 0:
            return 0
        seen_storages.add(storage.data_ptr())
        return storage.nbytes()

    sharded_state = sum(local_bytes(p) + local_bytes(p.grad) for p in model.parameters())
    for opt in (muon, adamw):
        for state in opt.state.values():
            sharded_state += sum(local_bytes(v) for v in state.values())

    times.sort()
    mid = len(times) // 2
    median_step = times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])
    if hsdp:
        check_hsdp(model, mesh, muon_params, muon)

    stats = torch.tensor([median_step, float(tracker.peak), float(tracker.peak_staging),
                          float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda"
                          else 0.0, float(sharded_state)], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    stats = stats.cpu().tolist()
    if rank == 0:
        fields = {
            "name": "fsdp2_muon",
            "world": world,
            "mesh": f"{replicas}x{world // replicas}",
            "replicas": replicas,
            "shard_size": world // replicas,
            "device": device.type,
            "layers": a.layers,
            "width": a.width,
            "vocab": a.vocab,
            "seq_len": a.seq_len,
            "batch": a.batch,
            "params": n_params,
            "model_bytes": model_bytes,
            "largest_group_bytes": max(group_bytes),
            "step_ms": f"{stats[0] * 1e3:.3f}",
            "peak_unsharded_bytes": int(stats[1]),
            "peak_staging_bytes": int(stats[2]),
            "sharded_state_bytes": int(stats[4]),
            "final_loss": f"{loss.item():.6f}",
        }
        if device.type == "cuda":
            fields["cuda_peak_allocated_bytes"] = int(stats[3])
        print("peer: " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Without the interpreter's teardown: at W=4 on Gloo it sometimes ended in "terminate called
    # without an active exception" (a c10d thread destroyed while joinable) after the results.
    os._exit(status)
