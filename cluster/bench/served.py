"""``tandem bench served``: the served path against vLLM's server, under vLLM's own client.

One run starts, one after the other (never two at once), ``tandem serve CONFIG`` and vLLM's
CPU OpenAI server (the ``vllm_cpu.sh`` anchor, the same model, dtype, ``--max-num-seqs`` and
the config's ``max_model_len``) in both of its core placements on a small machine: its default (engine
bound to some cores, one reserved for its front end) and every core for its engine
(``VLLM_CPU_NUM_OF_RESERVED_CPU=0``). Each server gets every cell: a dataset (128-token
random prompts, Tandem's instruction prompts, and on request HumanEval completions ``code``
and agent conversations ``agentic``, :mod:`cluster.bench.workloads`, written as vLLM's
``custom`` dataset before any server starts) at a request rate (2/s with 64 prompts, and
saturation, ``inf`` with 100), driven by ``vllm.benchmarks.serve`` from the vLLM tier's
environment (``vllm_client.py``). Tandem is compared with the better vLLM placement of each
cell (the one with the higher output throughput). With ``--rounds N`` they take turns N times
(Tandem, vLLM, Tandem, vLLM), each round compared within itself and the median ratio judged, so
a slow spell of the machine falls on both. With ``--warm-prompts N`` every server first
answers the set's last N code or agentic prompts (never measured) before each cell, as a replica
that has served such requests (its suffix trees and prefix cache warm).

While a cell runs, on either server, the CPU taken by every process is sampled from /proc
(``proc_cpu.py``, with the client's own beside it), and on Tandem the engine core's step
timeline is read from ``/debug/timeline``, so the report says where the machine's time went.
Last, Tandem's engine runs the saturation and closed-loop cells offline in this process (the
same prompts' shapes and settings, all requests at once or as many in flight as the cell
allows, ``served_offline.py``) and the report gives served / offline output throughput, TTFT
and TPOT. Each cell also reads the servers' ``/metrics`` counters (preemptions, drafts, draft tokens
accepted) before and after it (``server_readings.py``). With ``--vllm-group NAME`` no peer server
starts: CONFIG's cluster serves the cells pinned to its native group and to its vLLM group NAME in
turn (``X-Tandem-Group``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from cluster.bench.benchmark import Benchmark
from cluster.bench.offline import concrete_dtype
from cluster.bench.proc_cpu import ProcessCpuSampler
from cluster.bench.served_offline import offline_engine_figures
from cluster.bench.served_report import FIGURES, print_served_report, server_ratios, speculation_gains
from cluster.bench.server_readings import counter_figures, read_counters, read_timeline
from cluster.bench.servers import (DEFAULT_ANCHOR, VLLM_ALL_CORES, python_with_vllm, start_anchor,
                                   start_or_report, start_tandem, start_vllm_anchor)
from cluster.bench.workloads.prompt_sets import VLLM_DATASETS, VllmDataset, write_vllm_dataset
from cluster.config import group_engine_config, load_config
from cluster.models.loader import load_tokenizer, resolve_model

VLLM_PLACEMENTS = {"vllm-default": {}, "vllm-all-cores": VLLM_ALL_CORES}
LLAMACPP_ANCHOR = DEFAULT_ANCHOR.with_name("llamacpp_cpu.sh")
# llama-server as the anchor starts it: 2 threads (-t, -tb), 16 slots of continuous batching (-np 16, -c 32768)
WARM_CONCURRENCY = 8  # requests in flight while a server answers --warm-prompts


def cells(args: argparse.Namespace) -> list[dict]:
    out = []
    for dataset in args.datasets:
        for rate in args.rates:
            num = args.num_prompts_saturated if rate == "inf" else args.num_prompts
            out.append({"name": f"{dataset} @ {rate}/s", "dataset": dataset, "rate": rate, "num_prompts": num})
        for concurrency in args.max_concurrency:  # closed loop: at most this many requests in flight
            out.append({"name": f"{dataset} @ c={concurrency}", "dataset": dataset, "rate": "inf",
                        "num_prompts": args.num_prompts, "concurrency": concurrency})
    return out


def _client(args, url: str, cell: dict, out: Path) -> dict:
    cmd = [args.python_vllm, "-m", "cluster.bench.vllm_client", "--url", url, "--model", args.served_model_name,
           "--tokenizer", args.tokenizer, "--dataset", cell["dataset"], "--rate", cell["rate"],
           "--num-prompts", str(cell["num_prompts"]), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--seed", str(args.seed), "--out", str(out)]
    if cell.get("concurrency"):
        cmd += ["--max-concurrency", str(cell["concurrency"])]
    if cell.get("group"):  # a group of one Tandem cluster (--vllm-group)
        cmd += ["--header", f"X-Tandem-Group={cell['group']}"]
    if args.temperature is not None:
        cmd += ["--temperature", str(args.temperature)]
    if args.honor_eos:
        cmd.append("--honor-eos")
    dataset = args.dataset_files.get(cell["dataset"])
    if dataset is not None:
        path = dataset.warm_path if cell.get("warm") else dataset.path
        cmd += ["--dataset-path", str(path)] + (["--skip-chat-template"] if dataset.skip_chat_template else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout_s)
    if done.returncode != 0 or not out.exists():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise RuntimeError(f"vLLM's client exited with {done.returncode}:\n{tail}")
    result = json.loads(out.read_text())
    return {key: result.get(key) for key in FIGURES} | {"completed": result.get("completed"),
                                                         "num_prompts": cell["num_prompts"]}


def _warm(args, url: str, cell: dict, out: Path) -> float | None:
    """``--warm-prompts``: the server answers the dataset's other prompts, WARM_CONCURRENCY at a time and
    not measured, before the cell (a replica that has served such requests); the seconds it took."""
    if not args.warm_prompts:
        return None
    started = time.monotonic()
    _client(args, url, {"dataset": cell["dataset"], "rate": "inf", "num_prompts": args.warm_prompts,
                        "concurrency": WARM_CONCURRENCY, "warm": True, "group": cell.get("group")}, out)
    return time.monotonic() - started


def _measure_system(args, console, name: str, start, work: Path, is_tandem: bool,
                    group: str | None = None) -> dict:
    """Every cell on one server (each request pinned to ``group`` where given); with
    ``--fresh-server-per-cell`` on a server of its own each (so no cell finds another's prompts in
    the prefix cache or the suffix trees)."""
    todo = [cell | {"group": group} for cell in cells(args)]
    if not args.fresh_server_per_cell:
        return _measure_cells(args, console, name, start, work, is_tandem, todo)
    results = {}
    for cell in todo:
        results.update(_measure_cells(args, console, name, start, work, is_tandem, [cell]))
    return results


def _measure_cells(args, console, name: str, start, work: Path, is_tandem: bool, todo: list[dict]) -> dict:
    server = start_or_report(console, name, start)
    if isinstance(server, dict):
        return {cell["name"]: server for cell in todo}
    results = {}
    try:
        for cell in todo:
            console.print(f"  {name}: {cell['name']} ({cell['num_prompts']} prompts)")
            sampler = ProcessCpuSampler()
            sampler.start()
            started = time.monotonic()
            try:
                out = work / ("".join(c for c in f"{name}-{cell['name']}" if c.isalnum() or c in "-_=.") + ".json")
                warm_s = _warm(args, server.url, cell, out.with_name(f"warm-{out.name}"))
                started = time.monotonic()
                before = read_counters(server.url)
                results[cell["name"]] = _client(args, server.url, cell, out)
                results[cell["name"]].update(counter_figures(before, read_counters(server.url)))
                if warm_s is not None:
                    results[cell["name"]]["warm_s"] = warm_s
            except Exception as err:
                results[cell["name"]] = {"error": str(err)}
                console.print(f"[red]    failed:[/] {err}")
            results[cell["name"]]["cpu"] = sampler.stop()
            results[cell["name"]]["wall_s"] = time.monotonic() - started
            if is_tandem:
                results[cell["name"]]["engine_timeline"] = read_timeline(server.url, results[cell["name"]]["wall_s"])
    finally:
        server.stop()
    return results


def measure_served(args: argparse.Namespace, console: Console) -> dict:
    """Every cell on Tandem, then on each vLLM placement (``--rounds`` times in turn), then offline;
    returns the JSON result."""
    args.python_vllm = args.python_vllm or python_with_vllm()
    if args.python_vllm is None:
        raise ValueError("vLLM's client needs an interpreter with vLLM: pass --python-vllm, or build the vLLM "
                         "tier's environment (tests/vllm/make_env.sh)")
    if not args.skip_vllm and not Path(args.vllm_script).is_file():
        raise ValueError(f"the vLLM anchor script {args.vllm_script} does not exist (--vllm-script)")
    args.tokenizer = args.tokenizer or subprocess.run([str(args.vllm_script), "model"], capture_output=True,
                                                      text=True, check=True).stdout.strip().splitlines()[-1]
    if args.vllm_dtype == "tandem":
        args.vllm_dtype = tandem_dtype(args.config)
    if args.warm_prompts and set(args.datasets) - set(VLLM_DATASETS):
        raise ValueError(f"--warm-prompts answers other prompts of {' and '.join(VLLM_DATASETS)} only: drop "
                         f"{', '.join(sorted(set(args.datasets) - set(VLLM_DATASETS)))} from --datasets")
    if args.speculation_alternatives and not args.speculation_ab:
        raise ValueError("--speculation-alternatives are served in the A/B rounds: give --speculation-ab ROUNDS too")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if args.rounds > 1 and (args.speculation_ab or (args.skip_vllm and not args.llamacpp)):
        raise ValueError("--rounds alternates Tandem with its peers: it takes neither --speculation-ab (its own rounds) "
                         "nor --skip-vllm without --llamacpp")
    if args.llamacpp and not Path(args.llamacpp_script).is_file():
        raise ValueError(f"the llama.cpp anchor script {args.llamacpp_script} does not exist (--llamacpp-script)")
    if args.vllm_group:
        return _measure_groups(args, console)
    runs = speculation_runs(args)
    alternatives = {name: str(config) for name, config, _ in runs[1:-1]}
    work = Path(tempfile.mkdtemp(prefix="tandem-served-"))
    args.dataset_files = write_datasets(args, work, console)
    systems = {}
    for round_ in range(args.speculation_ab):  # A B A B: the config as it is (and each alternative), then none
        for name, config, speculation in runs:
            key = name if args.speculation_ab == 1 else f"{name} #{round_ + 1}"
            systems[key] = _measure_system(args, console, key, lambda c=config, s=speculation: start_tandem(
                key, c, s, sys.executable), work, True)
    vllm_args = ["--dtype", args.vllm_dtype, "--max-num-seqs", str(args.max_num_seqs),
                 "--max-model-len", str(tandem_max_model_len(args.config))]  # the same prompts fit both
    speculative = json.loads(args.vllm_speculative_config) if args.vllm_speculative_config else None
    for round_ in range(args.rounds):  # T V T V: Tandem, then each vLLM placement, in every round
        suffix = "" if args.rounds == 1 else f" #{round_ + 1}"
        if not args.speculation_ab:
            systems["tandem" + suffix] = _measure_system(args, console, "tandem" + suffix, lambda: start_tandem(
                "tandem", args.config, True, sys.executable), work, True)
        if not args.skip_vllm:
            for name, env in ((name, VLLM_PLACEMENTS[name]) for name in args.vllm_placements):
                systems[name + suffix] = _measure_system(args, console, name + suffix, lambda n=name, e=env: (
                    start_vllm_anchor(n, args.vllm_script, speculative, vllm_args, e)), work, False)
        if args.llamacpp:
            systems["llamacpp" + suffix] = _measure_system(args, console, "llamacpp" + suffix, lambda: start_anchor(
                "llamacpp", args.llamacpp_script, shlex.split(args.llamacpp_args), None, "llama-server"), work, False)
    offline = {}
    for cell in cells(args):
        if cell["rate"] == "inf" and not args.skip_offline:
            console.print(f"[bold]offline engine[/]: {cell['name']}")
            offline[cell["name"]] = offline_engine_figures(args.config, cell["dataset"], cell["num_prompts"],
                                                           args.input_len, args.output_len, args.seed,
                                                           cell.get("concurrency"), args.temperature,
                                                           ignore_eos=not args.honor_eos)
    return {"config": str(args.config), "machine_cores": _cores(), "systems": systems, "offline": offline,
            "speculation_gain": speculation_gains(systems),
            "speculation_gain_alternatives": {name: speculation_gains(systems, name) for name in alternatives},
            "vllm_ratios": server_ratios(systems),
            "llamacpp_ratios": server_ratios(systems, "llamacpp"),
              "settings": {"client": "vllm.benchmarks.serve (backend vllm, streamed completions, "
                                     + ("EOS honoured, " if args.honor_eos else "ignore_eos, ")
                                     + ("no sampling settings sent: temperature 1)" if args.temperature is None
                                        else f"temperature {args.temperature})"),
                           "max_concurrency": args.max_concurrency, "fresh_server_per_cell": args.fresh_server_per_cell,
                           "speculation_ab_rounds": args.speculation_ab, "rounds": args.rounds,
                           "warm_prompts": args.warm_prompts,
                           "speculation_alternatives": alternatives,
                           "vllm_speculative_config": args.vllm_speculative_config,
                           "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                           "vllm": {"dtype": args.vllm_dtype, "max_num_seqs": args.max_num_seqs,
                                    "placements": {name: VLLM_PLACEMENTS[name] for name in args.vllm_placements}},
                           "tandem": "tandem serve CONFIG: every core to the engine replica (num_cpus), "
                                     "engine core process, direct ingress",
                           "llamacpp": None if not args.llamacpp else
                           "llama-server on the model's GGUF file, 2 threads, 16 slots of 2,048 tokens (continuous "
                           "batching)" + (f", {args.llamacpp_args}" if args.llamacpp_args else "")}}


def _measure_groups(args: argparse.Namespace, console: Console) -> dict:
    """``--vllm-group NAME``: CONFIG's cluster serves every cell pinned (``X-Tandem-Group``) to its first
    native group, reported as ``tandem``, and again to the vLLM group NAME, reported as the peer
    ``vllm-group``, each on a cluster started for it; the server runs in an interpreter with vLLM."""
    config = load_config(args.config)
    groups = {group.name: group for group in config.serve.groups}
    vllm_engine = {name for name, group in groups.items() if group.engine.get("backend") == "vllm"}
    if args.vllm_group not in vllm_engine:
        raise ValueError(f"--vllm-group {args.vllm_group}: {args.config} has no replica group of that name with "
                         f"engine: vllm (its groups: {', '.join(groups)})")
    native = next((name for name in groups if name not in vllm_engine), None)
    if native is None:
        raise ValueError(f"--vllm-group: {args.config} has no native group to compare the vLLM group with")
    if args.speculation_ab or args.rounds > 1 or args.llamacpp:
        raise ValueError("--vllm-group compares two groups of one cluster: it takes no --speculation-ab, --rounds "
                         "or --llamacpp")
    python = python_with_vllm()
    if python is None:
        raise ValueError("a cluster with a vLLM group needs an interpreter with Tandem and vLLM: build the vLLM "
                         "tier's environment (tests/vllm/make_env.sh)")
    work = Path(tempfile.mkdtemp(prefix="tandem-served-"))
    args.dataset_files = write_datasets(args, work, console)
    systems = {}
    for name, group in (("tandem", native), ("vllm-group", args.vllm_group)):
        systems[name] = _measure_system(args, console, name, lambda n=name: start_tandem(n, args.config, True, python),
                                        work, True, group)
    return {"config": str(args.config), "machine_cores": _cores(), "systems": systems, "offline": {},
            "vllm_ratios": server_ratios(systems), "settings": {
                "client": "vllm.benchmarks.serve (backend vllm, streamed completions)", "groups": {
                    "tandem": native, "vllm-group": args.vllm_group}, "server_python": python,
                "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed}}


def speculation_runs(args: argparse.Namespace) -> list[tuple[str, Path, bool]]:
    """One A/B round's Tandem servers, in order: (name, config, speculation on): CONFIG as it is
    (``tandem``), each of ``--speculation-alternatives`` (``tandem:<file stem>``), then CONFIG without
    speculation (``tandem-no-spec``)."""
    alternatives = [(f"tandem:{Path(path).stem}", Path(path), True) for path in args.speculation_alternatives]
    names = [name for name, _, _ in alternatives]
    if len(set(names)) != len(names):
        raise ValueError(f"--speculation-alternatives: two configs share a file name ({', '.join(names)}); "
                         "their runs are named after it")
    return [("tandem", Path(args.config), True), *alternatives, ("tandem-no-spec", Path(args.config), False)]


def write_datasets(args, work: Path, console: Console) -> dict[str, VllmDataset]:
    """vLLM's custom dataset of each of ``code`` and ``agentic`` in ``--datasets``, written into
    ``work`` (agentic rendered with the served model's tokenizer) before any server starts."""
    wanted = [name for name in args.datasets if name in VLLM_DATASETS]
    if not wanted:
        return {}
    config = load_config(args.config)
    model = group_engine_config(config, config.serve.groups[0].name).model
    tokenizer = load_tokenizer(resolve_model(model.model, model.cache_dir))
    return {name: write_vllm_dataset(name, work / f"{name}.jsonl", tokenizer, console.print, args.warm_prompts)
            for name in wanted}


def tandem_max_model_len(config_path) -> int:
    """The served config's (first) group's ``model.max_model_len``, given to vLLM's server too: a
    prompt one server takes and the other refuses would compare different requests."""
    config = load_config(config_path)
    return group_engine_config(config, config.serve.groups[0].name).model.max_model_len


def tandem_dtype(config_path) -> str:
    """The dtype the served config's (first) group computes in on this machine ('auto' made
    concrete), so vLLM computes in the same one (bfloat16 where the CPU has it natively, float32
    on plain AVX2)."""
    config = load_config(config_path)
    model = group_engine_config(config, config.serve.groups[0].name).model
    return concrete_dtype(model.dtype, resolve_model(model.model, model.cache_dir))


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def add_served_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("config", nargs="?", default="configs/local.yaml", help="the Tandem config served (default configs/local.yaml)")
    add("--datasets", nargs="+", choices=["random", "instructions", *VLLM_DATASETS], default=["random", "instructions"],
        help="random and instructions (the default), code (HumanEval completions), agentic (tool-calling agent "
             "conversations, made once with SmolLM2 and cached)")
    add("--rates", nargs="*", default=["2", "inf"], help="request rates per second ('inf': all at once); none: "
        "only the --max-concurrency cells")
    add("--max-concurrency", nargs="*", type=int, default=[],
        help="also a closed-loop cell per value: --num-prompts requests, at most this many in flight")
    add("--temperature", type=float, default=None, help="sent with every request (default: none sent, the "
        "servers' default of 1; 0: greedy)")
    add("--speculation-ab", type=int, default=0, metavar="ROUNDS",
        help="Tandem as configured and again with speculative.method none, alternating, ROUNDS times each")
    add("--speculation-alternatives", nargs="*", default=[], metavar="CONFIG",
        help="with --speculation-ab: more Tandem configs (another speculative method, k, controller) served in "
             "each round beside CONFIG and none, each one's gain over none reported")
    add("--rounds", type=int, default=1,
        help="Tandem and each vLLM placement served in turn, ROUNDS times (T V T V), so the machine's drift "
             "falls on both; each round's ratios and their median are reported")
    add("--fresh-server-per-cell", action="store_true",
        help="a server of its own for every cell (no cell finds another's prompts in the caches or suffix trees)")
    add("--vllm-speculative-config", default=None, help="vLLM's --speculative-config (JSON), e.g. "
        '\'{"method": "suffix", "num_speculative_tokens": 8}\'')
    add("--warm-prompts", type=int, default=0, metavar="N",
        help="code and agentic: before every cell each server answers the set's last N prompts (never measured), "
             f"{WARM_CONCURRENCY} at a time, unmeasured, as a replica that has served such requests")
    add("--skip-offline", action="store_true", help="no offline engine run of the saturation and closed-loop cells")
    add("--num-prompts", type=int, default=64, help="prompts per cell at a finite rate")
    add("--num-prompts-saturated", type=int, default=100, help="prompts per cell at rate inf")
    add("--input-len", type=int, default=128, help="random prompts' length")
    add("--output-len", type=int, default=128, help="every request's output tokens (ignore_eos)")
    add("--honor-eos", action="store_true",
        help="outputs end where the model ends them, at most --output-len tokens (default: exactly that many, so "
             "closed-loop requests with speculation off finish and start again in waves)")
    add("--seed", type=int, default=0)
    add("--served-model-name", default="smollm2-135m-instruct")
    add("--vllm-script", type=Path, default=DEFAULT_ANCHOR, help="vLLM's CPU anchor script (vllm_cpu.sh)")
    add("--vllm-dtype", default="tandem",
        help="vLLM server's --dtype (default 'tandem': the dtype the served config resolves to here)")
    add("--max-num-seqs", type=int, default=64, help="vLLM server's --max-num-seqs (Tandem: its config)")
    add("--vllm-placements", nargs="+", choices=list(VLLM_PLACEMENTS), default=list(VLLM_PLACEMENTS),
        help="vLLM's core placements to serve (default both; the better one per cell is compared)")
    add("--python-vllm", default=None, help="interpreter with vLLM for the client (default: the vLLM tier's)")
    add("--tokenizer", default=None, help="tokenizer folder for the client (default: the anchor's model folder)")
    add("--skip-vllm", action="store_true", help="no vLLM server")
    add("--vllm-group", metavar="NAME", help="CONFIG has a native group and the vLLM group NAME: serve the cells "
        "through that one cluster pinned to each group in turn (X-Tandem-Group) instead of beside vLLM's server")
    add("--llamacpp", action="store_true",
        help="also serve llama.cpp's llama-server (the llamacpp_cpu.sh anchor, after its setup) in every round")
    add("--llamacpp-args", default="", metavar="ARGS",
        help="llama-server's own arguments beyond the anchor's, one string: --llamacpp-args='--spec-type ngram-mod'")
    add("--llamacpp-script", type=Path, default=LLAMACPP_ANCHOR, help="llama.cpp's CPU anchor script")
    add("--cell-timeout-s", type=float, default=900.0)


SERVED = Benchmark("served", "tandem serve against vLLM's server under vLLM's own client, at 2 requests/s and at "
                   "saturation, with the offline engine beside", add_served_args, measure_served,
                   print_served_report, default_json=Path("bench-served.json"))
