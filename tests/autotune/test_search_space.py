"""The autotuner's search space is the codec registry's: every registered codec's candidates are
searched (DDP; FSDP/HSDP too, with -rbf16 variants, where the codec runs sharded) and its uniform
baselines timed, with no list to edit outside the codec's module (the fp8 codec is the example)."""

from fastml_strategy import codecs
from fastml_strategy.autotune._state import UNIFORM_RECIPES
from fastml_strategy.autotune.costmodel import BASE_OPTIONS, CANDIDATES, Sharding, default_options


def test_every_registered_codec_is_searched():
    ddp, fsdp = default_options("ddp"), default_options(Sharding("fsdp"))
    for codec, cls in codecs.registered_codecs().items():
        for name, cfg in cls.candidates.items():
            assert CANDIDATES[name] == cfg and cfg.codec is codec
            assert name in ddp and name in BASE_OPTIONS
            assert (name in fsdp) == cls.sharded
            if cls.sharded and cfg.uses_residual:
                assert f"{name}-rbf16" in fsdp and CANDIDATES[f"{name}-rbf16"].residual_dtype == "bf16"
    assert list(BASE_OPTIONS) == list(codecs.candidates())
    assert UNIFORM_RECIPES == codecs.uniform_recipes()
    assert set(UNIFORM_RECIPES) <= set(codecs.RECIPES)


def test_the_fp8_codec_is_searched_from_its_module_alone():
    from fastml_strategy.codecs.fp8 import Fp8Codec, Fp8Config

    assert codecs.registered_codecs()[codecs.Codec.FP8] is Fp8Codec
    assert CANDIDATES["fp8"] == Fp8Config() and "fp8" in default_options("ddp")
    assert "fp8-rbf16" in default_options(Sharding("hsdp"))
    assert CANDIDATES["fp8"].describe() == "fp8" and codecs.codec_for(CANDIDATES["fp8"]).family == "fp8"
