"""``fusion-pass demo``: real vLLM with tensor parallelism 2, the fusion off and on.

Creates two tiny random-weight Llama checkpoints (hidden 256, and hidden 2880
as in GPT-OSS), runs each through vLLM with ``tensor_parallel_size=2`` twice
(fusion off, fusion on) with greedy sampling, and reports per compiled graph
the all-reduce -> RMSNorm sites found and the gate's decision for each, the
generated token ids of both runs, the time of each run and where the graph
dumps were written.  On a machine without GPUs vLLM's CPU build runs on two
cores; with GPUs, the same command uses two of them.

Every run compiles from scratch (fresh vLLM and Inductor cache directories), so
the pass sees every graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .. import records
from ..environ import patched

PROMPTS = [[1, 17, 42, 99, 7, 300, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
MAX_TOKENS = 8


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int = 2
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 512
    arch: str = "llama"
    """``llama``, ``granite`` (a scalar multiplies every reduced value: the embedding's
    by ``embedding_multiplier``, o_proj's and down_proj's by ``residual_multiplier``)
    or ``gemma3`` (the embedding's times its normalizer buffer; sandwich norms)."""

    def sites(self) -> int:
        """All-reduce -> RMSNorm sites at TP > 1, from the architecture.  Llama and
        Granite, per decoder layer: o_proj -> post-attention norm and down_proj ->
        next norm (the next layer's input norm, or the final norm); Gemma 3, per
        layer: o_proj -> post-attention norm and down_proj -> post-feedforward
        norm (the next norm adds the residual to that norm's output, no sum).
        Plus, in all three, the vocab-parallel embedding's all-reduce -> the first
        layer's input norm."""
        return 2 * self.layers + 1


MODELS = (ModelSpec("llama-h256", hidden=256), ModelSpec("llama-h2880", hidden=2880))


def make_checkpoint(spec: ModelSpec, path: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write a random-weight checkpoint of ``spec.arch`` and a word-level tokenizer to ``path``."""
    import torch
    import transformers

    common = dict(hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                  num_key_value_heads=spec.kv_heads, vocab_size=spec.vocab,
                  max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, torch_dtype=dtype)
    if spec.arch == "granite":  # Granite's head size is hidden / heads
        cfg = transformers.GraniteConfig(embedding_multiplier=12.0, residual_multiplier=0.22,
                                         attention_multiplier=spec.head_dim ** -0.5,
                                         logits_scaling=8.0, **common)
    elif spec.arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(head_dim=spec.head_dim, sliding_window=64,
                                            query_pre_attn_scalar=spec.head_dim, **common)
    else:
        cfg = transformers.LlamaConfig(head_dim=spec.head_dim, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path)
    make_tokenizer(spec.vocab).save_pretrained(path)
    return path


def make_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``w3 .. w{vocab-1}`` (ids 0-2: unk, bos, eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_env() -> dict[str, str]:
    """Settings vLLM's CPU build needs for TP=2 on a small machine (unless set)."""
    n = os.cpu_count() or 2
    half = max(n // 2, 1)
    bind = "0|1" if n < 4 else f"0-{half - 1}|{half}-{2 * half - 1}"
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclass
class RunResult:
    fused: bool
    seconds: float
    token_ids: list[list[int]]
    graphs: list[records.GraphRecord] = field(default_factory=list)


def run_vllm(model: Path, work: Path, *, fusion: bool, tp: int = 2, dtype: str = "bfloat16",
             dump_dir: Optional[Path] = None, prompts: list[list[int]] = PROMPTS,
             max_tokens: int = MAX_TOKENS, compilation: Optional[dict[str, Any]] = None) -> RunResult:
    """One vLLM engine from start to shutdown, compiling from scratch; greedy outputs.

    ``compilation``: the compilation_config to use instead of the helper's
    (fusion on) or vLLM's default (fusion off).  With the fusion on, decision
    records (and graph dumps, when ``dump_dir`` is given) are collected.
    """
    from vllm import LLM, SamplingParams

    from ..vllm_integration import compilation_config

    work.mkdir(parents=True, exist_ok=True)
    # Records are appended: a rerun into the same directory starts from none.
    shutil.rmtree(work / "records", ignore_errors=True)
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    # The engine core runs in this process (one process fewer to start per run).
    env = {"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           records.RECORD_DIR_ENV: str(work / "records"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if on_cpu():
        env.update({k: v for k, v in cpu_env().items() if k not in os.environ})
    cc = compilation
    if cc is None and fusion:
        on_gpu_dump = str(dump_dir) if dump_dir is not None and not on_cpu() else None
        cc = compilation_config(debug_dump_path=on_gpu_dump)
    if fusion and dump_dir is not None and on_cpu():
        from ..vllm_integration.plugin import DEPYF_DIR_ENV

        env[DEPYF_DIR_ENV] = str(dump_dir)
    start = time.perf_counter()
    try:
        with patched(env):
            llm = LLM(str(model), tensor_parallel_size=tp, dtype=dtype, skip_tokenizer_init=True,
                      max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8, seed=0,
                      compilation_config=cc or {})
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                use_tqdm=False)
            ids = [list(o.outputs[0].token_ids) for o in outs]
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    seconds = time.perf_counter() - start
    graphs = records.read_dir(str(work / "records")) if (work / "records").is_dir() else []
    return RunResult(fused=fusion, seconds=seconds, token_ids=ids, graphs=graphs)


def tidy_dumps(root: Path) -> None:
    """Drop what depyf leaves behind in killed processes: lock files, empty
    directories (processes that compiled nothing)."""
    if not root.is_dir():
        return
    for lock in root.rglob("*.lock"):
        lock.unlink(missing_ok=True)
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()


def _graph_json(g: records.GraphRecord) -> dict[str, Any]:
    return {"graph": g.graph, "rank": g.rank, "token_range": g.token_range, "fused": g.fused,
            "sites": [{**s.__dict__} for s in g.sites]}


def run_demo(out: Path, dtype: str = "float32") -> dict[str, Any]:
    start = time.perf_counter()
    device = "cpu" if on_cpu() else "gpu"
    result: dict[str, Any] = {"out_dir": str(out), "device": device, "tensor_parallel_size": 2,
                              "dtype": dtype, "prompts": PROMPTS, "models": []}
    for spec in MODELS:
        base = out / spec.name
        path = make_checkpoint(spec, base / "checkpoint", dtype=dtype)
        off = run_vllm(path, base / "off", fusion=False, dtype=dtype)
        dumps = base / "on" / "dumps"
        on = run_vllm(path, base / "on", fusion=True, dtype=dtype, dump_dir=dumps)
        tidy_dumps(dumps)
        ranks = sorted({g.rank for g in on.graphs}) or [0]
        fused_per_rank = {r: sum(g.fused for g in on.graphs if g.rank == r) for r in ranks}
        result["models"].append({
            "name": spec.name, "hidden": spec.hidden, "layers": spec.layers,
            "checkpoint": str(path), "expected_sites": spec.sites(),
            "fused_per_rank": fused_per_rank,
            "graphs": [_graph_json(g) for g in on.graphs],
            "runs": {"off": {"seconds": round(off.seconds, 1), "token_ids": off.token_ids},
                     "on": {"seconds": round(on.seconds, 1), "token_ids": on.token_ids}},
            "identical": off.token_ids == on.token_ids,
            "dumps": str(dumps), "records": str(base / "on" / "records"),
        })
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["ok"] = all(m["identical"] and all(v == m["expected_sites"]
                                              for v in m["fused_per_rank"].values())
                       for m in result["models"])
    return result


def format_text(result: dict[str, Any]) -> str:
    lines = [f"fusion-pass demo: vLLM, tensor_parallel_size=2 on {result['device']}, "
             f"{result['dtype']}, greedy, {len(result['prompts'])} prompts x {MAX_TOKENS} tokens"]
    for m in result["models"]:
        lines.append("")
        lines.append(f"== {m['name']} (hidden {m['hidden']}, {m['layers']} layers; "
                     f"{m['expected_sites']} all-reduce -> RMSNorm sites expected per rank)")
        for g in m["graphs"]:
            lines.append(f"  graph {g['graph']} rank {g['rank']} tokens {g['token_range']}: "
                         f"{len(g['sites'])} site(s), {g['fused']} fused")
            for s in g["sites"]:
                lines.append(f"    {s['collective']} -> {s['norm']}, hidden {s['hidden']} "
                             f"{s['dtype']}, tokens {s['tokens']}: {s['path']} ({s['reason']})")
        for k in ("off", "on"):
            r = m["runs"][k]
            lines.append(f"  fusion {k:3}: {r['seconds']:6.1f} s  token ids {r['token_ids']}")
        lines.append(f"  outputs identical: {m['identical']}")
        lines.append(f"  graph dumps: {m['dumps']}")
        lines.append(f"  decision records: {m['records']}")
    lines.append("")
    lines.append(f"total {result['seconds']:.1f} s; {'OK' if result['ok'] else 'FAILED'}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fusion-pass demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="model dtype (default float32: the fused op rounds the pre-norm "
                             "sum to the model dtype before normalising, vLLM's native norm "
                             "does not, and random-weight models have near-tied logits, so "
                             "in 16-bit greedy tokens can legitimately differ)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for checkpoints, dumps and records (default: a new "
                             "temporary directory, kept)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="fusion-pass-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    # The report is the only thing on stdout: vLLM and its worker processes
    # (which inherit the descriptor) write their logs to stderr meanwhile.
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        result = run_demo(out.resolve(), args.dtype)
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
    print(json.dumps(result) if args.json else format_text(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
