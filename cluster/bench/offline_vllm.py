"""vLLM's offline ``LLM.generate`` as the third system of ``tandem bench offline``.

vLLM lives in an environment of its own (its CPU build pins other versions), so it runs
in a child process started with that environment's python: the vLLM test tier's
(``tests/vllm/make_env.sh``, ``~/.cache/tandem/venv-vllm``) unless ``--vllm-python`` names
another. The child loads the same Hugging Face folder Tandem serves, in the same dtype,
prefix caching off, compiled as vLLM does by default (``--vllm-eager`` turns that off), with the parent's thread count
(``OMP_NUM_THREADS``) on every core (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, none reserved for a
front end the offline engine does not have), and answers one
marked JSON line per batch: the prompt token ids in, the number of generated tokens out, greedy
with EOS ignored. The parent times each call, as it times Tandem's and transformers'
``generate``; the pipe adds well under a millisecond to runs of seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_VLLM_PYTHON = Path(os.environ.get("TANDEM_VLLM_VENV", Path.home() / ".cache/tandem/venv-vllm")) / "bin/python"
KV_CACHE_GIB = 2
_ANSWER = "TANDEM "  # the child's answers start with this; vLLM logs to stdout too

# Runs in vLLM's environment: no Tandem imports.
_CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
path, dtype, max_num_seqs, eager = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "eager"
adapters, max_lora_rank = json.loads(sys.argv[5]), int(sys.argv[6])
max_loras = int(sys.argv[7]) or len(adapters)  # vLLM reads an adapter it dropped from its folder again
lora = dict(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_loras,
            max_lora_rank=max_lora_rank) if adapters else {}
llm = LLM(model=path, dtype=dtype, max_num_seqs=max_num_seqs, enable_prefix_caching=False, max_model_len=2048,
          seed=0, enforce_eager=eager, **lora)
requests = {name: LoRARequest(name, i + 1, folder) for i, (name, folder) in enumerate(adapters.items())}
print("TANDEM " + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True)
    names = job.get("adapters")
    kwargs = {"lora_request": [requests[n] if n else None for n in names]} if names else {}
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False,
                        **kwargs)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    print("TANDEM " + json.dumps({"tokens": sum(map(len, ids)), "token_ids": ids}), flush=True)
"""


class VllmRunner:
    """One vLLM engine in a child process; ``generate`` has the other runners' contract."""

    def __init__(self, python: Path, model_path: Path, dtype: str, max_num_seqs: int, threads: int,
                 eager: bool = False, lora_modules: dict[str, str] | None = None, max_lora_rank: int = 64,
                 max_loras: int | None = None) -> None:
        """``eager``: vLLM's ``enforce_eager`` (no graph compilation: starts faster, may run slower);
        ``lora_modules``: LoRA adapters to serve (name -> PEFT folder), for ``generate``'s ``adapters``;
        ``max_loras``: how many vLLM holds at once (``max_loras`` and ``max_cpu_loras``; default all)."""
        if not Path(python).exists():
            raise RuntimeError(f"no vLLM environment at {python}: build it with tests/vllm/make_env.sh "
                               "or pass --vllm-python")
        # vLLM's CPU build binds its engine to all cores but the ones it reserves for a front end (one on
        # a small machine) unless told to reserve none: it gets the cores and threads Tandem gets.
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        self.proc = subprocess.Popen(
            [str(python), "-c", _CHILD, str(model_path), dtype, str(max_num_seqs), "eager" if eager else "compiled",
             json.dumps(lora_modules or {}), str(max_lora_rank), str(max_loras or 0)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env)
        self._read()  # {"ready": true} once the model is loaded

    def _read(self) -> dict:
        """The child's next answer; vLLM's own log lines on stdout pass through to stderr."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the vLLM child process exited (code {self.proc.wait()}); see its log above")
            if line.startswith(_ANSWER):
                return json.loads(line[len(_ANSWER):])
            sys.stderr.write(line)

    def generate(self, prompt_ids: list[list[int]], output_len: int, adapters: list[str | None] | None = None) -> int:
        """Output tokens generated; ``adapters``: each prompt's LoRA adapter (None: the base model).
        The tokens themselves are kept in ``last_token_ids``."""
        self.proc.stdin.write(json.dumps({"prompts": prompt_ids, "output_len": output_len, "adapters": adapters})
                              + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        self.last_token_ids = answer["token_ids"]
        return answer["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
