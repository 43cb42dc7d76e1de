"""What travels beside the gradients: the 64-byte status header of every message, the checks a step
keeps on the device, and the one host read that resolves them.

The header protocol
-------------------
Every message of FastML's collectives (each all_to_all part, each all_gather part) starts with
:data:`HEADER` bytes: an int32 status (0: fine, 1: the sender failed), the int32 rank that failed
(the world rank, also on a subgroup) and up to 56 bytes of UTF-8 error text. A rank whose encoder
raises still takes part in every collective, with error headers, so every rank (that one included)
raises the same :class:`CompressionError`, naming the lowest failing rank, instead of hanging; it
sends error headers for the rest of the step and skips its own work.

Host reads
----------
Nothing on the wire path reads a tensor's value on the host per chunk, piece or bucket. The headers
every rank received, the finiteness of every decoded result and this rank's own errors are collected
on the device (:class:`StepChecks`) and resolved in one host read (:func:`resolve`, through
:func:`host`, which counts them: :func:`host_reads`): per bucket for a caller that passes no checks
(FSDP, LocalSGD), per step for the DDP hook, which keeps one :class:`StepChecks` for all the buckets
of a step. Until then the other ranks cannot know that one rank failed, so they decode and sum what
it sent (whatever its buffers held): decoding any bytes is harmless (top-k indices are clamped), and
the step raises at its end on every rank alike, naming the lowest failing rank of the first message,
in the order every rank read them, whose header reported an error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastml_strategy.wire.messages import HEADER  # 64 bytes: int32 status, int32 rank, 56 of UTF-8 error text

__all__ = ["HEADER", "CompressionError", "DecodeError", "StepChecks", "write_header", "header_error",
           "check_headers", "resolve", "host", "host_reads", "all_finite"]

STATUS_OK, STATUS_ERROR = 0, 1


class CompressionError(RuntimeError):
    """Raised on every rank when compression or communication failed on one of them."""


class DecodeError(CompressionError):
    """Decoding failed on this rank after the bucket's last collective (the caller tells the others)."""


# Named (in tracebacks and pickles) after the module users import them from: fastml_strategy.collective
# (CompressionError also from the package itself).
CompressionError.__module__ = DecodeError.__module__ = "fastml_strategy.collective"


# -- host reads -----------------------------------------------------------------------------------------------
_host_reads = 0


def host(t: torch.Tensor) -> torch.Tensor:
    """The one way the wire path reads a tensor's value on the host (counted: :func:`host_reads`).

    A CUDA tensor is copied into pinned memory on the current stream and the host waits for that
    copy's event: one host synchronisation, and an explicit one, so that the hot path can run under
    ``torch.cuda.set_sync_debug_mode("error")`` and any *other* read (``.item()``, ``bool(t)``,
    ``nonzero``) still raises there. The hook reads one small tensor per step this way."""
    global _host_reads
    _host_reads += 1
    if not t.is_cuda:
        return t.detach()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t.detach(), non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return out


def host_reads() -> int:
    """How many times this process's wire path read a tensor on the host (:func:`host`)."""
    return _host_reads


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, as a 0-d bool tensor on ``t``'s device (no host
    read). ``aminmax`` reads ``t`` once and propagates NaN; an inf is the min or the max itself, and
    finite values never overflow a min or a max."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    mn, mx = torch.aminmax(t.reshape(-1))
    return torch.isfinite(mn) & torch.isfinite(mx)


# -- the header ---------------------------------------------------------------------------------------------------
def write_header(buf: torch.Tensor, error: BaseException | None, rank: int) -> None:
    """Write the header of a message at the start of ``buf``: OK, or ``error`` of ``rank``."""
    h = buf[:HEADER]
    if error is None:
        h[:4].view(torch.int32).fill_(STATUS_OK)
        return
    h[:4].view(torch.int32).fill_(STATUS_ERROR)
    h[4:8].view(torch.int32).fill_(rank)
    text = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[: HEADER - 8]
    h[8:].zero_()
    h[8: 8 + len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))


def header_error(headers: list[torch.Tensor], stage: str,
                 cause: BaseException | None = None) -> CompressionError | None:
    """The error the W headers report (None if none does). One device-to-host copy of the W headers
    (64 bytes each), not of the messages behind them. Headers are read in rank order, so every rank
    reports the same (lowest) failing rank with the same text; the failing rank itself reads its own
    header too and chains its exception (``cause``)."""
    for h in host(torch.stack([h[:HEADER] for h in headers])).unbind(0):
        if int(h[:4].view(torch.int32)[0]) != STATUS_OK:
            rank = int(h[4:8].view(torch.int32)[0])
            text = bytes(h[8:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
            err = CompressionError(
                f"FastML: compression failed on rank {rank} during {stage} ({text}); every rank "
                f"stops here so none hangs. See rank {rank}'s log for the traceback.")
            err.__cause__ = cause
            return err
    return None


def check_headers(headers: list[torch.Tensor], stage: str, cause: BaseException | None = None) -> None:
    """Raise what the W headers report (:func:`header_error`)."""
    err = header_error(headers, stage, cause)
    if err is not None:
        raise err
    if cause is not None:  # unreachable: this rank's own header carries its error
        raise CompressionError(f"FastML: compression failed during {stage}") from cause


# -- the checks of a step ---------------------------------------------------------------------------------------
class StepChecks:
    """What the buckets of one step found, kept on the device until the step ends (no host read per
    bucket or per piece): the headers of every message received, in the order every rank reads them
    (W per all_to_all and per all_gather), the finiteness of every decoded result, and this rank's
    own errors. :func:`resolve` reads the headers' status and the finiteness in one host read; only
    when a header reports an error are the headers' texts read (to raise).

    ``error``: this rank's first error while encoding or reducing; every message this rank sends
    afterwards (in this step) carries it in its header, and the rank skips the rest of its work.
    ``decode_error``: an error after a bucket's last collective, which no header can carry: the
    ranks exchange it at the end of the step (:func:`resolve`, ``exchange``)."""

    def __init__(self) -> None:
        self.headers: list[tuple[str, torch.Tensor]] = []  # (stage, W x HEADER bytes)
        self.finite: list[torch.Tensor] = []  # 0-d bool tensors
        # buffers of plain all-reduces, checked for NaN/inf only when finiteness decides something
        # (:func:`resolve`, ``plain``): a step of plain buckets only has no residual to hold back, and
        # DDP's own hook checks nothing either
        self.plain: list[torch.Tensor] = []
        self.error: BaseException | None = None
        self.decode_error: BaseException | None = None

    def add_headers(self, stage: str, headers: list[torch.Tensor]) -> None:
        self.headers.append((stage, torch.stack([h[:HEADER] for h in headers])))

    def add_finite(self, ok: torch.Tensor) -> None:
        self.finite.append(ok.reshape(()))


def resolve(checks: StepChecks, group, world_size: int, rank: int, device: torch.device | None = None,
            exchange: bool = False, stage: str = "decoding", plain: bool = True, wait=None) -> bool:
    """Resolve what ``checks`` gathered: one host read of every header's status and every finiteness
    check. If a header reports an error, every rank raises the same :class:`CompressionError`, naming
    the lowest failing rank of the first message (in the order every rank read them) that carried one.
    With ``exchange`` (a collective on ``group``: at the end of a step that decoded something), the
    ranks first all_gather a header of this rank's ``checks.decode_error`` (``rank`` names it), as a
    last message read after all others; without, a decoding error of this rank raises
    :class:`DecodeError` (the caller tells the others). Returns whether every checked result was
    finite; the results of plain all-reduces are checked only with ``plain``. ``wait``: how the
    exchange is waited for (the engine's ``wait``: a failure channel's where one is set; None:
    ``work.wait()``)."""
    W = world_size
    if plain:
        for buf in checks.plain:
            checks.add_finite(all_finite(buf))
    checks.plain = []
    if exchange and W > 1:
        dev = device if device is not None and device.type == "cuda" else torch.device("cpu")
        mine = torch.zeros(HEADER, dtype=torch.uint8, device=dev)
        write_header(mine, checks.decode_error, rank)
        out = torch.zeros(W * HEADER, dtype=torch.uint8, device=dev)
        work = dist.all_gather(list(out.view(W, HEADER).unbind(0)), mine, group=group, async_op=True)
        (wait or type(work).wait)(work)
        checks.add_headers(stage, list(out.view(W, HEADER).unbind(0)))
    parts = []
    if checks.headers:
        hdrs = torch.cat([h for _, h in checks.headers])
        parts.append(hdrs.view(torch.int32)[:, 0] != STATUS_OK)
    if checks.finite:
        fin = torch.stack(checks.finite)
        parts.append(~fin.to(parts[0].device) if parts else ~fin)
    flags = host(torch.cat(parts)).tolist() if parts else []
    cause = checks.error or checks.decode_error
    for i, (what, h) in enumerate(checks.headers):
        if any(flags[i * W: (i + 1) * W]):  # the error path: the texts are read only here
            raise header_error(list(host(h).unbind(0)), what, cause)
    if checks.error is not None:  # unreachable: this rank's own headers carry its error
        raise CompressionError("FastML: compression failed") from checks.error
    if checks.decode_error is not None:
        if exchange:  # one rank: no header to exchange, the error is this rank's
            raise CompressionError(f"FastML: compression failed during {stage} "
                                   f"({checks.decode_error})") from checks.decode_error
        e = checks.decode_error
        raise DecodeError(f"{type(e).__name__}: {e}") from e
    return not any(flags[W * len(checks.headers):])
