"""Our side of the AITER backend, on the CPU: the version table, and the exact call
we make into AITER for each path.

AITER's ``CustomAllreduce`` is replaced by a recording stand-in; these tests say
nothing about AITER's kernels (those are ``tests/rocm/test_aiter_rocm.py``).  The
stand-in's calls are bound against the real signatures when AITER is importable.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from fusion_pass import backends, fused_allreduce_rmsnorm
from fusion_pass.backends import aiter as aiter_backend
from fusion_pass.backends.reference import add_rms_norm
from fusion_pass.gate import Path, decide
from fusion_pass.op import choose_path

WORLD = 2
HIDDEN = 2880  # GPT-OSS: 360 packs, one-stage only since AITER 0.1.12
EPS = 1e-6


class RecordingCustomAllreduce:
    """Stand-in for ``aiter.dist.device_communicators.custom_all_reduce.CustomAllreduce``.

    Same signatures as the parts of the real class we use; records every call.
    ``fused_ar_rms`` writes what the real kernel would for ranks holding equal
    inputs (sum = world * x), so results can be followed through the op.
    """

    created: list["RecordingCustomAllreduce"] = []

    def __init__(self, group, device, max_size=1024 * 1024 * 1024,
                 enable_register_for_capturing: bool = True) -> None:
        self.calls: list[tuple[str, tuple, dict]] = [
            ("__init__", (group, device), dict(max_size=max_size,
                                               enable_register_for_capturing=enable_register_for_capturing))]
        self.disabled = False
        self.accept = True
        self.world_size = WORLD
        self.fully_connected = True
        self.enable_register_for_capturing = enable_register_for_capturing
        self._IS_CAPTURING = False
        self.flushes = 0
        RecordingCustomAllreduce.created.append(self)

    def should_custom_ar(self, inp, prefill_support: bool = False):
        self.calls.append(("should_custom_ar", (inp,), {}))
        return self.accept

    @contextlib.contextmanager
    def capture(self):
        self.calls.append(("capture", (), {}))
        self._IS_CAPTURING = True
        try:
            yield
        finally:
            self._IS_CAPTURING = False
            self.flushes += 1

    def fused_ar_rms(self, inp, res_inp, *, res_out=None, out=None, w, eps,
                     registered=False, use_1stage=False, gemma_norm=False):
        self.calls.append(("fused_ar_rms", (inp, res_inp),
                           dict(res_out=res_out, out=out, w=w, eps=eps, registered=registered,
                                use_1stage=use_1stage, gemma_norm=gemma_norm)))
        y, h = add_rms_norm(inp * self.world_size, res_inp, w, eps, gemma_norm)
        out.copy_(y)
        res_out.copy_(h)
        return out, res_out

    def fused(self) -> list[dict]:
        """kwargs (plus ``args``) of every ``fused_ar_rms`` call so far."""
        return [dict(kw, args=a) for name, a, kw in self.calls if name == "fused_ar_rms"]


class NoGemmaCustomAllreduce(RecordingCustomAllreduce):
    """An AITER whose ``fused_ar_rms`` has no ``gemma_norm``."""

    def fused_ar_rms(self, inp, res_inp, *, res_out=None, out=None, w, eps,
                     registered=False, use_1stage=False):
        return super().fused_ar_rms(inp, res_inp, res_out=res_out, out=out, w=w, eps=eps,
                                    registered=registered, use_1stage=use_1stage)


# -- fixtures ----------------------------------------------------------------

@pytest.fixture(scope="module")
def group_name():
    """A two-rank c10d group in this one process (fake backend: no peers, no I/O)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


class Env(SimpleNamespace):
    capturing: bool
    new_groups: list[tuple[tuple, dict]]
    cls: type


@pytest.fixture
def env(monkeypatch, group_name) -> Env:
    """ROCm as far as our code can tell, with AITER's class and gloo group creation recorded."""
    e = Env(capturing=False, new_groups=[], cls=RecordingCustomAllreduce)
    monkeypatch.setattr(torch.version, "hip", "6.3.42131", raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: e.capturing)
    monkeypatch.setattr(aiter_backend, "_aiter_custom_allreduce_class", lambda: e.cls)

    def new_group(*args, **kwargs):
        e.new_groups.append((args, kwargs))
        return SimpleNamespace(gloo_for=args[0])

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(RecordingCustomAllreduce, "created", [])
    return e


def make(tokens: int, hidden: int = HIDDEN, dtype=torch.bfloat16, residual: bool = True):
    g = torch.Generator().manual_seed(tokens * 7 + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    r = torch.randn(tokens, hidden, generator=g).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return x, r, w


def only_comm() -> RecordingCustomAllreduce:
    assert len(RecordingCustomAllreduce.created) == 1
    return RecordingCustomAllreduce.created[0]


# -- the version table ---------------------------------------------------------

OLD_HIDDEN = frozenset({512, 1024, 2048, 4096})


@pytest.mark.parametrize("version, hidden_sizes, one_stage_cap", [
    ("0.1.11", OLD_HIDDEN, 80),
    ("0.1.11.post2", OLD_HIDDEN, 80),
    ("0.1.12rc1", OLD_HIDDEN, 80),           # a pre-release precedes 0.1.12
    ("0.1.12", None, 80),
    ("v0.1.13", None, 80),
    ("0.1.16.post3", None, 80),
    ("0.1.17.dev5+g1a2b3c4", None, 80),      # setuptools_scm: 0.1.16 + 5 commits
    ("0.1.17", None, None),
    ("0.1.17-rc0", None, 80),
    ("0.1.19.post1", None, None),
    ("0.1.20.post1+rocm7.0", None, None),
    ("0.2", None, None),
    ("0.1.0", OLD_HIDDEN, 80),               # setuptools_scm's fallback_version
    ("not-a-version", OLD_HIDDEN, 80),
    (None, OLD_HIDDEN, 80),
])
def test_version_table(version: Optional[str], hidden_sizes, one_stage_cap) -> None:
    lim = aiter_backend.limits_for_version(version)
    assert lim.hidden_sizes == hidden_sizes
    assert lim.one_stage_max_tokens == one_stage_cap
    assert lim.world_sizes == frozenset({2, 4, 8})
    assert lim.dtypes == frozenset({"bfloat16", "float16"})
    assert lim.max_bytes == 64 * 1024 * 1024
    assert lim.one_stage_max_bytes == {2: None, 4: 256 * 1024, 8: 128 * 1024}


def test_version_table_drives_the_gate() -> None:
    old, mid, new = (aiter_backend.limits_for_version(v) for v in ("0.1.11", "0.1.16", "0.1.17"))
    # Before 0.1.12 only the template sizes fuse; GPT-OSS's 2880 does not.
    assert decide(2880, torch.bfloat16, 2, 8, limits=old).path is Path.UNFUSED
    assert decide(4096, torch.bfloat16, 2, 8, limits=old).path is Path.ONE_STAGE
    assert decide(2880, torch.bfloat16, 2, 8, limits=mid).path is Path.ONE_STAGE
    # A tuned threshold above 80 may use one-stage only where the kernel grid-strides.
    assert decide(2880, torch.bfloat16, 2, 100, limits=mid, threshold=128).path is Path.TWO_STAGE
    assert decide(2880, torch.bfloat16, 2, 100, limits=new, threshold=128).path is Path.ONE_STAGE
    # vLLM's byte limits: < 256 KiB at 4 ranks, < 128 KiB at 8 (hidden 4096 bf16 = 8 KiB a row).
    assert decide(4096, torch.bfloat16, 4, 31, limits=new).path is Path.ONE_STAGE
    assert decide(4096, torch.bfloat16, 4, 32, limits=new).path is Path.TWO_STAGE
    assert decide(4096, torch.bfloat16, 8, 15, limits=new).path is Path.ONE_STAGE
    assert decide(4096, torch.bfloat16, 8, 16, limits=new).path is Path.TWO_STAGE
    assert decide(4096, torch.bfloat16, 2, 80, limits=new).path is Path.ONE_STAGE
    assert decide(4096, torch.bfloat16, 6, 8, limits=new).path is Path.UNFUSED
    assert decide(4096, torch.float32, 2, 8, limits=new).path is Path.UNFUSED
    # Above AITER's 64 MiB cutoff nothing fuses.
    assert decide(4096, torch.bfloat16, 2, 8193, limits=new).path is Path.UNFUSED


def test_backend_takes_limits_from_version(env) -> None:
    assert aiter_backend.AiterBackend("0.1.11").limits.hidden_sizes == OLD_HIDDEN
    assert aiter_backend.AiterBackend("0.1.18").limits.one_stage_max_tokens is None


def test_backend_refuses_non_rocm_torch(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(RuntimeError, match="ROCm build of torch"):
        aiter_backend.AiterBackend("0.1.18")


def test_backend_without_aiter_says_so(env, monkeypatch) -> None:
    monkeypatch.setattr(aiter_backend, "installed_version", lambda: None)
    with pytest.raises(RuntimeError, match="amd-aiter"):
        aiter_backend.AiterBackend()


# -- the call we make ------------------------------------------------------------

@pytest.mark.parametrize("path, tokens, use_1stage", [
    (Path.ONE_STAGE, 8, True),
    (Path.TWO_STAGE, 8, False),
    (Path.TWO_STAGE, 200, False),
    (Path.RUNTIME, 80, True),
    (Path.RUNTIME, 81, False),
])
def test_our_call_per_path(env, group_name, path, tokens, use_1stage) -> None:
    be = aiter_backend.AiterBackend("0.1.18")
    x, r, w = make(tokens)
    # ``runtime`` reaches a backend already resolved by the op, with the backend's limits.
    path = choose_path(x, group_name, path.value, be.limits).path
    y, h = be.run(x, r, w, EPS, group_name, path, False)
    (call,) = only_comm().fused()
    assert call["args"][0] is x and call["args"][1] is r
    assert call["w"] is w and call["eps"] == EPS
    assert call["use_1stage"] is use_1stage
    assert call["registered"] is False
    assert call["gemma_norm"] is False
    # Fresh outputs, handed to AITER and returned as they are.
    assert call["out"] is y and call["res_out"] is h
    for t in (y, h):
        assert t.shape == x.shape and t.dtype == x.dtype
        assert t.data_ptr() not in (x.data_ptr(), r.data_ptr(), w.data_ptr())
    assert y.data_ptr() != h.data_ptr()
    y_ref, h_ref = add_rms_norm(x * WORLD, r, w, EPS, False)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(h, h_ref)


def test_our_call_gemma(env, group_name) -> None:
    be = aiter_backend.AiterBackend("0.1.18")
    x, r, w = make(4)
    be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, True)
    assert only_comm().fused()[0]["gemma_norm"] is True


def test_our_call_without_residual_adds_zeros(env, group_name) -> None:
    be = aiter_backend.AiterBackend("0.1.18")
    x, _, w = make(4, residual=False)
    y, h = be.run(x, None, w, EPS, group_name, Path.ONE_STAGE, False)
    (call,) = only_comm().fused()
    res_in = call["args"][1]
    assert res_in.shape == x.shape and res_in.dtype == x.dtype
    assert torch.count_nonzero(res_in) == 0
    torch.testing.assert_close(h, x * WORLD)


def test_our_call_registered_only_inside_aiter_capture(env, group_name) -> None:
    be = aiter_backend.AiterBackend("0.1.18")
    x, r, w = make(4)
    env.capturing = True
    be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, False)  # captured, no AITER capture context
    with be.graph_capture(group_name, x.device):
        be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, False)
    env.capturing = False
    with be.graph_capture(group_name, x.device):
        be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, False)  # warm-up inside the context
    comm = only_comm()
    assert [c["registered"] for c in comm.fused()] == [False, True, False]
    assert comm.flushes == 2  # AITER exchanged the captured addresses at each exit


def test_our_call_not_registered_when_aiter_disallows_it(env, group_name) -> None:
    be = aiter_backend.AiterBackend("0.1.18")
    x, r, w = make(4)
    comm = be.communicator(group_name, x.device)
    comm.enable_register_for_capturing = False  # what AITER forces on gfx1250
    env.capturing = True
    with be.graph_capture(group_name, x.device):
        be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, False)
    assert comm.fused()[0]["registered"] is False


def test_our_communicator_one_per_group_on_gloo(env, group_name) -> None:
    be = aiter_backend.AiterBackend("0.1.18")
    x, r, w = make(4)
    for path in (Path.ONE_STAGE, Path.TWO_STAGE, Path.ONE_STAGE):
        be.run(x, r, w, EPS, group_name, path, False)
    comm = only_comm()
    assert len(comm.fused()) == 3
    assert env.new_groups == [(([0, 1],), dict(backend="gloo", use_local_synchronization=True))]
    name, args, kwargs = comm.calls[0]
    assert name == "__init__"
    assert args[0].gloo_for == [0, 1] and args[1] == x.device
    assert kwargs == dict(max_size=aiter_backend.OWN_BUFFER_BYTES, enable_register_for_capturing=True)


@pytest.mark.parametrize("case", ["aiter_declines", "disabled", "weight_dtype", "unfused",
                                  "runtime_too_big", "old_hidden"])
def test_our_side_declines(env, group_name, case) -> None:
    be = aiter_backend.AiterBackend("0.1.11" if case == "old_hidden" else "0.1.18")
    x, r, w = make(4)
    path = Path.ONE_STAGE
    if case in ("aiter_declines", "disabled"):
        comm = be.communicator(group_name, x.device)
        setattr(comm, "accept" if case == "aiter_declines" else "disabled", case == "disabled")
    elif case == "weight_dtype":
        w = w.float()
    elif case == "unfused":
        path = Path.UNFUSED
    elif case == "runtime_too_big":
        # One row of 8 bf16 is 16 bytes: 4 Mi + 1 rows are just over the 64 MiB cutoff.
        x = torch.empty(4 * 1024 * 1024 + 1, 8, dtype=torch.bfloat16)
        r, w = torch.empty_like(x), torch.ones(8, dtype=torch.bfloat16)
        path = choose_path(x, group_name, Path.RUNTIME.value, be.limits).path
    assert be.run(x, r, w, EPS, group_name, path, False) is None
    assert all(not c.fused() for c in RecordingCustomAllreduce.created)


def test_our_call_old_aiter_never_one_stage_above_80(env, group_name) -> None:
    be = aiter_backend.AiterBackend("0.1.16")
    x, r, w = make(81)
    be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, False)  # e.g. baked under other limits
    assert only_comm().fused()[0]["use_1stage"] is False


def test_our_call_on_aiter_without_gemma_norm(env, group_name) -> None:
    env.cls = NoGemmaCustomAllreduce
    be = aiter_backend.AiterBackend("0.1.18")
    x, r, w = make(4)
    assert be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, True) is None
    be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, False)
    (call,) = only_comm().fused()
    assert call["gemma_norm"] is False  # the stand-in's default: we passed none


def test_our_call_through_the_op(env, group_name, monkeypatch) -> None:
    monkeypatch.setattr(aiter_backend, "installed_version", lambda: "0.1.18")
    monkeypatch.setattr(backends, "_instances", {})
    backends.set_backend("aiter")
    try:
        x, r, w = make(81, hidden=4096)
        y, h = fused_allreduce_rmsnorm(x, w, EPS, group_name, residual=r, path="auto", gemma=True)
    finally:
        backends.set_backend(None)
    (call,) = only_comm().fused()
    assert call["use_1stage"] is False and call["gemma_norm"] is True
    y_ref, h_ref = add_rms_norm(x * WORLD, r, w, EPS, True)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(h, h_ref)


# -- inside vLLM -----------------------------------------------------------------

class _Coordinator:
    """The parts of vLLM's GroupCoordinator the backend reads."""

    def __init__(self, group_name: str, aiter_ar_comm: Any) -> None:
        self.unique_name = "tp:0"
        self.device_group = SimpleNamespace(group_name=group_name)
        self.device_communicator = SimpleNamespace(aiter_ar_comm=aiter_ar_comm)


@pytest.fixture
def vllm_groups(monkeypatch):
    ps = pytest.importorskip("vllm.distributed.parallel_state",
                             reason="vLLM is not installed: no vLLM communicator to find")
    monkeypatch.setattr(ps, "_groups", {})
    keep: list[_Coordinator] = []

    def register(group_name: str, aiter_ar_comm: Any) -> None:
        coord = _Coordinator(group_name, aiter_ar_comm)
        keep.append(coord)
        ps._groups[coord.unique_name] = weakref.ref(coord)

    return register


def test_our_call_reuses_vllms_aiter_communicator(env, group_name, vllm_groups) -> None:
    from vllm.distributed.device_communicators.aiter_custom_all_reduce import AiterCustomAllreduce

    impl = RecordingCustomAllreduce(None, torch.device("cpu"))
    wrapper = AiterCustomAllreduce.__new__(AiterCustomAllreduce)  # vLLM's class, AITER replaced
    wrapper._impl = impl
    vllm_groups(group_name, wrapper)
    RecordingCustomAllreduce.created.clear()

    be = aiter_backend.AiterBackend("0.1.18")
    x, r, w = make(8)
    y, _ = be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, False)
    assert RecordingCustomAllreduce.created == [] and env.new_groups == []
    (call,) = impl.fused()
    assert call["use_1stage"] is True and call["out"] is y


def test_our_side_declines_in_vllm_without_aiter_allreduce(env, group_name, vllm_groups) -> None:
    vllm_groups(group_name, None)
    be = aiter_backend.AiterBackend("0.1.18")
    x, r, w = make(8)
    assert be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, False) is None
    assert RecordingCustomAllreduce.created == [] and env.new_groups == []


# -- the stand-in against the real AITER -------------------------------------------

def test_our_calls_bind_to_real_aiter_signatures(env, group_name) -> None:
    try:
        from aiter.dist.device_communicators.custom_all_reduce import CustomAllreduce as real
    except Exception as exc:  # AITER's import loads torch extensions that need ROCm
        pytest.skip(f"AITER is not importable here ({type(exc).__name__}: {exc}); the "
                    "stand-in's calls are bound to the real signatures only where it is")
    be = aiter_backend.AiterBackend("0.1.18")
    x, r, w = make(8)
    env.capturing = True
    with be.graph_capture(group_name, x.device):
        be.run(x, r, w, EPS, group_name, Path.ONE_STAGE, True)
    env.capturing = False
    be.run(x, None, w, EPS, group_name, Path.TWO_STAGE, False)
    calls = only_comm().calls
    assert {name for name, _, _ in calls} == {"__init__", "should_custom_ar", "capture",
                                              "fused_ar_rms"}
    for name, args, kwargs in calls:
        inspect.signature(getattr(real, name)).bind(object(), *args, **kwargs)
