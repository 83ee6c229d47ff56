"""The gate against an independent transcription of AITER's rule (AITER's
csrc/include/custom_all_reduce.cuh, dispatchFusedAllReduceRMSNorm, since ROCm/aiter#2453)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusion_pass.backends.aiter.limits import AiterLimits
from fusion_pass.backends.triton_symm.limits import TritonLimits
from fusion_pass.gate import BackendLimits, Path, TokenRange, decide, one_stage_fits

DTYPES = ["bfloat16", "float16", "float32"]
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def aiter_one_stage_ok(n: int, dtype: str) -> bool:
    """dispatchFusedAllReduceRMSNorm: pack_size = 16 / sizeof(T); n % pack == 0 && n / pack <= 1024."""
    pack_size = 16 // BYTES[dtype]
    return n % pack_size == 0 and n // pack_size <= 1024


def expected_path(n: int, dtype: str, tokens: int, threshold: int = 80) -> Path:
    """vLLM's caller rule for world size 2: 1-stage iff tokens <= 80 and the pack rule holds."""
    if (n * BYTES[dtype]) % 16:
        return Path.UNFUSED
    if tokens <= threshold and aiter_one_stage_ok(n, dtype):
        return Path.ONE_STAGE
    return Path.TWO_STAGE


@pytest.mark.parametrize("hidden,dtype,fits", [
    (2880, "bfloat16", True),   # GPT-OSS: 360 packs
    (2881, "bfloat16", False),
    (8192, "bfloat16", True),   # 1024 packs: the largest
    (8200, "bfloat16", False),  # 1025 packs
    (4096, "float32", True),
    (4100, "float32", False),   # 1025 packs of 4
    (8192, "float16", True),
    (8192, "float32", False),
])
def test_pack_rule_named_sizes(hidden: int, dtype: str, fits: bool) -> None:
    assert one_stage_fits(hidden, dtype) is fits
    assert (decide(hidden, dtype, 2, 8).path is Path.ONE_STAGE) is fits


@settings(max_examples=3000, deadline=None)
@given(n=st.integers(1, 20000), dtype=st.sampled_from(DTYPES), tokens=st.integers(1, 4096))
def test_concrete_tokens_match_aiter_rule(n: int, dtype: str, tokens: int) -> None:
    assert one_stage_fits(n, dtype) == aiter_one_stage_ok(n, dtype)
    assert decide(n, dtype, 2, tokens).path is expected_path(n, dtype, tokens)


@settings(max_examples=2000, deadline=None)
@given(n=st.integers(1, 20000), dtype=st.sampled_from(DTYPES),
       lo=st.integers(1, 300), span=st.one_of(st.none(), st.integers(0, 300)))
def test_range_is_runtime_only_when_it_straddles(n: int, dtype: str, lo: int, span) -> None:
    hi = None if span is None else lo + span
    path = decide(n, dtype, 2, TokenRange(lo, hi)).path
    ends = {expected_path(n, dtype, lo)} | ({expected_path(n, dtype, hi)} if hi is not None
                                           else {expected_path(n, dtype, 10**6)})
    if len(ends) == 1:
        assert path is ends.pop()
    else:
        assert path is Path.RUNTIME
    # A per-call decision anywhere in the range agrees with the range's decision.
    if path is not Path.RUNTIME:
        for t in {lo, hi if hi is not None else lo + 1000}:
            assert decide(n, dtype, 2, t).path is path


def test_empty_batch_takes_no_path_and_never_makes_a_range_straddle() -> None:
    """0 tokens: the op returns empty outputs without a launch on every backend."""
    for hidden in (8200, 4096):
        d = decide(hidden, "bfloat16", 2, 0)
        assert d.path is Path.UNFUSED and "0 tokens" in d.reason
    assert decide(8200, "bfloat16", 2, TokenRange(0, 8)).path is Path.TWO_STAGE
    assert decide(4096, "bfloat16", 2, TokenRange(0, 80)).path is Path.ONE_STAGE


def test_unknown_tokens() -> None:
    assert decide(4096, "bfloat16", 2, None).path is Path.RUNTIME
    # No one-stage possible: the count does not matter.
    assert decide(8200, "bfloat16", 2, None).path is Path.TWO_STAGE


def test_threshold_is_configurable() -> None:
    assert decide(4096, "bfloat16", 2, 100).path is Path.TWO_STAGE
    assert decide(4096, "bfloat16", 2, 100, threshold=128).path is Path.ONE_STAGE
    assert decide(4096, "bfloat16", 2, TokenRange(1, 128), threshold=128).path is Path.ONE_STAGE


@pytest.mark.parametrize("world_size", [0, 1])
def test_nothing_to_reduce(world_size: int) -> None:
    d = decide(4096, "bfloat16", world_size, 8)
    assert d.path is Path.UNFUSED and "world size" in d.reason


def test_world_sizes_and_dtypes_of_the_backend() -> None:
    limits = BackendLimits(name="k", world_sizes=frozenset({2, 4, 8}),
                           dtypes=frozenset({"bfloat16", "float16"}))
    assert decide(4096, "bfloat16", 3, 8, limits=limits).path is Path.UNFUSED
    assert decide(4096, "bfloat16", 16, 8, limits=limits).path is Path.UNFUSED
    assert decide(4096, "float32", 2, 8, limits=limits).path is Path.UNFUSED
    assert decide(4096, "float64", 2, 8).path is Path.UNFUSED
    assert decide(4096, "torch.bfloat16", 4, 8, limits=limits).path is Path.ONE_STAGE


def test_vllm_byte_limits_for_one_stage() -> None:
    """vLLM's AITER caller: ws<=4 one-stage below 256 KiB, ws<=8 below 128 KiB."""
    limits = BackendLimits(name="aiter", one_stage_max_bytes={4: 256 * 1024, 8: 128 * 1024})
    # 8192 bf16 = 16 KiB a token: 15 tokens < 256 KiB, 16 are not.
    assert decide(8192, "bfloat16", 4, 15, limits=limits).path is Path.ONE_STAGE
    assert decide(8192, "bfloat16", 4, 16, limits=limits).path is Path.TWO_STAGE
    assert decide(8192, "bfloat16", 8, 7, limits=limits).path is Path.ONE_STAGE
    assert decide(8192, "bfloat16", 8, 8, limits=limits).path is Path.TWO_STAGE
    assert decide(8192, "bfloat16", 2, 80, limits=limits).path is Path.ONE_STAGE
    assert decide(8192, "bfloat16", 8, TokenRange(1, 80), limits=limits).path is Path.RUNTIME


def test_size_limit_of_the_backend() -> None:
    limits = BackendLimits(name="k", max_bytes=1024 * 4096 * 2)  # 1024 tokens of 4096 bf16
    assert decide(4096, "bfloat16", 2, 1024, limits=limits).path is Path.TWO_STAGE
    d = decide(4096, "bfloat16", 2, 1025, limits=limits)
    assert d.path is Path.UNFUSED and "limit" in d.reason
    assert decide(4096, "bfloat16", 2, TokenRange(81, 2048), limits=limits).path is Path.RUNTIME
    assert decide(4096, "bfloat16", 2, TokenRange(1, 64), limits=limits).path is Path.ONE_STAGE


def test_old_aiter_hidden_allowlist_and_token_cap() -> None:
    old = AiterLimits(name="aiter<0.1.12", hidden_sizes=frozenset({512, 1024, 2048, 4096}))
    assert decide(4096, "bfloat16", 2, 8, limits=old).path is Path.ONE_STAGE
    assert decide(2880, "bfloat16", 2, 8, limits=old).path is Path.UNFUSED
    capped = BackendLimits(name="aiter 0.1.13", one_stage_max_tokens=64)
    assert decide(4096, "bfloat16", 2, 64, limits=capped).path is Path.ONE_STAGE
    assert decide(4096, "bfloat16", 2, 65, limits=capped).path is Path.TWO_STAGE


def test_reasons_are_readable() -> None:
    assert "8200" in decide(8200, "bfloat16", 2, 8).reason
    assert "80" in decide(4096, "bfloat16", 2, 81).reason
    with pytest.raises(TypeError):
        decide(4096, "bfloat16", 2, 8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TokenRange(10, 5)


# -- measured schedules, kernel row ranges, exact splits, paths that are off ----------

from fusion_pass.gate import Schedule, breakpoints, segments  # noqa: E402

WAVY = (Schedule("bfloat16", 2, 2880, ((96, Path.ONE_STAGE), (768, Path.TWO_STAGE),
                                       (None, Path.ONE_STAGE))),
        Schedule("bfloat16", 2, 8192, ((128, Path.ONE_STAGE), (None, Path.TWO_STAGE))))


@pytest.mark.parametrize("hidden,tokens,path", [
    (2880, 96, Path.ONE_STAGE), (2880, 97, Path.TWO_STAGE), (2880, 768, Path.TWO_STAGE),
    (2880, 769, Path.ONE_STAGE), (3072, 500, Path.TWO_STAGE),   # nearest: 2880
    (7168, 128, Path.ONE_STAGE), (7168, 129, Path.TWO_STAGE),   # nearest: 8192
])
def test_a_measured_schedule_replaces_the_threshold(hidden, tokens, path) -> None:
    limits = BackendLimits(name="triton", schedules=WAVY)
    d = decide(hidden, "bfloat16", 2, tokens, limits=limits)
    assert d.path is path and "measured schedule" in d.reason
    # Only for the dtype and world size it was measured at; a forced threshold wins.
    assert decide(hidden, "float16", 2, 90, limits=limits).path is Path.TWO_STAGE
    assert decide(hidden, "bfloat16", 4, 90, limits=limits).path is Path.TWO_STAGE
    assert decide(hidden, "bfloat16", 2, 90, limits=limits, threshold=80).path is Path.TWO_STAGE


def test_schedule_ranges_and_breakpoints() -> None:
    limits = BackendLimits(name="triton", schedules=WAVY)
    assert breakpoints(2880, "bfloat16", 2, limits=limits) == [96, 768]
    assert decide(2880, "bfloat16", 2, TokenRange(97, 768), limits=limits).path is Path.TWO_STAGE
    d = decide(2880, "bfloat16", 2, TokenRange(1, 1000), limits=limits)
    assert d.path is Path.RUNTIME and "[97, 768] two_stage" in d.reason
    with pytest.raises(ValueError):
        Schedule("bfloat16", 2, 2880, ((96, Path.ONE_STAGE), (64, Path.TWO_STAGE), (None, Path.ONE_STAGE)))
    with pytest.raises(ValueError):
        Schedule("bfloat16", 2, 2880, ((96, Path.ONE_STAGE),))


AITER_LIKE = AiterLimits(name="aiter-x", dtypes=frozenset({"bfloat16", "float16"}),
                         two_stage_packs=(64, 2048), two_stage_exact_split=True)


@pytest.mark.parametrize("hidden,ws,tokens,path,why", [
    (256, 2, 500, Path.ONE_STAGE, "two-stage row range"),   # 32 packs: one-stage, the only path
    (16384, 2, 8, Path.TWO_STAGE, "does not fit one block"),  # 2048 packs: two-stage only
    (16392, 2, 8, Path.UNFUSED, "no kernel path"),            # 2049 packs: neither
    (4104, 4, 81, Path.UNFUSED, "not divisible by world size 4"),  # 513 packs x 81 tokens
    (4104, 4, 84, Path.TWO_STAGE, "two-stage"),
    (4104, 2, 81, Path.UNFUSED, "not divisible by world size 2"),
])
def test_two_stage_row_range_and_exact_split(hidden, ws, tokens, path, why) -> None:
    d = decide(hidden, "bfloat16", ws, tokens, limits=AITER_LIKE)
    assert d.path is path and why in d.reason, d


def test_exact_split_makes_a_range_runtime_only_where_counts_differ() -> None:
    assert decide(4104, "bfloat16", 4, TokenRange(81, 90), limits=AITER_LIKE).path is Path.RUNTIME
    # 4096: 512 packs divide by every world size: no count is ever refused.
    assert decide(4096, "bfloat16", 8, TokenRange(81, 9000), limits=AITER_LIKE).path is Path.TWO_STAGE


def test_paths_that_are_off_say_why() -> None:
    limits = BackendLimits(name="aiter-0.1.14", off=((Path.ONE_STAGE, "bug #4346 before 0.1.19.post1"),))
    d = decide(4096, "bfloat16", 2, 8, limits=limits)
    assert d.path is Path.TWO_STAGE and "one-stage is off: bug #4346" in d.reason
    both = BackendLimits(name="aiter-0.1.10", off=((Path.ONE_STAGE, "no use_1stage"),
                                                   (Path.TWO_STAGE, "no use_1stage")))
    d = decide(4096, "bfloat16", 2, 8, limits=both)
    assert d.path is Path.UNFUSED and d.reason.endswith("takes no kernel path: no use_1stage")
    assert [s.path for s in segments(4096, "bfloat16", 2, limits=limits)] == [Path.TWO_STAGE]


def test_group_quant_needs_whole_groups() -> None:
    assert decide(2880, "bfloat16", 2, 8, group_size=128).path is Path.UNFUSED
    assert decide(4096, "bfloat16", 2, 8, group_size=128).path is Path.ONE_STAGE


def test_a_backend_may_hold_wider_one_stage_rows() -> None:
    """The Triton programs hold 16384 elements: rows past one block of 1024 packs
    may take one-stage; wider rows take no Triton kernel (both hold a whole row),
    while the default rule still sends 12288 to two-stage."""
    wide = TritonLimits(name="triton")
    assert decide(12288, "bfloat16", 2, 1, limits=wide).path is Path.ONE_STAGE
    assert decide(16384, "float32", 2, 1, limits=wide).path is Path.ONE_STAGE
    d = decide(16392, "bfloat16", 2, 1, limits=wide)
    assert d.path is Path.UNFUSED and "16384-element row a program holds" in d.reason
    assert decide(12288, "bfloat16", 2, 1).path is Path.TWO_STAGE
    assert one_stage_fits(12288, "bfloat16", wide) and not one_stage_fits(12288, "bfloat16")
