"""The run of ``validate.py``: the checks in order, on tiny models built here, the embedded model
when it is available, and the throughput table. ``checks.py`` and ``throughput.py`` say what each
measures; this file picks models, prompts and settings, and turns exceptions into reports.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import carry
from report import CheckResult

EMBEDDED = "smollm2-135m-instruct"
TINY_CHECKS = ("parity/tiny-llama", "parity/tiny-qwen2", "parity/tiny-opt", "parity/tiny-llama-gather",
               "parity/tiny-llama-flex", "speculative/tiny-ngram", "speculative/tiny-draft",
               "speculative/tiny-eagle3", "kv/preemption", "kv/preemption-draft", "sync/tiny-llama",
               "sync/tiny-eagle3", "lora/tiny-llama", "core/tiny-llama")
EMBEDDED_CHECKS = ("embedded/weights", "parity/smollm2-135m", "speculative/smollm2-ngram",
                   "speculative/smollm2-eagle3")
ALL_CHECKS = (*TINY_CHECKS, *EMBEDDED_CHECKS, "throughput")


class Run:
    """The checks of one run, in order, each timed. An exception becomes ``error``, except an
    AssertionError (the engine helpers' invariant checks), which is ``failed``."""

    def __init__(self, only: tuple[str, ...] = ()) -> None:
        """``only``: run just the checks whose names start with one of these (``--only``)."""
        self.results: list[CheckResult] = []
        self.only = only

    def add(self, result: CheckResult) -> None:
        self.results.append(result)
        print(f"{result.status:>7}  {result.name:<28} {result.seconds:7.1f}s  {result.detail}", flush=True)

    def skip_all(self, names, status: str, why: str) -> None:
        for name in names:
            self.add(CheckResult(name, status, why))

    def section(self, names, fn):
        """``fn()``, which records some of ``names``; if it raises, each of ``names`` it had not
        recorded yet becomes an error naming the exception. Returns what ``fn`` returned, or None."""
        try:
            return fn()
        except Exception as err:  # the report must come back whatever broke
            done = {r.name for r in self.results}
            tail = traceback.format_exc().strip().splitlines()[-8:]
            for name in names:
                if name not in done:
                    self.add(CheckResult(name, "error", f"{type(err).__name__}: {err}", {"traceback": tail}))
            return None

    def check(self, name: str, fn, *args, **kwargs) -> None:
        if self.only and not name.startswith(self.only):
            self.add(CheckResult(name, "skipped", f"not selected (--only {','.join(self.only)})"))
            return
        start = time.perf_counter()
        try:
            result = fn(name, *args, **kwargs)
        except AssertionError as err:
            result = CheckResult(name, "failed", f"an invariant did not hold: {err}",
                                 {"traceback": traceback.format_exc().strip().splitlines()[-6:]})
        except Exception as err:  # the report must come back whatever broke
            result = CheckResult(name, "error", f"{type(err).__name__}: {err}",
                                 {"traceback": traceback.format_exc().strip().splitlines()[-8:]})
        result.seconds = round(time.perf_counter() - start, 2)
        self.add(result)


def tiny_models(work: Path) -> dict[str, Path]:
    """Random-weight Llama, Qwen2 and OPT folders (as the unit tests' fixtures), a noisy Llama
    draft and a random EAGLE-3 head for the Llama."""
    from cluster.models.tiny import (save_noisy_draft, save_tiny_model, save_tiny_tokenizer, tiny_llama_config,
                                     tiny_opt_config, tiny_qwen2_config)
    from cluster.models.tiny_head import save_random_head

    made = {}
    for name, config, seed in (("llama", tiny_llama_config(), 0), ("qwen2", tiny_qwen2_config(), 1),
                               ("opt", tiny_opt_config(), 0)):
        made[name] = save_tiny_model(config, work / name, seed=seed)
        save_tiny_tokenizer(made[name])
    made["noisy-draft"] = save_noisy_draft(made["llama"], work / "noisy-draft")
    save_tiny_tokenizer(made["noisy-draft"])
    made["eagle3-head"] = save_random_head(tiny_llama_config(), work / "eagle3-head", draft_vocab=64)
    return made


def run_tiny(run: Run, device: str, models: dict[str, Path]) -> None:
    import checks

    parity_prompts = checks.random_prompts(1, (5, 17, 41, 3, 64))
    for family in ("llama", "qwen2", "opt"):
        run.check(f"parity/tiny-{family}", checks.parity, models[family], device, parity_prompts, 24, num_blocks=128)
    # model.attention auto is flex on CUDA and gather on the CPU: each path named, on every device.
    for attention in ("gather", "flex"):
        run.check(f"parity/tiny-llama-{attention}", checks.parity, models["llama"], device, parity_prompts, 24,
                  num_blocks=128, attention=attention)
    prompts, llama = checks.random_prompts(0, (5, 17, 30, 3, 44, 9)), str(models["llama"])
    draft = dict(method="draft", draft_model=str(models["noisy-draft"]), num_speculative_tokens=3)
    run.check("speculative/tiny-ngram", checks.speculative, llama, device, prompts, 20,
              dict(method="ngram", num_speculative_tokens=4), num_blocks=128)
    run.check("speculative/tiny-draft", checks.speculative, llama, device, prompts, 20, draft, num_blocks=128)
    run.check("speculative/tiny-eagle3", checks.speculative, llama, device, prompts, 20,
              dict(method="eagle3", draft_model=str(models["eagle3-head"]), num_speculative_tokens=4), num_blocks=128)
    # Blocks of 16: flex attention (model.attention auto on CUDA) takes powers of two from 16 up.
    tight = dict(num_blocks=7, block_size=16, max_num_batched_tokens=16)
    run.check("kv/preemption", checks.preemption, llama, device, prompts, 20, tight)
    run.check("kv/preemption-draft", checks.preemption, llama, device, prompts, 20, tight, **draft)
    run.check("sync/tiny-llama", checks.no_host_sync, llama, device, prompts, 20, num_blocks=128)
    run.check("sync/tiny-eagle3", checks.no_host_sync, llama, device, prompts, 20, num_blocks=128, method="eagle3",
              draft_model=str(models["eagle3-head"]), num_speculative_tokens=4)
    run.check("lora/tiny-llama", checks.lora_parity, models["llama"], device, prompts[:3], 24,
              models["llama"].parent, num_blocks=128)
    run.check("core/tiny-llama", checks.engine_core_process, llama, device, prompts, 20,
              dict(method="ngram", num_speculative_tokens=4), num_blocks=128)


def find_embedded(quick: bool, stage: carry.StageReport) -> tuple[Path | None, str]:
    """The embedded model's converted folder, or None and why not. Never downloads: the GPU
    machine has no registry, and pip would wait for one."""
    if quick:
        return None, "--quick: tiny models only"
    from cluster.models.loader import EMBEDDED_MODELS, resolve_model
    from cluster.shared.cache_dir import default_cache_dir

    if stage.model_file is not None:
        os.environ["TANDEM_CACHE_DIR"] = str(stage.model_file.parents[1])  # <stash>/cache: converted there
    elif not (default_cache_dir() / "gguf" / Path(EMBEDDED_MODELS[EMBEDDED].member).name).is_file():
        have = f"; parts here {stage.parts_present}, missing {stage.parts_missing}" if stage.manifest else ""
        return None, f"not carried (tests/gpu/prepare.sh packs it; docs/gpu.md says how to carry it){have}"
    return resolve_model(EMBEDDED).path, ""


def run_embedded(run: Run, device: str, path: Path, stage: carry.StageReport) -> None:
    import checks
    from cluster.bench.offline import PROMPTS
    from cluster.models.hf_folder import ModelSource
    from cluster.models.loader import load_tokenizer

    def same_weights(name: str) -> CheckResult:
        packed = (stage.manifest or {}).get("model", {}).get("converted")
        if not packed:
            return CheckResult(name, "skipped", "the model was not carried: no packed sha256 to compare with")
        got = carry.sha256_of(path / "model.safetensors")
        ok = got == packed["model.safetensors"]
        return CheckResult(name, "passed" if ok else "failed",
                           "converted here to the model.safetensors it was packed from" if ok else
                           "converted here to other weights than where it was packed", {"sha256": got, **packed})

    run.check("embedded/weights", same_weights)
    prompts = load_tokenizer(ModelSource(EMBEDDED, path))(PROMPTS[:6])["input_ids"]
    kv = dict(kv_cache_memory="256MiB")
    run.check("parity/smollm2-135m", checks.parity, path, device, prompts, 32, **kv)
    run.check("speculative/smollm2-ngram", checks.speculative, str(path), device, prompts, 32,
              dict(method="ngram", num_speculative_tokens=4), **kv)
    run.check("speculative/smollm2-eagle3", checks.speculative, str(path), device, prompts, 32,
              dict(method="eagle3", draft_model=f"{EMBEDDED}-eagle3", num_speculative_tokens=3), **kv)


def throughput_model(quick: bool, models: dict[str, Path], embedded: Path | None,
                     work: Path) -> tuple[str, Path, str]:
    """The embedded model and its shipped EAGLE-3 head; else (not --quick) a random model of its
    shape and a random head for it, since the speed does not depend on the weights' values (the
    head's acceptance does: a random head's drafts are almost never accepted, so its figures bound
    the head's cost); else the tiny Llama and its random head."""
    if embedded is not None:
        return EMBEDDED, embedded, f"{EMBEDDED}-eagle3"
    if quick:
        return "tiny-llama (random)", models["llama"], str(models["eagle3-head"])
    from cluster.models.tiny import save_tiny_model, save_tiny_tokenizer, tiny_llama_config
    from cluster.models.tiny_head import save_random_head
    from cluster.planning.model_shapes import KNOWN_SHAPES

    hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tied = KNOWN_SHAPES["smollm2-135m"]
    config = tiny_llama_config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                               vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=2048)
    path = save_tiny_model(config, work / "smollm2-shaped")
    save_tiny_tokenizer(path)
    head = save_random_head(config, work / "smollm2-shaped-head", draft_vocab=vocab // 2)
    return "smollm2-135m-shaped (random)", path, str(head)


def run_throughput(run: Run, settings: dict, model: str, path: Path, head: str) -> dict | None:
    import throughput
    from cluster.models.hf_folder import ModelSource
    from cluster.models.loader import load_tokenizer

    held = {}

    def measure(name: str) -> CheckResult:
        kv = "64MiB" if settings["quick"] else ("1GiB" if settings["device"] == "cpu" else "4GiB")
        result = throughput.measure(path, load_tokenizer(ModelSource(model, path)), settings["device"],
                                    settings["dtype"], settings["batch_sizes"], settings["output_len"],
                                    settings["repeats"], kv, head)
        result.update(model=model, device=settings["device"])
        held["result"] = result
        return CheckResult(name, "passed", f"{len(result['cells'])} cells, each exactly batch x output_len tokens",
                           {"model": model})

    run.check("throughput", measure)
    return held.get("result")
