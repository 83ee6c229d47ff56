"""The generator: seeded graphs around all-reduce -> (+ residual) -> RMSNorm, and near misses.

A case is Python source generated from one integer seed: a function ``f`` that
all-reduces ``x`` and runs norm-like code drawn from the spellings the pass
accepts (:data:`MISSES` names the near misses beside them), ``make_inputs(rank)``,
and what the runner needs to know (``DT``, ``DYNAMIC``, ``NEEDS_VLLM``,
``PASS_OPTIONS``).  Half the cases aim at the pattern, half at one to three near
misses; the same seed always gives the same source.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

@dataclass
class Case:
    seed: int
    source: str
    recipe: dict = field(default_factory=dict)


MISSES = {
    "layout_ar": {"cast_roundtrip", "view_flat", "unflatten", "transposed_copy", "transpose",
                  "view_half_rows"},
    "residual": {"twice", "row_bias", "scaled_after"},
    "eps": {"row_tensor", "from_input"},
    "upcast": {"none"},
    "mean": {"unsqueeze", "sum_div", "part_row", "other_dim", "all"},
    "rsqrt": {"pow_half"},
    "weight": {"none", "added", "row_2d", "full", "gemma_wrong_side", "w_plus_1"},
    "norm": {"F.rms_norm_no_weight", "F.rms_norm_two_dims", "vllm_ir.rms_norm_partial",
             "vllm_ir.rms_norm_no_weight"},
    "mid_cast": {"var_rounded", "inv_rounded", "normed_half", "sq_rounded"},
    "x_layout": {"column_major"},
    "ir_weight": {"other_16bit"},
    "extra": {"a_out", "a_add", "var_out", "normed_out", "inv_out"},
    "all_reduces": {"two_summed", "two_chained"},
    "fp8": {"scale_row", "scale_vec"},
    "hidden": {"33", "7", "130", "12"},
}
"""Options that take the graph off the pattern (or off what the pass fuses today);
a case aims at one to three of these keys, or at none (half of the cases)."""
MISSES["layout_h"] = MISSES["layout_ar"]

MULTIPLIERS = {"none": 6, "literal": 2, "literal_left": 1, "buffer": 1, "fp32_0d": 1,
               "vector": 0.5, "promoting": 0.5}
"""A scalar multiplier of the reduced value before the residual add (Granite's literal,
Gemma's buffer of the model dtype, an fp32 0-dim tensor), and its near misses: a
[hidden] factor, and a one-element fp32 tensor that promotes a 16-bit sum (fp32 keeps
the dtype: that one fuses).  Drawn from a generator of its own, so that the other
options of a seed stay what they were."""
MULTIPLIER_MISSES = {"vector", "promoting"}

class _Gen:
    """Builds one case's source from a seeded ``random.Random``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.mult_rng = random.Random(seed * 7919 + 17)
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
        form = self.pick(f"ar_form#{self.tmp}", {"fc": 3, "ops": 2, "vllm": 1.5})
        self.all_reduces += 1
        out = self.fresh("a")
        if form == "fc":
            self.line(f"{out} = fc.all_reduce({src}, 'sum', GROUP)")
        elif form == "vllm":
            self.line(f"{out} = torch.ops.vllm.all_reduce({src}, TP)")
            self.needs_vllm = True
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
            # A column-major x's sum has no view of rows: reshape copies it.
            flat = "reshape" if self.x_layout == "column_major" else "view"
            self.line(f"{out} = {a}.{flat}(-1, {h})")
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
                                      "scaled": 0.5, "scaled_after": 0.5})
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
            self.vllm_sum, self.vllm_h = s, h
        elif kind == "row_bias":  # a [hidden] addend, not a residual of the input's shape
            self.line(f"{h} = {a} + {r}[0]")
        elif kind == "scaled":  # Granite's residual + c * all_reduce(x)
            self.line(f"{h} = {a} * 0.5 + {r}")
        elif kind == "scaled_after":  # the sum scaled after the residual add
            self.line(f"{h} = ({a} + {r}) * 0.5")
        return h, kind

    def multiplier(self, a: str) -> str:
        """``a`` times a scalar, or a near miss of one (:data:`MULTIPLIERS`); ``a`` itself
        for ``none``."""
        options = dict(MULTIPLIERS)
        if not self.miss_keys:  # a case aimed at the pattern draws no near miss
            options = {k: v for k, v in options.items() if k not in MULTIPLIER_MISSES}
        names = list(options)
        kind = self.mult_rng.choices(names, weights=[options[n] for n in names])[0]
        self.recipe["multiplier"] = kind
        if kind == "none":
            return a
        m = self.fresh("m")
        c = repr(self.mult_rng.choice([0.22, 12.0, -0.5, 2.0, 0.015625]))
        src = {"literal": f"{a} * {c}", "literal_left": f"{c} * {a}",
               "buffer": f"{a} * s.to(DT)", "fp32_0d": f"{a} * s",
               "vector": f"{a} * svec.to(DT)", "promoting": f"{a} * s.reshape(1)"}[kind]
        self.line(f"{m} = {src}")
        return m

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
        # vLLM normalises the unrounded fp32 sum, where no view stands between it and h.
        if self.recipe.get("residual") == "vllm_fp32" and self.rng.random() < 0.7 \
                and h == self.vllm_h:
            v = self.vllm_sum
            self.recipe["norm_of"] = "fp32_sum"
        sq = self.pick("square", {"pow": 3, "mul": 2, "square": 2, "starstar": 1})
        sq_src = {"pow": f"{v}.pow(2)", "mul": f"({v} * {v})", "square": f"torch.square({v})",
                  "starstar": f"({v} ** 2)"}[sq]
        # A rounding between the norm's steps changes its values (unless DT is fp32).
        mid = self.pick("mid_cast", {"none": 20, "var_rounded": 1, "inv_rounded": 1,
                                     "normed_half": 1, "sq_rounded": 1})
        if mid == "sq_rounded":
            sq_src = f"{sq_src}.to(DT).float()"
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
        if mid == "var_rounded":
            self.line(f"{var} = {var}.to(DT).float()")
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
            if mid == "inv_rounded":
                inv_src = f"{inv_src}.to(DT).float()"
            self.line(f"{iv} = {inv_src}")
            self.line(f"{n} = {iv} * {v}" if order else f"{n} = {v} * {iv}")
            self.inv = iv
        if mid == "normed_half":  # rounded to fp16, not to the input dtype, before the weight
            n2 = self.fresh("n")
            self.line(f"{n2} = {n}.to(torch.float16).float()")
            n = n2
        self.var, self.normed = var, n
        wt = self.pick("weight", {"left": 4, "right": 3, "gemma": 2, "gemma3": 1.5,
                                  "fp32_mul": 1.5, "none": 1, "added": 0.7, "row_2d": 0.5,
                                  "full": 0.5, "gemma_wrong_side": 0.5, "w_plus_1": 0.5,
                                  "gemma_16bit": 0.7})
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
        elif wt == "gemma_16bit":  # 1 + w summed in the weight's dtype (rounded there)
            self.line(f"{y} = ({n} * (1.0 + {w})).to(DT)")
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
        elif kind.startswith("vllm_ir.rms_norm"):
            eps = self.rng.choice(["1e-6", "1e-5", "0.5"])
            weight = {"vllm_ir.rms_norm_no_weight": "None"}.get(kind, self.ir_weight())
            part = f"{max(1, hid // 2)}" if kind == "vllm_ir.rms_norm_partial" else "None"
            self.line(f"{y} = torch.ops.vllm_ir.rms_norm({h}, {weight}, {eps}, {part})")
            self.needs_vllm = True
        else:
            self.line(f"{y} = NORM({h})")
        return y

    def ir_weight(self) -> str:
        """The weight handed to a vllm_ir norm: as stored, fp32, or Gemma's ``1 + w``."""
        kind = self.pick("ir_weight", {"w": 4, "float": 1, "gemma": 1, "gemma_16bit": 0.7,
                                       "other_16bit": 0.5})
        other = "torch.float16" if self.dt == "bfloat16" else "torch.bfloat16"
        return {"w": "w", "float": "w.float()", "gemma": "(w.float() + 1.0)",
                "gemma_16bit": "(w + 1.0)", "other_16bit": f"w.to({other})"}[kind]

    def fused_add_norm(self, a: str) -> tuple[str, str]:
        """vLLM's ``vllm_ir.fused_add_rms_norm(a, r)``: ``(y, h)``."""
        y, h = self.fresh("y"), self.fresh("h")
        r = "r.view(-1, %d)" % self.hidden if self.flat else "r"
        order = self.pick("ir_add_order", {"ar_first": 3, "residual_first": 1})
        first, second = (a, r) if order == "ar_first" else (r, a)
        eps = self.rng.choice(["1e-6", "1e-5"])
        self.line(f"{y}, {h} = torch.ops.vllm_ir.fused_add_rms_norm({first}, {second}, "
                  f"{self.ir_weight()}, {eps}, None)")
        self.needs_vllm = True
        return y, h

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
                                               "2048": 0.3,
                                               "33": 0.6, "7": 0.4, "130": 0.5, "12": 0.5}))
        # 81 and 130: above the one-stage limit of the token schedules (80).
        self.tokens = int(self.pick("tokens", {"1": 1, "3": 1, "8": 2, "17": 1, "81": 0.4,
                                               "130": 0.4}))
        # A column-major x: the all-reduce's input is not contiguous (no fused kernel reads it).
        self.x_layout = self.pick("x_layout", {"contiguous": 8, "column_major": 1})
        self.three_d = self.pick("rank3", {"no": 4, "yes": 1}) == "yes"
        self.wdt = self.pick("wdtype", {"model": 4, "float32": 1 if self.dt != "float32" else 0})
        self.dynamic = self.pick("dynamic", {"mark": 3, "static": 2, "true": 2})
        self.flat = False
        self.vllm_sum = self.vllm_h = None
        self.needs_vllm = False
        self.all_reduces = 0
        # The merge of summed all-reduces is off by default; cases try it on too.
        self.merge = self.pick("merge_summed", {"off": 3, "on": 1}) == "on"
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
        norm = self.pick("norm", {"native": 10, "F.rms_norm": 2, "F.rms_norm_default_eps": 1,
                                  "F.rms_norm_no_weight": 1, "nn.RMSNorm": 1.5,
                                  "F.rms_norm_two_dims": 0.3, "vllm_ir.rms_norm": 1,
                                  "vllm_ir.fused_add_rms_norm": 1.2,
                                  "vllm_ir.rms_norm_partial": 0.3,
                                  "vllm_ir.rms_norm_no_weight": 0.3})
        native = norm == "native"
        la = self.multiplier(self.layout(a, "layout_ar"))
        if norm == "vllm_ir.fused_add_rms_norm":  # the residual add is inside the op
            y, h = self.fused_add_norm(la)
            rkind = "in_norm"
        else:
            h, rkind = self.residual(la)
            h = self.layout(h, "layout_h")
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
            f"NEEDS_VLLM = {self.needs_vllm!r}  # vLLM's ops: the runner sets up its TP group\n"
            f"ALL_REDUCES = {self.all_reduces}\n"
            f"PASS_OPTIONS = {dict(merge_summed_all_reduces=True) if self.merge else {}!r}\n"
            "FP8 = torch.float8_e4m3fn\n"
            "GROUP = GROUP_NAME = TP = None  # set by the runner to the ranks' groups\n"
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
            + ("    x = x.transpose(-2, -1).contiguous().transpose(-2, -1)\n"
               if self.x_layout == "column_major" else "") +
            "    return (x, r, r2, w, w2, wfull, s, srow, svec, erow, et, e)\n\n\n"
            "def f(x, r, r2, w, w2, wfull, s, srow, svec, erow, et, e):\n"
            + "\n".join(self.body) + "\n"
            f"    return ({outs})\n")


def generate(seed: int) -> Case:
    return _Gen(seed).build()


def case_seeds(seed: int, cases: int) -> list[int]:
    """The case seeds of a run: reproducible from ``seed`` alone."""
    return [seed * 1_000_003 + i for i in range(cases)]

