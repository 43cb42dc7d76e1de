"""The compressed all-reduce of one DDP bucket: scatter-reduce-allgather for dense codecs, all_gather
for top-k, two collectives per bucket in a fixed order.

Algorithm (per bucket, on every rank; W ranks, this one ``r``)
--------------------------------------------------------------
1. Split the bucket by parameter (``BucketLayout``). Each compressed layer (fp16 / bf16 / quantize)
   is a segment of its own, encoded straight from the bucket buffer and decoded straight back into
   it (no gather or scatter copies when the buffer is fp32), cut into W chunks on quantization-block
   boundaries, so a block never mixes two layers' scales. Small tensors (under ``plan.min_numel``)
   and fp32 layers are gathered into one fp32 segment: one message part for all of them.
2. Error feedback: the quantizer reads ``grad + residual`` and writes the new residual into a second
   buffer; the two are swapped only when the result is finite. The hook commits a whole step at once:
   a NaN/inf in any bucket, which makes GradScaler skip the step, leaves every residual untouched.
   Residuals are keyed by parameter name and migrate when DDP rebuilds its buckets after the first
   iteration.
3. ``all_to_all_single``: rank j receives every rank's encoded chunk j. Each rank decodes the W copies
   of its chunk in rank order, sums them in fp32, divides by W, and re-encodes the mean.
4. ``all_gather`` of [the re-encoded mean chunk | this rank's top-k values and indices]. Every rank,
   the chunk's owner included, decodes the same bytes in the same order, so replicas stay
   bit-identical. Top-k messages are scatter-added in rank order, then divided by W.

Per-rank traffic of a dense codec is 2(W-1)/W of its encoded size, as for a ring all-reduce; a top-k
layer costs (W-1) messages, which is why :func:`fastml_strategy.codecs.effective_config` falls back to
a dense codec past the world size where that stops paying.

Every message starts with a 64-byte header. A rank whose encoder raises still takes part in the
collective with an error header, so every rank (that one included) raises the same
:class:`CompressionError`, naming the lowest failing rank, instead of hanging.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy.config import Codec, CodecConfig, Plan

__all__ = ["BucketLayout", "CompressedAllReduce", "CompressionError"]

HEADER = 64  # bytes: int32 status, int32 rank, 56 bytes of UTF-8 error text
_STATUS_OK, _STATUS_ERROR = 0, 1
_M32 = 0xFFFFFFFF


class CompressionError(RuntimeError):
    """Raised on every rank when compression or communication failed on one of them."""


def _mix(*xs: int) -> int:
    h = 0x811C9DC5
    for x in xs:
        h = ((h ^ (int(x) & _M32)) * 0x01000193) & _M32
        h ^= h >> 15
    return h


@dataclass
class _Param:
    name: str
    boff: int  # offset in the bucket buffer (elements)
    numel: int
    goff: int = 0  # offset in its group's flat vector


@dataclass
class _DenseGroup:
    """One segment of the dense message: a single parameter (read from and decoded straight into the
    bucket buffer when that is fp32), or all the bucket's fp32 parameters gathered into one vector."""

    cfg: CodecConfig
    params: list[_Param]
    length: int  # elements
    bounds: list[int]  # W + 1 chunk boundaries (elements)
    nbytes: list[int]  # encoded bytes of chunk j
    direct: bool = False  # True: operate on the bucket buffer's slice, no copy
    send_off: list[int] = field(default_factory=list)  # offset of chunk j in the all_to_all buffer
    recv_off: int = 0  # offset inside this rank's chunk message
    gather_off: list[int] = field(default_factory=list)  # offset in rank j's all_gather message
    x: torch.Tensor | None = None  # flat fp32 staging vector (not direct)
    res_cur: torch.Tensor | None = None
    res_next: torch.Tensor | None = None
    acc: torch.Tensor | None = None  # this rank's chunk sum

    @property
    def ef(self) -> bool:
        return self.cfg.codec is Codec.QUANTIZE and self.cfg.error_feedback

    @property
    def key(self) -> int:
        """A seed component that depends on the layer, not on its position in a bucket (buckets are
        rebuilt after the first iteration; stochastic rounding must not change with them)."""
        return zlib.crc32(self.params[0].name.encode())

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """The fp32 vector this segment encodes from and decodes into."""
        if self.direct:
            p = self.params[0]
            return buf[p.boff: p.boff + p.numel]
        return self.x


@dataclass
class _TopkParam:
    cfg: CodecConfig
    param: _Param
    nbytes: int
    gather_off: int = 0
    residual: torch.Tensor | None = None
    pending: torch.Tensor | None = None


class BucketLayout:
    """How one bucket's parameters map to groups, chunks and message offsets (built once per bucket
    shape; DDP's bucket rebuild after iteration 1 builds a new one)."""

    def __init__(self, names, offsets, numels, plan: Plan, world_size: int, rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.names = tuple(names)
        self.total_numel = int(sum(numels))
        W = world_size
        dense: dict[CodecConfig, list[_Param]] = {}
        self.topk: list[_TopkParam] = []
        self.configs: dict[str, CodecConfig] = {}
        for name, off, n in zip(names, offsets, numels):
            cfg = codecs.effective_config(plan.for_parameter(name, n), n, W)
            self.configs[name] = cfg
            p = _Param(name, int(off), int(n))
            if cfg.codec is Codec.TOPK:
                self.topk.append(_TopkParam(cfg, p, codecs.topk_nbytes(n, cfg)))
            else:
                key = cfg if cfg.codec is Codec.QUANTIZE else CodecConfig(codec=cfg.codec)
                dense.setdefault(key, []).append(p)
        self.dense: list[_DenseGroup] = []
        fp32_buffer = dtype == torch.float32
        segments: list[tuple[CodecConfig, list[_Param]]] = []
        for cfg, params in dense.items():
            if cfg.codec is Codec.FP32:
                segments.append((cfg, params))  # small tensors: one batched segment
            else:
                segments.extend((cfg, [p]) for p in params)  # one segment per compressed layer
        for cfg, params in segments:
            unit = cfg.block_size if cfg.codec is Codec.QUANTIZE else 16
            pos = 0
            for p in params:
                p.goff = pos
                pos += p.numel
            length = pos
            units = math.ceil(length / unit)
            bounds = [min(length, (j * units // W) * unit) for j in range(W)] + [length]
            nbytes = [codecs.dense_nbytes(bounds[j + 1] - bounds[j], cfg) for j in range(W)]
            g = _DenseGroup(cfg, params, length, bounds, nbytes, direct=fp32_buffer and len(params) == 1)
            if not g.direct:
                g.x = torch.zeros(length, dtype=torch.float32, device=device)
            g.acc = torch.empty(bounds[rank + 1] - bounds[rank], dtype=torch.float32, device=device)
            if g.ef:
                g.res_cur = torch.zeros(length, dtype=torch.float32, device=device)
                g.res_next = torch.zeros(length, dtype=torch.float32, device=device)
            self.dense.append(g)
        # all_to_all message: for destination j, [header | group 0 chunk j | group 1 chunk j | ...]
        self.split_sizes = []
        pos = 0
        for j in range(W):
            size = HEADER
            for g in self.dense:
                g.send_off.append(pos + size)
                size += g.nbytes[j]
            self.split_sizes.append(size)
            pos += size
        self.send = torch.zeros(pos, dtype=torch.uint8, device=device)
        self.my_chunk = self.split_sizes[rank]
        size = HEADER
        for g in self.dense:
            g.recv_off = size
            size += g.nbytes[rank]
        self.recv = torch.zeros(W * self.my_chunk, dtype=torch.uint8, device=device)
        # all_gather message of rank j: [header | reduced group chunks j | top-k section]
        dense_sizes = []
        for j in range(W):
            size = HEADER
            for g in self.dense:
                g.gather_off.append(size)
                size += g.nbytes[j]
            dense_sizes.append(size)
        pos = max(dense_sizes)
        for t in self.topk:
            t.gather_off = pos
            pos += t.nbytes
            t.residual = torch.zeros(t.param.numel, dtype=torch.float32, device=device)
        self.gather_size = pos
        self.gsend = torch.zeros(pos, dtype=torch.uint8, device=device)
        self.grecv = torch.zeros(W * pos, dtype=torch.uint8, device=device)
        self.topk_acc = {t.param.name: torch.empty(t.param.numel, dtype=torch.float32, device=device)
                         for t in self.topk}

    # residual views by parameter name (unpadded)
    def residual_views(self) -> dict[str, torch.Tensor]:
        out = {}
        for g in self.dense:
            if g.ef:
                for p in g.params:
                    out[p.name] = g.res_cur[p.goff: p.goff + p.numel]
        for t in self.topk:
            if t.cfg.error_feedback:
                out[t.param.name] = t.residual
        return out


class CompressedAllReduce:
    """Runs the compressed all-reduce of buckets on one process group (call from one thread only)."""

    def __init__(self, plan: Plan, group, rank: int, world_size: int) -> None:
        self.plan = plan
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.layouts: dict[tuple, BucketLayout] = {}
        # residuals loaded from a checkpoint before the layout that owns them exists
        self.pending_residuals: dict[str, torch.Tensor] = {}
        # statistics
        self.bytes_sent = 0
        self.bytes_uncompressed = 0.0
        self.layer_bytes: dict[str, int] = {}
        self.layer_error: dict[str, float] = {}
        self.layer_codec: dict[str, str] = {}

    # -- layouts and residuals ----------------------------------------------------------------------
    def layout_for(self, names, offsets, numels, device, dtype=torch.float32) -> BucketLayout:
        key = (tuple(names), tuple(offsets), tuple(numels), dtype)
        lay = self.layouts.get(key)
        if lay is not None:
            return lay
        lay = BucketLayout(names, offsets, numels, self.plan, self.world_size, self.rank, device, dtype)
        new = set(names)
        old = self.residuals()
        # Layouts sharing a parameter with the new one are stale (DDP rebuilt its buckets). Their
        # other parameters' residuals wait in pending_residuals for the layout that will own them.
        for k in [k for k, v in self.layouts.items() if new & set(v.names)]:
            for name, view in self.layouts.pop(k).residual_views().items():
                if name not in new:
                    self.pending_residuals[name] = view
        for name, view in lay.residual_views().items():
            src = self.pending_residuals.pop(name, None)
            if src is None:
                src = old.get(name)
            if src is not None:
                view.copy_(src.reshape(-1).to(view.device))
        self.layouts[key] = lay
        for name, cfg in lay.configs.items():
            self.layer_codec[name] = cfg.describe()
        return lay

    def residuals(self) -> dict[str, torch.Tensor]:
        out = dict(self.pending_residuals)
        for lay in self.layouts.values():
            out.update(lay.residual_views())
        return out

    def load_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        live: dict[str, torch.Tensor] = {}
        for lay in self.layouts.values():
            live.update(lay.residual_views())
        for name, t in residuals.items():
            if name in live:
                live[name].copy_(t.reshape(-1).to(live[name].device))
            else:
                self.pending_residuals[name] = t.detach().reshape(-1).clone()

    # -- collectives (run at world size 1 too: one code path everywhere) ------------------------------
    def _all_to_all(self, lay: BucketLayout) -> None:
        dist.all_to_all_single(lay.recv, lay.send, output_split_sizes=[lay.my_chunk] * self.world_size,
                               input_split_sizes=lay.split_sizes, group=self.group)
        self.bytes_sent += sum(lay.split_sizes) - lay.split_sizes[self.rank]

    def _all_gather(self, lay: BucketLayout) -> None:
        outs = list(lay.grecv.view(self.world_size, lay.gather_size).unbind(0))
        dist.all_gather(outs, lay.gsend, group=self.group)
        self.bytes_sent += (self.world_size - 1) * lay.gather_size

    # -- error headers ----------------------------------------------------------------------------------
    def _write_header(self, buf: torch.Tensor, error: BaseException | None) -> None:
        h = buf[:HEADER]
        if error is None:
            h[:4].view(torch.int32).fill_(_STATUS_OK)
            return
        h[:4].view(torch.int32).fill_(_STATUS_ERROR)
        h[4:8].view(torch.int32).fill_(self.rank)
        text = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[: HEADER - 8]
        h[8:].zero_()
        h[8: 8 + len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))

    @staticmethod
    def _check_headers(headers: list[torch.Tensor], stage: str,
                       cause: BaseException | None = None) -> None:
        # One device-to-host copy of the W headers (64 bytes each), not of the messages behind them.
        # Headers are read in rank order, so every rank reports the same (lowest) failing rank with
        # the same text; the failing rank itself reads its own header too and chains its exception.
        for h in torch.stack([h[:HEADER] for h in headers]).cpu().unbind(0):
            if int(h[:4].view(torch.int32)[0]) != _STATUS_OK:
                rank = int(h[4:8].view(torch.int32)[0])
                text = bytes(h[8:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
                raise CompressionError(
                    f"FastML: compression failed on rank {rank} during {stage} ({text}); every rank "
                    f"stops here so none hangs. See rank {rank}'s log for the traceback."
                ) from cause
        if cause is not None:  # unreachable: this rank's own header carries its error
            raise CompressionError(f"FastML: compression failed during {stage}") from cause

    # -- the all-reduce --------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, lay: BucketLayout, buf: torch.Tensor, step: int, layer_stats: bool = False,
            commit: bool = True) -> bool:
        """Replace flat bucket ``buf`` (any float dtype) by the mean over ranks of the compressed
        gradients. Returns whether the result is finite; the new residuals are committed only then
        (with ``commit=False`` not at all: the caller calls :meth:`commit` once the whole step is
        known to be finite, so a step that GradScaler skips leaves every bucket's residuals alone)."""
        W, r = self.world_size, self.rank
        base = _mix(self.plan.seed, step, r)
        local_error: BaseException | None = None
        try:
            self._encode(lay, buf, base, layer_stats)
        except Exception as e:  # noqa: BLE001 - forwarded to every rank below
            local_error = e
        for j in range(W):
            start = sum(lay.split_sizes[:j])
            self._write_header(lay.send[start:], local_error)
        self._all_to_all(lay)
        headers = [lay.recv[j * lay.my_chunk:] for j in range(W)]
        self._check_headers(headers, "encoding", local_error)

        try:
            for g in lay.dense:
                n_me = g.bounds[r + 1] - g.bounds[r]
                for src in range(W):
                    off = src * lay.my_chunk + g.recv_off
                    codecs.decode_dense(lay.recv[off: off + g.nbytes[r]], n_me, g.cfg, g.acc,
                                        accumulate=src > 0)
                g.acc.div_(W)
                off = g.gather_off[r]
                codecs.encode_dense(g.acc, g.cfg, lay.gsend[off: off + g.nbytes[r]],
                                    seed=_mix(base, 1, g.key))
        except Exception as e:  # noqa: BLE001
            local_error = e
        self._write_header(lay.gsend, local_error)
        self._all_gather(lay)
        self._check_headers([lay.grecv[j * lay.gather_size:] for j in range(W)], "reduction",
                            local_error)

        finite = self._decode(lay, buf)
        if finite and commit:
            self.commit(lay)
        self.bytes_uncompressed += 2.0 * (W - 1) / W * 4 * lay.total_numel
        return finite

    @staticmethod
    def commit(lay: BucketLayout) -> None:
        """Make the residuals computed by the last :meth:`run` of ``lay`` the current ones."""
        for g in lay.dense:
            if g.ef:
                g.res_cur, g.res_next = g.res_next, g.res_cur
        for t in lay.topk:
            if t.cfg.error_feedback and t.pending is not None:
                t.residual, t.pending = t.pending, None  # v was a fresh tensor: no copy

    def _encode(self, lay: BucketLayout, buf: torch.Tensor, base: int, layer_stats: bool) -> None:
        for g in lay.dense:
            x = g.view(buf)
            if not g.direct:
                for p in g.params:
                    x[p.goff: p.goff + p.numel].copy_(buf[p.boff: p.boff + p.numel])
            for j in range(self.world_size):
                a, b = g.bounds[j], g.bounds[j + 1]
                out = lay.send[g.send_off[j]: g.send_off[j] + g.nbytes[j]]
                seed = _mix(base, 0, g.key, j)
                if g.ef:
                    codecs.encode_dense(x[a:b], g.cfg, out, residual=g.res_cur[a:b],
                                        residual_out=g.res_next[a:b], seed=seed)
                else:
                    codecs.encode_dense(x[a:b], g.cfg, out, seed=seed)
            if layer_stats:
                self._dense_layer_error(lay, g, x)
        for t in lay.topk:
            p = t.param
            g = buf[p.boff: p.boff + p.numel]
            # v = grad + residual in one pass (a fresh fp32 tensor: it becomes the new residual)
            v = torch.add(g, t.residual) if t.cfg.error_feedback else g.to(torch.float32, copy=True)
            out = lay.gsend[t.gather_off: t.gather_off + t.nbytes]
            idx, sent = codecs.encode_topk(v, t.cfg, out, seed=_mix(base, 2, zlib.crc32(p.name.encode())))
            if t.cfg.error_feedback or layer_stats:
                vn = float(v.norm()) if layer_stats else 0.0
                v[idx] -= sent  # v becomes the new residual
                if layer_stats:
                    self.layer_error[p.name] = float(v.norm()) / vn if vn > 0 else 0.0
                t.pending = v if t.cfg.error_feedback else None

    def _dense_layer_error(self, lay: BucketLayout, g: _DenseGroup, x: torch.Tensor) -> None:
        # Relative error ||decoded - input|| / ||input|| of the first-stage encoding, per parameter.
        if g.ef:
            err, inp = g.res_next, x + g.res_cur
        else:
            dec = torch.empty(g.length, dtype=torch.float32, device=x.device)
            for j in range(self.world_size):
                a, b = g.bounds[j], g.bounds[j + 1]
                codecs.decode_dense(lay.send[g.send_off[j]: g.send_off[j] + g.nbytes[j]], b - a,
                                    g.cfg, dec[a:b])
            err, inp = dec - x, x
        for p in g.params:
            s = slice(p.goff, p.goff + p.numel)
            vn = float(inp[s].norm())
            self.layer_error[p.name] = float(err[s].norm()) / vn if vn > 0 else 0.0

    def _decode(self, lay: BucketLayout, buf: torch.Tensor) -> bool:
        W = self.world_size
        checks: list[torch.Tensor] = []  # one sync at the end, not one per chunk (GPU)
        grecv = lay.grecv.view(W, lay.gather_size)
        for g in lay.dense:
            x = g.view(buf)
            for j in range(W):
                a, b = g.bounds[j], g.bounds[j + 1]
                off = g.gather_off[j]
                chunk = grecv[j, off: off + g.nbytes[j]]
                codecs.decode_dense(chunk, b - a, g.cfg, x[a:b])
                if g.cfg.codec is Codec.QUANTIZE and b > a:
                    nb = math.ceil((b - a) / g.cfg.block_size)
                    checks.append(torch.isfinite(chunk[: 8 * nb].view(torch.float32)).all())
            if g.cfg.codec is not Codec.QUANTIZE:
                checks.append(torch.isfinite(x).all())
            if not g.direct:
                for p in g.params:
                    buf[p.boff: p.boff + p.numel].copy_(x[p.goff: p.goff + p.numel])
        for t in lay.topk:
            p = t.param
            acc = lay.topk_acc[p.name]
            acc.zero_()
            for j in range(W):
                checks.append(codecs.decode_topk_add(
                    grecv[j, t.gather_off: t.gather_off + t.nbytes], p.numel, t.cfg, acc))
            acc.div_(W)
            buf[p.boff: p.boff + p.numel].copy_(acc)
        return bool(torch.stack(checks).all()) if checks else True

    # -- statistics ---------------------------------------------------------------------------------------
    def layer_stats(self) -> dict[str, dict]:
        from fastml_strategy.codecs import wire_bytes

        out = {}
        for lay in self.layouts.values():
            for name, cfg in lay.configs.items():
                p_numel = next((p.numel for g in lay.dense for p in g.params if p.name == name), None)
                if p_numel is None:
                    p_numel = next(t.param.numel for t in lay.topk if t.param.name == name)
                out[name] = {
                    "codec": cfg.describe(),
                    "numel": p_numel,
                    "bytes": wire_bytes(p_numel, cfg, self.world_size),
                    "rel_error": self.layer_error.get(name, float("nan")),
                }
        return out
