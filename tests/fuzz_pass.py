"""Differential fuzzing of the pass: generated graphs around all-reduce -> (+ residual) -> RMSNorm.

Each case is Python source text generated from one integer seed: a function ``f``
that all-reduces ``x`` and runs norm-like code drawn from the spellings the pass
accepts and from near misses of them, plus ``make_inputs(rank)``.  Both ranks of a
gloo group run the same case list in lockstep; every case is compiled with the pass
and without it (same inputs: ``x`` differs per rank, the residual is the same), and

* the outputs must agree within the dtype's tolerance (FP8 codes within a step);
* every all-reduce in the graph the pass saw has a record, and the graph has exactly
  one fused op per site recorded as fused;
* the compile without the pass must not run it.

A case that breaks one of these is written to the output folder (its seed, what was
wrong, and its source) and can be re-run with ``--replay FILE``.

    python tests/fuzz_pass.py --seed S --cases N [--out DIR]

prints, last, ``fuzz: N cases, F fused, U unfused, W wrong``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))

DTYPES = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 1e-2}
"""Tolerance per dtype (test_pass.py's for fp32 and bf16); atol is twice it."""


# -- the generator ------------------------------------------------------------------------------

@dataclass
class Case:
    seed: int
    source: str
    recipe: dict = field(default_factory=dict)


MISSES = {
    "layout_ar": {"cast_roundtrip", "view_flat", "unflatten", "transposed_copy", "transpose",
                  "view_half_rows"},
    "residual": {"twice", "row_bias", "scaled"},
    "eps": {"row_tensor", "from_input"},
    "upcast": {"none"},
    "mean": {"unsqueeze", "sum_div", "part_row", "other_dim", "all"},
    "rsqrt": {"pow_half"},
    "weight": {"none", "added", "row_2d", "full", "gemma_wrong_side", "w_plus_1"},
    "norm": {"F.rms_norm_no_weight", "F.rms_norm_two_dims"},
    "extra": {"a_out", "a_add", "var_out", "normed_out", "inv_out"},
    "all_reduces": {"two_summed", "two_chained"},
    "fp8": {"scale_row", "scale_vec"},
    "hidden": {"33", "7", "130", "12"},
}
"""Options that take the graph off the pattern (or off what the pass fuses today);
a case aims at one to three of these keys, or at none (half of the cases)."""
MISSES["layout_h"] = MISSES["layout_ar"]


class _Gen:
    """Builds one case's source from a seeded ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.recipe: dict[str, Any] = {}
        self.body: list[str] = []
        self.outs: list[str] = []
        self.tmp = 0
        keys = sorted(MISSES)
        self.miss_keys = set() if self.rng.random() < 0.5 else \
            set(self.rng.sample(keys, self.rng.choice([1, 1, 2, 3])))
        self.recipe["aims_at"] = ",".join(sorted(self.miss_keys)) or "pattern"

    def pick(self, key: str, options: dict[str, float]) -> str:
        """One option: a near miss (an option in :data:`MISSES`) where this case aims to
        miss at ``key``, one of the pattern's spellings elsewhere."""
        stem = key.split("#")[0]
        misses = MISSES.get(stem, set())
        if stem not in self.miss_keys:
            options = {k: v for k, v in options.items() if k not in misses}
        elif misses & set(options):
            options = {k: v for k, v in options.items() if k in misses}
        names = list(options)
        choice = self.rng.choices(names, weights=[options[n] for n in names])[0]
        self.recipe[key] = choice
        return choice

    def line(self, text: str) -> None:
        self.body.append("    " + text)

    def fresh(self, stem: str) -> str:
        self.tmp += 1
        return f"{stem}{self.tmp}"

    # -- the pieces ---------------------------------------------------------------------------

    def all_reduce(self, src: str) -> str:
        form = self.pick(f"ar_form#{self.tmp}", {"fc": 3, "ops": 2})
        out = self.fresh("a")
        if form == "fc":
            self.line(f"{out} = fc.all_reduce({src}, 'sum', GROUP)")
        else:
            t = self.fresh("t")
            self.line(f"{t} = torch.ops._c10d_functional.all_reduce({src}, 'sum', GROUP_NAME)")
            self.line(f"{out} = torch.ops._c10d_functional.wait_tensor({t})")
        return out

    def layout(self, a: str, key: str) -> str:
        """Views between the steps: most keep the values, some change the row."""
        kind = self.pick(key, {"none": 14, "cast_roundtrip": 1, "view_flat": 1, "unflatten": 1,
                               "transposed_copy": 1, "transpose": 0.5, "view_half_rows": 0.5})
        h = self.hidden
        if kind == "none":
            return a
        out = self.fresh("l")
        if kind == "cast_roundtrip":
            other = "torch.float32" if self.dt != "float32" else "torch.bfloat16"
            self.line(f"{out} = {a}.to({other}).to(DT)")
        elif kind == "view_flat":
            self.line(f"{out} = {a}.view(-1, {h})")
            self.flat = True
        elif kind == "unflatten":
            if h % 2:
                return a
            self.line(f"{out} = {a}.unflatten(-1, ({h // 2}, 2)).flatten(-2)")
        elif kind == "transposed_copy":
            self.line(f"{out} = {a}.transpose(-2, -1).contiguous().transpose(-2, -1)")
        elif kind == "transpose":  # the norm then runs over tokens: a different function
            self.line(f"{out} = {a}.transpose(-2, -1).contiguous().view({a}.shape)")
        elif kind == "view_half_rows":  # rows of half the width: the norm's row is not the AR's row
            if h % 2:
                return a
            self.line(f"{out} = {a}.reshape(-1, {h // 2}).reshape({a}.shape)")
        return out

    def residual(self, a: str) -> tuple[str, str]:
        """``(h, kind)``: the norm's input and how the residual got there."""
        kind = self.pick("residual", {"add": 5, "add_left": 3, "none": 2, "after": 1.5,
                                      "twice": 1, "vllm_fp32": 1.5, "row_bias": 0.5,
                                      "scaled": 0.5})
        r = "r.view(-1, %d)" % self.hidden if self.flat else "r"
        r2 = "r2.view(-1, %d)" % self.hidden if self.flat else "r2"
        h = self.fresh("h")
        if kind in ("none", "after"):
            return a, kind
        if kind == "add":
            self.line(f"{h} = {a} + {r}")
        elif kind == "add_left":
            self.line(f"{h} = {r} + {a}")
        elif kind == "twice":
            self.line(f"{h} = ({a} + {r}) + {r2}")
        elif kind == "vllm_fp32":
            s = self.fresh("s")
            self.line(f"{s} = {a}.to(torch.float32) + {r}.to(torch.float32)")
            self.line(f"{h} = {s}.to(DT)")
            self.vllm_sum = s
        elif kind == "row_bias":  # a [hidden] addend, not a residual of the input's shape
            self.line(f"{h} = {a} + {r}[0]")
        elif kind == "scaled":
            self.line(f"{h} = {a} * 0.5 + {r}")
        return h, kind

    def eps(self) -> str:
        kind = self.pick("eps", {"literal": 8, "zero": 1, "negative": 1, "tensor0d": 1.5,
                                 "float_arg": 1.5, "row_tensor": 0.7, "from_input": 0.7})
        if kind == "literal":
            return repr(self.rng.choice([1e-6, 1e-5, 1e-2, 0.5, 2.0]))
        if kind == "zero":
            return "0.0"
        if kind == "negative":
            return repr(self.rng.choice([-1e-6, -1e-3]))
        if kind == "tensor0d":
            return "et"
        if kind == "float_arg":
            return "e"
        if kind == "row_tensor":
            return "erow" + (".view(-1, 1)" if self.flat else "")
        return "(r.float().abs().mean() * 0.25)"  # computed from an input of the graph

    def native_norm(self, h: str) -> str:
        """Hand-written RMSNorm of ``h``: returns ``y``."""
        dt32 = self.dt == "float32"
        up = self.pick("upcast", {"float": 4, "to_f32": 2, "none": 1 if not dt32 else 3})
        v = self.fresh("v")
        if up == "float":
            self.line(f"{v} = {h}.float()")
        elif up == "to_f32":
            self.line(f"{v} = {h}.to(torch.float32)")
        else:
            v = h
        if self.recipe.get("residual") == "vllm_fp32" and self.rng.random() < 0.7:
            v = self.vllm_sum  # vLLM normalises the unrounded fp32 sum
            self.recipe["norm_of"] = "fp32_sum"
        sq = self.pick("square", {"pow": 3, "mul": 2, "square": 2, "starstar": 1})
        sq_src = {"pow": f"{v}.pow(2)", "mul": f"({v} * {v})", "square": f"torch.square({v})",
                  "starstar": f"({v} ** 2)"}[sq]
        mean = self.pick("mean", {"keepdim": 6, "none_index": 3, "unsqueeze": 1, "sum_div": 1,
                                  "part_row": 1, "other_dim": 1, "all": 0.5})
        var = self.fresh("var")
        hid = self.hidden
        if mean == "keepdim":
            self.line(f"{var} = {sq_src}.mean(-1, keepdim=True)")
        elif mean == "none_index":
            self.line(f"{var} = {sq_src}.mean(-1)[..., None]")
        elif mean == "unsqueeze":
            self.line(f"{var} = {sq_src}.mean(-1).unsqueeze(-1)")
        elif mean == "sum_div":
            self.line(f"{var} = {sq_src}.sum(-1, keepdim=True) / {hid}")
        elif mean == "part_row":
            k = max(1, hid // 2)
            self.line(f"{var} = {sq_src}[..., :{k}].mean(-1, keepdim=True)")
        elif mean == "other_dim":
            self.line(f"{var} = {sq_src}.mean(0, keepdim=True)")
        else:
            self.line(f"{var} = {sq_src}.mean()")
        eps = self.eps()
        inv = self.pick("rsqrt", {"rsqrt": 4, "method": 2, "div_sqrt": 2, "pow_half": 0.5,
                                  "add_method": 1})
        n = self.fresh("n")
        order = self.rng.random() < 0.3
        if inv == "rsqrt":
            inv_src = f"torch.rsqrt({var} + {eps})"
        elif inv == "method":
            inv_src = f"({eps} + {var}).rsqrt()"
        elif inv == "add_method":
            inv_src = f"{var}.add({eps}).rsqrt()"
        elif inv == "pow_half":
            inv_src = f"torch.pow({var} + {eps}, -0.5)"
        else:
            inv_src = None
        if inv_src is None:
            self.line(f"{n} = {v} / torch.sqrt({var} + {eps})")
        else:
            iv = self.fresh("inv")
            self.line(f"{iv} = {inv_src}")
            self.line(f"{n} = {iv} * {v}" if order else f"{n} = {v} * {iv}")
            self.inv = iv
        self.var, self.normed = var, n
        wt = self.pick("weight", {"left": 4, "right": 3, "gemma": 2, "gemma3": 1.5,
                                  "fp32_mul": 1.5, "none": 1, "added": 0.7, "row_2d": 0.5,
                                  "full": 0.5, "gemma_wrong_side": 0.5, "w_plus_1": 0.5})
        y = self.fresh("y")
        w = "w"
        if wt == "left":
            self.line(f"{y} = {w} * {n}.to(DT)")
        elif wt == "right":
            self.line(f"{y} = {n}.to(DT) * {w}")
        elif wt == "gemma":
            self.line(f"{y} = ({n} * (1.0 + {w}.float())).to(DT)")
        elif wt == "gemma3":
            self.line(f"{y} = ({n} * (1 + {w}.float())).type_as({h})")
        elif wt == "w_plus_1":
            self.line(f"{y} = ({n} * ({w}.float() + 1.0)).to(DT)")
        elif wt == "gemma_wrong_side":
            self.line(f"{y} = (1.0 + {n} * {w}.float()).to(DT)")
        elif wt == "fp32_mul":
            self.line(f"{y} = ({n} * {w}.float()).to(DT)")
        elif wt == "none":
            self.line(f"{y} = {n}.to(DT)")
        elif wt == "added":
            self.line(f"{y} = {n}.to(DT) + {w}")
        elif wt == "row_2d":
            self.line(f"{y} = {w}.view(1, {hid}) * {n}.to(DT)")
        else:
            self.line(f"{y} = wfull{'.view(-1, %d)' % hid if self.flat else ''} * {n}.to(DT)")
        if self.rng.random() < 0.15:
            y2 = self.fresh("y")
            self.line(f"{y2} = {y}.to(DT)")
            self.recipe["out_cast"] = True
            y = y2
        return y

    def library_norm(self, h: str) -> str:
        kind = self.recipe["norm"]
        y = self.fresh("y")
        hid = self.hidden
        if kind == "F.rms_norm":
            eps = self.eps()
            if eps in ("et", "e") or "(" in eps or "erow" in eps:  # rms_norm takes a float
                eps = "1e-5"
                self.recipe["eps"] = "literal"
            self.line(f"{y} = F.rms_norm({h}, ({hid},), w, {eps})")
        elif kind == "F.rms_norm_default_eps":
            self.line(f"{y} = F.rms_norm({h}, ({hid},), w)")
        elif kind == "F.rms_norm_no_weight":
            self.line(f"{y} = F.rms_norm({h}, ({hid},), eps=1e-6)")
        elif kind == "F.rms_norm_two_dims":  # normalised over the last two dims: not a row norm
            self.line(f"{y} = F.rms_norm({h}, {h}.shape[-2:], eps=1e-6)")
        else:
            self.line(f"{y} = NORM({h})")
        return y

    def fp8(self, y: str) -> None:
        kind = self.pick("fp8", {"none": 12, "static_recip": 1.5, "static_div": 1.5,
                                 "token_vllm": 1.5, "token_torchao": 1, "group": 1,
                                 "scale_row": 0.5, "scale_vec": 0.5})
        if kind == "none":
            self.outs.insert(0, y)
            return
        if kind == "group" and self.hidden % 128:
            kind = "token_vllm"
            self.recipe["fp8"] = kind
        q = self.fresh("q")
        sc = self.fresh("sc")
        hid = self.hidden
        if kind == "static_recip":
            self.line(f"{q} = ({y}.to(torch.float32) * s.reciprocal()).clamp(-448.0, 448.0).to(FP8)")
            self.outs.insert(0, q)
        elif kind == "static_div":
            self.line(f"{q} = ({y}.to(torch.float32) / s).clamp(min=-448.0, max=448.0).to(FP8)")
            self.outs.insert(0, q)
        elif kind == "scale_row":  # a scale per token where a per-tensor one is expected
            srow = "srow.view(-1, 1)" if self.flat else "srow"
            self.line(f"{q} = ({y}.to(torch.float32) / {srow}).clamp(-448.0, 448.0).to(FP8)")
            self.outs.insert(0, q)
        elif kind == "scale_vec":  # a scale per column
            self.line(f"{q} = ({y}.to(torch.float32) / svec).clamp(-448.0, 448.0).to(FP8)")
            self.outs.insert(0, q)
        elif kind == "token_vllm":
            m = self.fresh("m")
            self.line(f"{m} = {y}.abs().amax(dim=-1).unsqueeze(-1).to(torch.float32)")
            self.line(f"{sc} = ({m} / 448.0).clamp(min=1.0 / (448.0 * 512.0))")
            self.line(f"{q} = ({y}.to(torch.float32) * {sc}.reciprocal()).clamp(-448.0, 448.0).to(FP8)")
            self.outs[:0] = [q, sc]
        elif kind == "token_torchao":
            m = self.fresh("m")
            self.line(f"{m} = {y}.to(torch.float32).abs().amax(-1, keepdim=True).clamp(min=1e-12)")
            self.line(f"{sc} = {m} / 448.0")
            self.line(f"{q} = ({y}.to(torch.float32) / {sc}).clamp(-448.0, 448.0).to(FP8)")
            self.outs[:0] = [q, sc]
        else:
            g = self.fresh("g")
            self.line(f"{g} = {y}.view(-1, {hid // 128}, 128)")
            m = self.fresh("m")
            self.line(f"{m} = {g}.abs().max(dim=-1, keepdim=True)[0].float()")
            self.line(f"{sc} = ({m} / 448.0).clamp(min=1.0 / (448.0 * 512.0))")
            self.line(f"{q} = ({g} / {sc}).clamp(-448.0, 448.0).to(FP8).view({y}.shape)")
            self.outs[:0] = [q, sc]
        self.recipe["fp8"] = kind

    def extras(self, a: str, h: str, y: str, native: bool) -> None:
        """Other users of the pattern's values: outputs, adds, another norm."""
        options = {"h_out": 4, "none": 5, "a_out": 1, "a_add": 0.7, "h_plus": 0.7,
                   "second_norm_y": 1, "second_layer": 1.5, "h_norm_again": 0.5}
        if native:
            options.update(var_out=0.7, normed_out=0.7, inv_out=0.3)
        kinds = [self.pick(f"extra#{i}", options) for i in range(self.rng.choice([1, 1, 2]))]
        hid = self.hidden
        for kind in kinds:
            if kind == "none":
                continue
            if kind == "h_out" and h != a:
                self.outs.append(h)
            elif kind == "a_out":
                self.outs.append(a)
            elif kind == "a_add":
                self.outs.append(f"({a} * 2 + 1)")
            elif kind == "h_plus":
                self.outs.append(f"({h} + 1)")
            elif kind == "var_out":
                self.outs.append(self.var)
            elif kind == "normed_out":
                self.outs.append(self.normed)
            elif kind == "inv_out" and getattr(self, "inv", None):
                self.outs.append(self.inv)
            elif kind == "second_norm_y":
                z = self.fresh("z")
                self.line(f"{z} = F.rms_norm({y}.to(DT), ({hid},), w2, 1e-6)")
                self.outs.append(z)
            elif kind == "h_norm_again":
                z = self.fresh("z")
                self.line(f"{z} = F.rms_norm({h}, ({hid},), w2, 1e-5)")
                self.outs.append(z)
            elif kind == "second_layer":  # the next layer: y -> (matmul) -> all-reduce -> norm
                z = self.fresh("z")
                b = self.all_reduce(f"({y}.to(DT) @ MIX)")
                hh = self.fresh("hh")
                self.line(f"{hh} = {b} + {h if h != a else 'r' + ('.view(-1, %d)' % hid if self.flat else '')}")
                v = self.fresh("v")
                self.line(f"{v} = {hh}.float()")
                self.line(f"{z} = w2 * ({v} * torch.rsqrt({v}.pow(2).mean(-1, keepdim=True) + 1e-6)).to(DT)")
                self.outs += [z, hh]

    def build(self) -> Case:
        rng = self.rng
        self.dt = self.pick("dtype", {"bfloat16": 5, "float32": 3, "float16": 2})
        self.hidden = int(self.pick("hidden", {"64": 5, "128": 4, "256": 2, "96": 1, "48": 1,
                                               "33": 0.6, "7": 0.4, "130": 0.5, "12": 0.5}))
        self.tokens = int(self.pick("tokens", {"1": 1, "3": 1, "8": 2, "17": 1}))
        self.three_d = self.pick("rank3", {"no": 4, "yes": 1}) == "yes"
        self.wdt = self.pick("wdtype", {"model": 4, "float32": 1 if self.dt != "float32" else 0})
        self.dynamic = self.pick("dynamic", {"mark": 3, "static": 2, "true": 2})
        self.flat = False
        self.vllm_sum = None
        two = self.pick("all_reduces", {"one": 12, "two_summed": 1, "two_chained": 0.5})
        a = self.all_reduce("x")
        if two == "two_summed":
            b = self.all_reduce("(x * 0.5)")
            c = self.fresh("a")
            self.line(f"{c} = {a} + {b}")
            a = c
        elif two == "two_chained":
            c = self.all_reduce(f"({a} * 0.5)")
            a = c
        la = self.layout(a, "layout_ar")
        h, rkind = self.residual(la)
        h = self.layout(h, "layout_h")
        norm = self.pick("norm", {"native": 10, "F.rms_norm": 2, "F.rms_norm_default_eps": 1,
                                  "F.rms_norm_no_weight": 1, "nn.RMSNorm": 1.5,
                                  "F.rms_norm_two_dims": 0.3})
        native = norm == "native"
        y = self.native_norm(h) if native else self.library_norm(h)
        if rkind == "after":
            y2 = self.fresh("y")
            r = "r.view(-1, %d)" % self.hidden if self.flat else "r"
            self.line(f"{y2} = {y} + {r}")
            y = y2
        self.fp8(y)
        self.extras(a, h, y, native)
        return Case(self.seed, self.render(), dict(self.recipe))

    def render(self) -> str:
        hid, t = self.hidden, self.tokens
        shape = f"(2, {t}, {hid})" if self.three_d else f"({t}, {hid})"
        rows = f"(2, {t}, 1)" if self.three_d else f"({t}, 1)"
        wdt = "DT" if self.wdt == "model" else "torch.float32"
        norm_mod = ""
        if self.recipe.get("norm") == "nn.RMSNorm":
            eps = self.rng.choice(["None", "1e-6", "1e-5", "0.25"])
            norm_mod = (f"NORM = torch.nn.RMSNorm({hid}, eps={eps}, dtype={wdt}).requires_grad_(False)\n"
                        f"with torch.no_grad():\n"
                        f"    NORM.weight.copy_(1 + 0.1 * torch.randn({hid}, "
                        f"generator=torch.Generator().manual_seed({self.seed % 1000})))\n")
        outs = ", ".join(self.outs) + ("," if len(self.outs) == 1 else "")
        recipe = ", ".join(f"{k}={v}" for k, v in self.recipe.items())
        return (
            f"# fuzz case {self.seed}: {recipe}\n"
            "import torch\n"
            "import torch.nn.functional as F\n"
            "import torch.distributed._functional_collectives as fc\n\n"
            f"SEED = {self.seed}\n"
            f"DT = torch.{self.dt}\n"
            f"DYNAMIC = {self.dynamic!r}\n"
            "FP8 = torch.float8_e4m3fn\n"
            "GROUP = GROUP_NAME = None  # set by the runner to the ranks' group\n"
            f"MIX = (torch.eye({hid}) + 0.05 * torch.randn({hid}, {hid}, "
            f"generator=torch.Generator().manual_seed(3))).to(DT)\n"
            f"{norm_mod}\n\n"
            "def make_inputs(rank):\n"
            "    g = torch.Generator().manual_seed(SEED)\n"
            f"    r = torch.randn({shape}, generator=g).to(DT)\n"
            f"    r2 = torch.randn({shape}, generator=g).to(DT)\n"
            f"    w = (1 + 0.1 * torch.randn({hid}, generator=g)).to({wdt})\n"
            f"    w2 = (1 + 0.1 * torch.randn({hid}, generator=g)).to({wdt})\n"
            f"    wfull = (1 + 0.1 * torch.randn({shape}, generator=g)).to({wdt})\n"
            "    s = torch.tensor(0.05 + torch.rand((), generator=g).item() * 3)\n"
            f"    srow = 0.05 + torch.rand({rows}, generator=g)\n"
            f"    svec = 0.05 + torch.rand({hid}, generator=g)\n"
            f"    erow = 1e-3 * torch.rand({rows}, generator=g)\n"
            "    et = torch.tensor(10.0 ** -torch.randint(1, 7, (), generator=g).item())\n"
            "    e = float(et)\n"
            "    gx = torch.Generator().manual_seed(SEED * 31 + 7 + rank)\n"
            f"    x = torch.randn({shape}, generator=gx).to(DT)\n"
            "    return (x, r, r2, w, w2, wfull, s, srow, svec, erow, et, e)\n\n\n"
            "def f(x, r, r2, w, w2, wfull, s, srow, svec, erow, et, e):\n"
            + "\n".join(self.body) + "\n"
            f"    return ({outs})\n")


def generate(seed: int) -> Case:
    return _Gen(seed).build()


def case_seeds(seed: int, cases: int) -> list[int]:
    """The case seeds of a run: reproducible from ``seed`` alone."""
    return [seed * 1_000_003 + i for i in range(cases)]


# -- the oracle (runs on each rank) -------------------------------------------------------------

def _load(source: str, name: str) -> dict:
    import torch.distributed as dist

    ns: dict[str, Any] = {"__name__": name}
    exec(compile(source, name, "exec"), ns)
    ns["GROUP"] = dist.group.WORLD
    ns["GROUP_NAME"] = dist.group.WORLD.group_name
    return ns


def _compile_run(ns: dict, args: tuple, pass_obj: Any) -> dict:
    """One compile of ``ns['f']`` with ``pass_obj`` as the post-grad custom pass (or
    None) on fresh Dynamo state; its outputs, and what the pass saw and did."""
    import torch
    from torch._inductor import config

    from fusion_pass import records

    seen: dict[str, Any] = {"calls": 0}
    hook = None
    if pass_obj is not None:
        class Counting(type(pass_obj)):
            def __call__(self, graph):
                seen["calls"] += 1
                seen["before"] = str(graph)
                seen["ars"] = sum(1 for n in graph.nodes if n.op == "call_function"
                                  and n.target is torch.ops._c10d_functional.all_reduce.default)
                super().__call__(graph)
                seen["after"] = str(graph)
                seen["fused_ops"] = sum(
                    1 for n in graph.nodes if n.op == "call_function"
                    and str(getattr(n.target, "namespace", "")) == "fusion_pass")

        hook = Counting.__new__(Counting)
        hook.__dict__.update(pass_obj.__dict__)
    start = len(records.HISTORY)
    torch._dynamo.reset()
    dyn = ns["DYNAMIC"]
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    if dyn == "mark":
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(a, 0)
    elif dyn == "true":  # weights static, as a module's parameters are
        for a in args[3:5]:
            torch._dynamo.mark_static(a)
    with config.patch(post_grad_custom_post_pass=hook):
        assert config.post_grad_custom_post_pass is hook
        fn = torch.compile(ns["f"], fullgraph=True,
                           dynamic={"mark": None, "static": False, "true": True}[dyn])
        out = fn(*args)
    seen["records"] = records.HISTORY[start:]
    seen["out"] = out
    return seen


def _compare(a: Any, b: Any, dt_name: str) -> Optional[str]:
    """None when the fused output ``a`` matches the unfused ``b``, else why not."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        fa, fb = a.float(), b.float()
        bad = (fa - fb).abs() > 0.25 * torch.maximum(fa.abs(), fb.abs()) + 2.0 ** -9
        bad &= ~(fa.isnan() & fb.isnan())
        if bad.any():
            return f"{int(bad.sum())} FP8 codes differ beyond a step: {fa[bad][:4].tolist()} vs {fb[bad][:4].tolist()}"
        return None
    if not a.dtype.is_floating_point:
        return None if torch.equal(a, b) else "integer outputs differ"
    tol = max(DTYPES[dt_name], DTYPES.get(str(a.dtype).replace("torch.", ""), 0))
    fa, fb = a.double(), b.double()
    scale = max(1.0, float(fb[fb.isfinite()].abs().max()) if fb.isfinite().any() else 1.0)
    try:
        torch.testing.assert_close(fa, fb, rtol=tol, atol=2 * tol * scale, equal_nan=True)
    except AssertionError as e:
        return " ".join(str(e).split("\n")[:4])
    return None


def _sabotaged_pass() -> Any:
    """The pass with every fused op's epsilon raised by 1: what the oracle must call wrong."""
    from fusion_pass import AllReduceRMSNormFusionPass

    class EpsPlusOne(AllReduceRMSNormFusionPass):
        def __call__(self, graph):
            super().__call__(graph)
            for n in graph.nodes:
                if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "fusion_pass":
                    args = list(n.args)
                    args[3] = args[3] + 1.0
                    n.args = tuple(args)

    return EpsPlusOne()


def check_case(source: str, name: str, always_baseline: bool = False,
               sabotage: bool = False) -> dict:
    """Run one case (both ranks call this in lockstep): ``{"status", "fused", "sites", "why"}``.

    A graph the pass left exactly as it was is what Inductor compiles without the pass,
    so the second compile is skipped there unless ``always_baseline``."""
    import torch

    from fusion_pass import AllReduceRMSNormFusionPass

    ns = _load(source, name)
    rank = torch.distributed.get_rank()
    args = ns["make_inputs"](rank)
    try:
        eager = ns["f"](*args)  # the generator's own check: the code runs
    except Exception as e:  # noqa: BLE001
        return dict(status="invalid", why=f"eager: {type(e).__name__}: {e}", fused=0, sites=0)
    dt_name = str(ns["DT"]).replace("torch.", "")
    t0 = time.perf_counter()
    try:
        on = _compile_run(ns, args, _sabotaged_pass() if sabotage else AllReduceRMSNormFusionPass())
    except Exception:  # noqa: BLE001
        raised = traceback.format_exc()
        try:  # torch itself may not compile the case: then it says nothing of the pass
            _compile_run(_load(source, name + "_off"), args, None)
        except Exception as e:  # noqa: BLE001
            return dict(status="invalid", fused=0, sites=0,
                        why=f"torch does not compile it: {type(e).__name__}: {str(e)[:300]}")
        return dict(status="wrong", why="compile with the pass raised:\n" + raised[-3000:],
                    fused=0, sites=0)
    problems = []
    sites = [s for g in on["records"] for s in g.sites]
    fused_sites = sum(s.fused for s in sites)
    if on["calls"] != 1 or len(on["records"]) != 1:
        problems.append(f"the pass ran {on['calls']} time(s), {len(on['records'])} graph record(s)")
    elif len(sites) != on["ars"]:
        problems.append(f"{on['ars']} all-reduce(s) in the graph, {len(sites)} record(s)")
    if on.get("fused_ops", 0) != fused_sites:
        problems.append(f"{fused_sites} site(s) recorded fused, {on.get('fused_ops')} fused op(s) in the graph")
    unchanged = on.get("before") == on.get("after")
    if fused_sites == 0 and not unchanged:
        problems.append("no site fused but the graph changed")
    t1 = time.perf_counter()
    recs = "; ".join(f"{s.norm}:{s.path}:{s.reason}" for s in sites)
    if unchanged and fused_sites == 0 and not always_baseline:
        status = "wrong" if problems else "unfused"
        return dict(status=status, why="\n".join(problems), fused=0, sites=len(sites),
                    records=recs, t_on=t1 - t0, t_off=0.0)
    ns_off = _load(source, name + "_off")  # a fresh code object: Dynamo holds nothing of the first
    try:
        off = _compile_run(ns_off, args, None)
    except Exception:  # noqa: BLE001
        return dict(status="invalid", why="compile without the pass raised:\n" + traceback.format_exc(),
                    fused=fused_sites, sites=len(sites))
    t2 = time.perf_counter()
    if off["records"]:
        problems.append("the compile without the pass recorded sites")
    outs_on, outs_off = on["out"], off["out"]
    if len(outs_on) != len(outs_off):
        problems.append(f"{len(outs_on)} outputs vs {len(outs_off)}")
    for i, (a, b) in enumerate(zip(outs_on, outs_off)):
        why = _compare(a, b, dt_name)
        if why is not None:
            problems.append(f"output {i}: {why}")
    del eager
    status = "wrong" if problems else ("fused" if fused_sites else "unfused")
    return dict(status=status, why="\n".join(problems), fused=fused_sites, sites=len(sites),
                records=recs, t_on=t1 - t0, t_off=t2 - t1)


def _rank_main(rank: int, world_size: int, port: int, seeds: list[int], sources: dict,
               log_dir: str, always_baseline: bool, sabotage: frozenset) -> None:
    """One rank: every case in order, each verdict appended to its JSON-lines log as it
    comes (a rank that dies leaves the case it was on in the log)."""
    import datetime
    import json
    import logging

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    # A cache hit would skip the pass; the C++ kernel cache stays on (compile time only).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    logging.getLogger("fusion_pass").setLevel(logging.ERROR)
    import warnings
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=600))
    try:
        with open(os.path.join(log_dir, f"rank{rank}.jsonl"), "a", buffering=1) as log:
            for seed in seeds:
                log.write(json.dumps({"start": seed}) + "\n")
                res = check_case(sources[seed], f"fuzz_case_{seed}", always_baseline,
                                 seed in sabotage)
                res["seed"] = seed
                log.write(json.dumps(res) + "\n")
    finally:
        dist.destroy_process_group()


def _read_log(path: str) -> tuple[dict, Optional[int]]:
    import json

    done, current = {}, None
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                d = json.loads(line)
                if "start" in d:
                    current = d["start"]
                else:
                    done[d["seed"]] = d
                    current = None
    return done, current


def run(seeds: list[int], sources: Optional[dict] = None, progress: bool = False,
        always_baseline: bool = False, sabotage: Iterable[int] = ()) -> list[dict]:
    """Every case on 2 gloo ranks; a case is wrong if it is wrong on either rank.  A rank
    that dies makes the case it was running wrong (with its exit code).  The cases in
    ``sabotage`` run with :func:`_sabotaged_pass` (the oracle's own check)."""
    import tempfile

    import torch.multiprocessing as mp

    from fusion_pass.testing.spawn import free_port

    sources = sources or {s: generate(s).source for s in seeds}
    ctx = mp.get_context("spawn")
    results: dict[int, dict] = {}
    todo = list(seeds)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="fuzz_pass_") as log_dir:
        while todo:
            for name in os.listdir(log_dir):
                os.remove(os.path.join(log_dir, name))
            port = free_port()
            procs = [ctx.Process(target=_rank_main, args=(r, 2, port, todo, sources, log_dir,
                                                               always_baseline,
                                                               frozenset(sabotage)))
                     for r in range(2)]
            for p in procs:
                p.start()
            shown = 0
            while any(p.is_alive() for p in procs):
                time.sleep(2)
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(5)  # the other rank may be blocked in a collective
                    for p in procs:
                        if p.is_alive():
                            p.kill()
                    break
                if progress:
                    done0 = _read_log(os.path.join(log_dir, "rank0.jsonl"))[0]
                    n = len(done0)
                    if n // 25 > shown // 25:
                        shown = n
                        bad = sum(r["status"] == "wrong" for r in results.values()) + sum(
                            r["status"] == "wrong" for r in done0.values())
                        print(f"fuzz: {len(results) + n}/{len(seeds)} cases, {bad} wrong so far "
                              f"(rank 0), {(len(results) + n) / (time.time() - t0):.2f} cases/s",
                              file=sys.stderr, flush=True)
            for p in procs:
                p.join()
            logs = [_read_log(os.path.join(log_dir, f"rank{r}.jsonl")) for r in range(2)]
            finished = [s for s in todo if all(s in done for done, _ in logs)]
            for s in finished:
                per_rank = [done[s] for done, _ in logs]
                results[s] = next((r for r in per_rank if r["status"] == "wrong"), None) \
                    or next((r for r in per_rank if r["status"] == "invalid"), None) or per_rank[0]
            rest = [s for s in todo if s not in results]
            if rest:
                dead = rest[0]
                codes = [p.exitcode for p in procs]
                results[dead] = dict(seed=dead, status="wrong", fused=0, sites=0,
                                     why=f"a rank died on this case (exit codes {codes})")
                rest = rest[1:]
            todo = rest
    return [results[s] for s in seeds]


def summary(results: list[dict]) -> str:
    n = len(results)
    fused = sum(r["status"] == "fused" for r in results)
    unfused = sum(r["status"] == "unfused" for r in results)
    wrong = sum(r["status"] == "wrong" for r in results)
    return f"fuzz: {n} cases, {fused} fused, {unfused} unfused, {wrong} wrong"


def write_failures(results: list[dict], sources: dict, out_dir: str) -> list[str]:
    paths = []
    for r in results:
        if r["status"] in ("wrong", "invalid"):
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"case_{r['seed']}_{r['status']}.py")
            why = "\n".join("# " + line for line in r["why"].splitlines())
            with open(path, "w") as fh:
                fh.write(f"# seed {r['seed']}: {r['status']}\n{why}\n"
                         f"# records: {r.get('records', '')}\n"
                         f"# re-run: python tests/fuzz_pass.py --replay {path}\n")
                fh.write(sources[r["seed"]])
            paths.append(path)
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--out", default="fuzz_failures", help="folder for wrong cases")
    p.add_argument("--replay", nargs="*", default=[], help="case files to re-run")
    p.add_argument("--always-baseline", action="store_true",
                   help="compile without the pass even where the pass left the graph unchanged")
    p.add_argument("--show", type=int, help="print the source of one case seed and exit")
    a = p.parse_args(argv)
    if a.show is not None:
        print(generate(a.show).source)
        return 0
    if a.replay:
        sources = {}
        for i, path in enumerate(a.replay):
            with open(path) as fh:
                sources[-1 - i] = fh.read()
        seeds = list(sources)
    else:
        seeds = case_seeds(a.seed, a.cases)
        sources = {s: generate(s).source for s in seeds}
    t0 = time.time()
    results = run(seeds, sources, progress=True, always_baseline=a.always_baseline)
    dt = time.time() - t0
    for r in results:
        if r["status"] in ("wrong", "invalid"):
            print(f"case {r['seed']} {r['status']}: {r['why'].splitlines()[0] if r['why'] else ''}")
    paths = write_failures(results, sources, a.out)
    if paths:
        print(f"{len(paths)} case(s) written to {a.out}")
    invalid = sum(r["status"] == "invalid" for r in results)
    if invalid:
        print(f"{invalid} case(s) torch itself does not compile (neither fused nor unfused)")
    print(f"{len(results) / dt:.2f} cases/s over {dt:.0f} s")
    print(summary(results))
    return 1 if any(r["status"] == "wrong" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
