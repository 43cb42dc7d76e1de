"""Whole DDP training steps with FastML on one CUDA rank under torch.cuda.set_sync_debug_mode("error"):
any implicit host synchronisation on the hot path (``.item()``, ``bool(t)``, a
blocking device-to-host copy, ``nonzero``) raises. The hook's one read per step goes through
``fastml_strategy.comm._status.host`` (a pinned non-blocking copy and an event wait, which the debug mode does not
flag); this job counts those reads per step as well.

    python sync_free_job.py OUT_DIR [backend]      # backend: nccl (default) or gloo

Writes OUT_DIR/sync_free.json: per plan, the host reads of each checked step, ms per step, and
whether the parameters stayed finite.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WARMUP, STEPS = 3, 8


def _plan(name):
    # the plans of tests/test_host_reads.py (one definition of "mixed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from test_host_reads import _plan as plan

    return plan(name)


def run(plan: str, dev: torch.device) -> dict:
    import fastml_strategy as fm
    from fastml_strategy.comm import collective

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 10)).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=8)  # several buckets
    state = fm.register_hook(ddp, plan=_plan(plan), layer_stats_every=4)  # stats steps included
    state._engine.piece_numel = 1 << 20  # several pieces per bucket
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator(device=dev).manual_seed(1)
    xs = [torch.randn(64, 512, device=dev, generator=gen) for _ in range(WARMUP + STEPS)]
    ys = [torch.randint(0, 10, (64,), device=dev, generator=gen) for _ in range(WARMUP + STEPS)]
    reads = []
    torch.cuda.synchronize()
    t0 = None
    for i in range(WARMUP + STEPS):
        if i == WARMUP:  # after the first steps (Triton compiles, DDP rebuilds its buckets)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            t0 = time.perf_counter()
        before = collective.host_reads()
        loss = torch.nn.functional.cross_entropy(ddp(xs[i]), ys[i])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= WARMUP:
            reads.append(collective.host_reads() - before)
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / STEPS
    finite = bool(torch.isfinite(torch.cat([p.detach().reshape(-1) for p in model.parameters()])).all())
    stats = state.stats()
    state.close()
    return {"reads": reads, "ms_per_step": ms, "finite": finite, "steps": stats["steps"],
            "nonfinite_steps": stats["nonfinite_steps"], "buckets": len(state._engine.layouts)}


def main() -> None:
    out = Path(sys.argv[1])
    backend = sys.argv[2] if len(sys.argv) > 2 else "nccl"
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # run by hand or by benchmarks/gpu_check.sh
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group(backend)
    results = {}
    for plan in ("int4", "topk1", "mixed"):
        try:
            results[plan] = run(plan, dev)
        except Exception as e:  # noqa: BLE001 - reported per plan: which one synchronised, and where
            import traceback

            torch.cuda.set_sync_debug_mode(0)
            results[plan] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        print(plan, json.dumps(results[plan])[:3000], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_free.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
