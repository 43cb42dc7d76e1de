"""Reference digests of every codec's bytes: what ties ``WIRE_FORMAT_VERSION`` to the wire.

Ranks compare :data:`fastml_strategy.codecs.WIRE_FORMAT_VERSION` before the first step and refuse to run
together when it differs; that only protects them if the version changes whenever the bytes do. This test
encodes fixed inputs with every codec setting it knows (each recipe of ``config.RECIPES``, each example of
``tests/test_codec_contract.py``'s ``EXAMPLES``, and quantize at 1-8 bits, round to nearest and
stochastic, fp32 and bf16 residuals) and compares a sha256 of the bytes (:meth:`WireCodec.wire_sample`:
the encoded chunk, two error-feedback steps and the residual after them, the reduce step of three
messages) with the digests stored in ``tests/wire_digests.json`` under the current version. It runs once
on the pure-torch reference (``FASTML_CPU_KERNEL=0``) and once per local build of the compiled CPU path,
which must all give the same bytes.

- A change of bytes fails with "the encoded bytes changed: bump WIRE_FORMAT_VERSION ...". Raise the
  version in ``fastml_strategy/codecs/_base.py``, then record the new digests with ``REGENERATE`` below (it
  adds the new version's entries and keeps the old versions' as the record of their bytes).
- A new codec is picked up from the registry: it needs example settings in ``EXAMPLES`` and digests
  (the same command records the missing ones under the current version; it never overwrites a stored
  digest). A new codec changes no stored digest, so it does not raise the version. A codec whose
  messages are not one encode of one tensor overrides ``wire_sample``, or sets ``digest_exempt`` to the
  reason the test prints.

Inputs are exact: 24-bit integers from ``torch.randint`` times powers of two (no platform-dependent
random-float path), plus a block of signed zeros, so every machine computes the same bytes. Top-k's
message lists the selected entries in ``torch.topk(sorted=False)``'s order, so its digests also follow
the torch build (the file records the torch version they were made with).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from fastml_strategy import RECIPES, CodecConfig, codecs, kernels
from fastml_strategy.kernels import cpu
from test_codec_contract import EXAMPLES

DIGEST_FILE = Path(__file__).with_name("wire_digests.json")
REGENERATE = "python tests/test_wire_digests.py --regenerate"
NUMELS = (1, 13, 1000, 4099)  # one element, a partial block, one partial block of 512, 8 blocks and a bit
OTHER_DTYPES = ((torch.bfloat16, 1000), (torch.float16, 4099))  # the encoder's 16-bit inputs
def config_key(cfg: CodecConfig) -> str:
    """A stable name of ``cfg``: the codec and its fields that differ from their defaults, in the order
    of its plan record."""
    d = cfg.to_dict()
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    rest = [f"{k}={v!r}" for k, v in d.items() if k in defaults and v != defaults[k]]
    return " ".join([d["codec"], *rest])


def digest_configs() -> dict[str, CodecConfig]:
    """Every setting digested, by :func:`config_key`."""
    cfgs = list(RECIPES.values()) + [c for per in EXAMPLES.values() for c in per.values()]
    q = codecs.Codec.QUANTIZE
    for bits in range(1, 9):
        cfgs += [CodecConfig(codec=q, bits=bits), CodecConfig(codec=q, bits=bits, stochastic=True)]
    cfgs += [CodecConfig(codec=q, bits=5, block_size=64, residual_dtype="bf16", stochastic=True),
             CodecConfig(codec=q, bits=2, block_size=8, error_feedback=False),
             CodecConfig(codec=codecs.Codec.TOPK, topk_count=40, bits=3, block_size=16, residual_dtype="bf16")]
    return {config_key(c): c for c in cfgs}


def make_input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Exact values: 24-bit integers scaled by 2**-23 and by a power of two per 64 elements (2**-12 to
    2**3), the first 64 elements of a long input all zeros of both signs."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-(1 << 23), 1 << 23, (n,), generator=g, dtype=torch.int64)
    exps = torch.randint(-12, 4, ((n + 63) // 64,), generator=g, dtype=torch.int64).repeat_interleave(64)[:n]
    x = ints.to(torch.float32) * 2.0**-23 * torch.pow(2.0, exps.to(torch.float32))
    if n >= 1000:
        x[:64] = 0.0
        x[1:64:3] = -0.0
    return x.to(dtype)


def cases() -> list[tuple[str, torch.dtype, int]]:
    return [(f"float32 n={n}", torch.float32, n) for n in NUMELS] + \
        [(f"{str(d).removeprefix('torch.')} n={n}", d, n) for d, n in OTHER_DTYPES]


def compute_digests(configs: dict[str, CodecConfig]) -> dict[str, dict[str, str]]:
    """``{config key: {case: sha256[:16] of the codec's wire_sample}}`` on the current kernel path."""
    out: dict[str, dict[str, str]] = {}
    for key, cfg in configs.items():
        codec = codecs.codec_for(cfg)
        if codec.digest_exempt:
            continue
        per = {}
        for i, (case, dtype, n) in enumerate(cases()):
            h = hashlib.sha256()
            for part in codec.wire_sample(make_input(n, dtype, seed=1000 + i), seed=11 + i):
                h.update(part.contiguous().numpy().tobytes())
            per[case] = h.hexdigest()[:16]
        out[key] = per
    return out


def load_stored(version: int | None = None) -> dict[str, dict[str, str]]:
    """The digests stored for ``version`` (default: the current WIRE_FORMAT_VERSION); {} if none."""
    data = json.loads(DIGEST_FILE.read_text()) if DIGEST_FILE.exists() else {}
    v = codecs.WIRE_FORMAT_VERSION if version is None else version
    return data.get("versions", {}).get(str(v), {}).get("digests", {})


def compare(stored: dict, computed: dict, path: str) -> list[str]:
    """The problems of ``computed`` against ``stored``, each a message saying what to do."""
    v = codecs.WIRE_FORMAT_VERSION
    changed = [f"{k} [{case}]" for k, per in computed.items() if k in stored
               for case, h in per.items() if stored[k].get(case, h) != h]
    missing = sorted(k for k, per in computed.items() if k not in stored or set(per) - set(stored[k]))
    problems = []
    if changed:
        problems.append(
            f"the encoded bytes changed ({path}), for {len(changed)} case(s), e.g. {changed[:4]}: ranks of this "
            f"build and of the last would decode each other's messages differently under the same "
            f"WIRE_FORMAT_VERSION={v}. If the change is meant, bump WIRE_FORMAT_VERSION in "
            f"fastml_strategy/codecs/_base.py and regenerate with `{REGENERATE}`; if not, the change is a bug.")
    if missing:
        problems.append(
            f"no stored digest for {missing[:4]}{' ...' if len(missing) > 4 else ''} under WIRE_FORMAT_VERSION={v} "
            f"in {DIGEST_FILE.name}. A new codec (or a new setting of one) records its digests under the "
            f"current version with `{REGENERATE}` (it adds missing entries and never overwrites a stored one) "
            f"and commits {DIGEST_FILE.name}; bytes that change for a stored setting need a new version "
            f"(WIRE_FORMAT_VERSION in fastml_strategy/codecs/_base.py).")
    return problems


def coverage_problems(configs: dict[str, CodecConfig]) -> list[str]:
    """Registered codecs the digests do not cover and that state no reason."""
    covered = {c.codec for c in configs.values()}
    out = []
    for codec, cls in codecs.registered_codecs().items():
        name = getattr(codec, "value", codec)
        if cls.digest_exempt:
            if not isinstance(cls.digest_exempt, str):
                out.append(f"{cls.__name__}.digest_exempt must be a str (the reason), got {cls.digest_exempt!r}")
        elif codec not in covered:
            out.append(f"codec {name!r} ({cls.__name__}) has no settings to digest: add examples of it to "
                       f"EXAMPLES in tests/test_codec_contract.py, then record its digests with `{REGENERATE}` "
                       f"(or override {cls.__name__}.wire_sample, or set {cls.__name__}.digest_exempt to the "
                       "reason its bytes cannot be digested)")
    return out


# -- the tests ---------------------------------------------------------------------------------------------
def _paths() -> list[str]:
    out = ["torch"]
    if cpu.available():
        out += [f"cpu[{b}]" for b in cpu.local_builds()]
    return out


def test_every_registered_codec_is_digested_or_says_why(capsys):
    assert not coverage_problems(digest_configs()), "\n".join(coverage_problems(digest_configs()))
    for codec, cls in codecs.registered_codecs().items():
        if cls.digest_exempt:
            print(f"wire digests: {getattr(codec, 'value', codec)} exempt: {cls.digest_exempt}")


@pytest.mark.parametrize("path", _paths())
def test_bytes_match_the_stored_digests(path, monkeypatch):
    """The same bytes from the torch reference and from each build of the compiled CPU path."""
    if path == "torch":
        monkeypatch.setenv("FASTML_CPU_KERNEL", "0")
        ctx = None
    else:
        ctx = cpu.use_build(path[4:-1])
        ctx.__enter__()
    try:
        assert kernels.resolve_backend(torch.zeros(1), None) == ("torch" if path == "torch" else "cpu")
        computed = compute_digests(digest_configs())
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    problems = compare(load_stored(), computed, path)
    assert not problems, "\n".join(problems)


def test_a_change_of_bytes_or_a_new_codec_fails_with_the_fix(monkeypatch):
    """What the test says when fp16's bytes change, and when a codec is registered without digests."""
    monkeypatch.setenv("FASTML_CPU_KERNEL", "0")
    configs = {k: c for k, c in digest_configs().items() if c.codec is codecs.Codec.FP16}
    stored = load_stored()
    assert not compare(stored, compute_digests(configs), "torch")
    real = codecs.Fp16Codec.encode

    def one_bit_off(self, x, out, residual=None, residual_out=None, seed=0):
        real(self, x, out, residual, residual_out, seed)
        out[:1] ^= 1  # the first value's last mantissa bit

    monkeypatch.setattr(codecs.Fp16Codec, "encode", one_bit_off)
    problems = compare(stored, compute_digests(configs), "torch")
    assert len(problems) == 1 and "the encoded bytes changed" in problems[0]
    assert "bump WIRE_FORMAT_VERSION" in problems[0] and REGENERATE in problems[0]
    assert "fp16 [float32 n=13]" in problems[0]
    assert "no stored digest" in compare({}, compute_digests(configs), "torch")[0]

    class NewCodec(codecs.Fp16Codec):
        codec = "new"

    monkeypatch.setattr(codecs, "registered_codecs", lambda: {"new": NewCodec})
    (msg,) = coverage_problems(digest_configs())
    assert "'new'" in msg and "EXAMPLES" in msg and "digest_exempt" in msg
    NewCodec.digest_exempt = "its bytes exist only inside a two-round all-reduce"
    assert not coverage_problems(digest_configs())


def test_stored_file_names_its_torch_and_command():
    data = json.loads(DIGEST_FILE.read_text())
    entry = data["versions"][str(codecs.WIRE_FORMAT_VERSION)]
    assert data["regenerate"] == REGENERATE and entry["torch"]


# -- regeneration ------------------------------------------------------------------------------------------
def regenerate() -> int:
    """Record the missing digests of the current WIRE_FORMAT_VERSION (computed on the torch reference);
    refuse to overwrite a stored one, which means the version must be raised first."""
    import os

    os.environ["FASTML_CPU_KERNEL"] = "0"
    v = codecs.WIRE_FORMAT_VERSION
    data = json.loads(DIGEST_FILE.read_text()) if DIGEST_FILE.exists() else {}
    entry = data.setdefault("versions", {}).setdefault(str(v), {"torch": torch.__version__, "digests": {}})
    stored = entry["digests"]
    computed = compute_digests(digest_configs())
    changed = compare(stored, {k: p for k, p in computed.items() if k in stored}, "torch")
    if changed:
        print("\n".join(changed), file=sys.stderr)
        print(f"refusing to overwrite digests of WIRE_FORMAT_VERSION={v}", file=sys.stderr)
        return 1
    added = 0
    for k, per in computed.items():
        for case, h in per.items():
            added += case not in stored.setdefault(k, {})
            stored[k][case] = h
    entry["digests"] = dict(sorted(stored.items()))
    data = {"about": "sha256[:16] of each codec's wire_sample for fixed inputs, per WIRE_FORMAT_VERSION "
                     "(tests/test_wire_digests.py); old versions are kept as the record of their bytes",
            "regenerate": REGENERATE,
            "versions": dict(sorted(data["versions"].items(), key=lambda kv: int(kv[0])))}
    DIGEST_FILE.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{DIGEST_FILE}: WIRE_FORMAT_VERSION={v}, {len(computed)} settings, {added} digests added")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        raise SystemExit(f"usage: {REGENERATE}")
    raise SystemExit(regenerate())
