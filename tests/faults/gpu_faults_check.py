"""GPU check of the fault paths (not collected by pytest; run on a CUDA machine, one GPU):

    torchrun --nproc_per_node 1 tests/faults/gpu_faults_check.py

On CUDA/NCCL, one rank: a NaN in one step's gradient is skipped by GradScaler with every residual
unchanged and training resumes; an exception inside compression surfaces from backward as
CompressionError (raised by the hook after the CUDA comm stream); the Triton encoder marks a block
whose range exceeds fp32 non-finite, bit-exactly like the reference.
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fastml_strategy as fm
import fastml_strategy.codecs as codecs
from fastml_strategy import kernels
from fastml_strategy.kernels import quantize_reference


def main() -> int:
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ok = True

    # 1. Triton: range beyond fp32 -> non-finite block, same bytes as the reference.
    x = torch.cat([torch.tensor([-3e38, 3e38, 1e38, 0.0] + [1.0] * 60), torch.randn(64)])
    for bits in (1, 4, 8):
        r = torch.randn(128) * 1e-3
        r_dev = r.to(dev)
        p, m = kernels.quantize(x.to(dev), bits, 64, residual=r_dev, backend="triton")
        r_ref = r.clone()
        pr, mr = quantize_reference(x, bits, 64, residual=r_ref)
        same = torch.equal(p.cpu(), pr) and torch.equal(m.cpu().nan_to_num(7), mr.nan_to_num(7)) \
            and torch.equal(r_dev.cpu(), r_ref)
        y = kernels.dequantize(p, m, 128, bits, 64, backend="triton").cpu()
        good = same and bool(torch.isnan(y[:64]).all()) and bool(torch.isfinite(y[64:]).all())
        print(f"triton int{bits} wide block: {'ok' if good else 'FAIL'}", flush=True)
        ok &= good

    # 2. The hook on CUDA: a non-finite step is skipped with residuals unchanged.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.1)
    state = fm.register_hook(ddp, plan="int4")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda", init_scale=256.0)
    poison = {"on": False}
    model[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=dev), float("inf"))
                                  if poison["on"] else g)
    for step in range(6):
        poison["on"] = step == 3
        before = {k: v.clone() for k, v in state.state_dict()["residuals"].items()}
        x, y = torch.randn(32, 64, device=dev), torch.randint(0, 10, (32,), device=dev)
        scaler.scale(torch.nn.functional.cross_entropy(ddp(x), y)).backward()
        after = state.state_dict()["residuals"]
        changed = any(not torch.equal(before.get(k, torch.zeros_like(v)), v) for k, v in after.items())
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        good = (changed, finite) == ((False, False) if step == 3 else (True, True))
        print(f"hook step {step}: residuals changed={changed} grads finite={finite} "
              f"{'ok' if good else 'FAIL'}", flush=True)
        ok &= good
    good = state.stats()["nonfinite_steps"] == 1 and bool(torch.isfinite(
        torch.cat([p.detach().reshape(-1) for p in model.parameters()])).all())
    print(f"hook nonfinite_steps=1, finite params: {'ok' if good else 'FAIL'}", flush=True)
    ok &= good

    # 3. An encoder exception surfaces from backward with FastML's type.
    real = codecs.encode_chunk

    def boom(*a, **k):
        raise RuntimeError("injected")

    codecs.encode_chunk = boom
    try:
        ddp(torch.randn(8, 64, device=dev)).sum().backward()
        got = "no error"
    except fm.CompressionError as e:
        got = "CompressionError" if "injected" in str(e) else f"CompressionError without cause: {e}"
    except Exception as e:  # noqa: BLE001
        got = f"{type(e).__name__}: {e}"
    codecs.encode_chunk = real
    print(f"encoder exception -> {got}: {'ok' if got == 'CompressionError' else 'FAIL'}", flush=True)
    ok &= got == "CompressionError"
    print("ALL OK" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
