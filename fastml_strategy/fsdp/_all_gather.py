"""The quantized parameter all-gather (``register(all_gather_bits=...)``; ZeRO++'s "qwZ"), the third
hop FastML can take over from FSDP2: its layout is :func:`fastml_strategy.wire.all_gather_wire`."""

# No `from __future__ import annotations`: torch's AllGather is an ABC with annotated signatures.

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy.fsdp._units import _Unit
from fastml_strategy.wire.all_gather import all_gather_config, all_gather_wire


class _AllGatherCounter:
    """Statistics of the quantized parameter all-gather (the third hop FastML can take over)."""

    def __init__(self, bits: int, world_size: int) -> None:
        self.bits = bits
        self.cfg = all_gather_config(bits)  # (stats()["all_gather"]["codec"])
        self.world_size = world_size
        self.bytes_sent = 0
        self.bytes_uncompressed = 0.0

    def residual_nbytes(self) -> int:
        return 0


def _quantized_all_gather(state: "FSDPState", unit: _Unit, output: torch.Tensor, inp: torch.Tensor,
                          group) -> None:
    """ZeRO++ "qwZ": every rank quantizes its parameter shard (per parameter, max-min blocks, round
    to nearest), one all_gather of the bytes, and every rank (the owner too) decodes all W shards, so
    every rank computes with the same unsharded parameters. The sharded parameters the optimizer
    updates stay exact; only the copies used in forward and backward are quantized."""
    ag = state._ag
    W, n = group.size(), inp.numel()
    # the message: each parameter's padded shard encoded at the wire's offsets (the cost model prices
    # the same AllGatherWire)
    wire = all_gather_wire(codecs, [fp.padded_sharded_param_size.numel() for fp in unit.params], n, ag.bits, W,
                           inp.dtype)
    cfg, total = wire.config, wire.total
    segs = list(zip(wire.numels, wire.nbytes, wire.offsets))
    send = torch.empty(total, dtype=torch.uint8, device=inp.device)
    off = 0
    for k, nb, pos in segs:
        codecs.encode_chunk(inp[off: off + k], cfg, send[pos: pos + nb])
        off += k
    recv = torch.empty(W * total, dtype=torch.uint8, device=inp.device)
    work = dist.all_gather(list(recv.view(W, total).unbind(0)), send, group=group, async_op=True)
    state._channel.wait(work) if state._channel is not None and not inp.is_cuda else work.wait()
    out = output.view(W, n)
    tmp = None if output.dtype == torch.float32 else torch.empty(n, dtype=torch.float32, device=inp.device)
    for j in range(W):
        dst = out[j] if tmp is None else tmp
        off = 0
        for k, nb, pos in segs:
            codecs.decode_chunk(recv[j * total + pos: j * total + pos + nb], k, cfg, dst[off: off + k])
            off += k
        if tmp is not None:
            out[j].copy_(tmp)
    ag.bytes_sent += wire.bytes_sent()
    ag.bytes_uncompressed += wire.bytes_uncompressed()


def _make_all_gather(AllGather, state: "FSDPState", unit: _Unit, quantized: bool = True):
    class _FastMLAllGather(AllGather):
        """FSDP's parameter all-gather of one unit, quantized (opt-in: register(all_gather_bits=8)),
        or (HSDP) FSDP's own, waited for through the failure channel."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if not quantized or not input_tensor.is_floating_point():
                # FSDP's own all-gather (parameters of mixed dtypes travel as bytes)
                return state._plain_all_gather(unit, output_tensor, input_tensor, group, async_op)
            try:
                _quantized_all_gather(state, unit, output_tensor, input_tensor, group)
            except BaseException as e:  # noqa: BLE001
                raise state._fail(e, "quantized parameter all-gather", unit)  # noqa: B904 - the cause is set
            return None

    return _FastMLAllGather()
