"""Written once with the code of main 263ab2c (before the codec registry): a plan file covering every
codec setting of that release, and the bytes its layers put on the wire for fixed inputs."""
import hashlib, json, sys
import torch
sys.path.insert(0, "tests")
from fastml_strategy import Plan, CodecConfig, RECIPES, LocalSteps, codecs
from test_wire_digests import make_input

layers = {name: cfg for name, cfg in RECIPES.items()}
layers.update({
    "re:blocks\\.[0-9]+\\.q": CodecConfig(codec="quantize", bits=3, block_size=64, stochastic=True, residual_dtype="bf16"),
    "noef": CodecConfig(codec="quantize", bits=2, block_size=8, error_feedback=False),
    "topk-count": CodecConfig(codec="topk", topk_count=40, bits=3, block_size=16, residual_dtype="bf16", fallback_bits=None),
    "topk-fb4": CodecConfig(codec="topk", topk=0.05, fallback_bits=4),
    "lowrank-int8": CodecConfig(codec="lowrank", rank=2, factors="int8", block_size=64),
    "lowrank-bf16": CodecConfig(codec="lowrank", rank=1, factors="bf16", residual_dtype="bf16"),
})
plan = Plan(default=RECIPES["int4"], layers=layers, min_numel=128, seed=7, name="release-0.1-every-codec",
            intra_node="bf16", schedule="ring", link_latency_us=50.0, link_gbps=10.0)
plan.save("tests/data/plan_release_263ab2c.json")
local = Plan.from_recipe("int8", min_numel=0).with_layers({}, local_steps=LocalSteps(every=10, fragments=2))
local.save("tests/data/plan_release_263ab2c_local.json")
SHAPES = {1: (1,), 13: (13,), 1000: (40, 25), 4099: (4099,)}
out = {"plan_digest": plan.digest(), "local_digest": local.digest(), "layers": {}}
for key, cfg in (("default", plan.default), *plan.layers):
    codec = codecs.codec_for(cfg)
    row = {"describe": cfg.describe(), "nbytes": {}, "wire_bytes": {}, "sample": {}}
    for i, n in enumerate((1, 13, 1000, 4099)):
        row["nbytes"][n] = codec.nbytes(n)
        row["wire_bytes"][n] = [codecs.wire_bytes(n, cfg, w, SHAPES[n]) for w in (2, 3, 8)]
        h = hashlib.sha256()
        for part in codec.wire_sample(make_input(n, torch.float32, seed=500 + i), seed=3 + i):
            h.update(part.contiguous().numpy().tobytes())
        row["sample"][n] = h.hexdigest()
        x = make_input(n, torch.float32, seed=600 + i).view(SHAPES[n])
        y, nb = codecs.roundtrip(x, cfg, seed=1)
        row.setdefault("roundtrip", {})[n] = [nb, hashlib.sha256(y.contiguous().numpy().tobytes()).hexdigest()]
    out["layers"][key] = row
open("tests/data/plan_release_263ab2c_bytes.json", "w").write(json.dumps(out, indent=1) + "\n")
print(len(out["layers"]), "layers")
