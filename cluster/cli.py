"""The ``tandem`` command.

    tandem generate "prompt" [--chat] [--config configs/local.yaml] [--max-tokens N] ...
    tandem bench offline [--json PATH] ...
    tandem bench prefix [--json PATH] ...
    tandem bench spec [--vllm] [--json PATH] ...
    tandem bench paper [--json PATH] [--plots DIR] ...
    tandem bench serve [--url URL] [--endpoint completions|chat] [--dataset NAME] [--json PATH] ...
    tandem bench compare [CONFIG] [--form peers|groups|both] [--json PATH] ...
    tandem bench served [CONFIG] [--datasets ...] [--rates ...] [--json PATH] ...
    tandem bench router [CONFIG] [--slow-factor F] [--request-rate R] ...
    tandem sim CONFIG [--json PATH] [--plots DIR] [--num-requests N] ...
    tandem profile [CONFIG] [--group NAME] [--out PATH] ...   (a group with engine: vllm is profiled on vLLM)
    tandem serve CONFIG [--host H] [--port P] [--router tandem|pow2]
    tandem k8s render CONFIG --out DIR
    tandem k8s validate [PATH ...]
    tandem dashboards render [--out DIR] [--configmap PATH]
    tandem dashboards push --url URL --token TOKEN [--folder NAME]
    tandem draft distill TARGET OUT --layers N [--steps S] [--batch-size B] [--seq-len L] ...
"""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.config import ConfigError, TandemConfig, group_engine_config, load_config, with_overrides
from cluster.profiling.calibration import ACCEPTANCE_PROMPT_SETS


def _engine_config(args: argparse.Namespace) -> TandemConfig:
    config = load_config(args.config) if args.config else TandemConfig()
    pairs = (("model", args.model), ("dtype", args.dtype), ("device", args.device),
             ("tensor_parallel_size", getattr(args, "tensor_parallel_size", None)))
    overrides = {k: v for k, v in pairs if v is not None}
    return with_overrides(config, **overrides)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML settings file (e.g. configs/local.yaml)")
    parser.add_argument("--model", help="short name, Hugging Face folder or .gguf file")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"])
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--tensor-parallel-size", type=int,
                        help="split the target over this many ranks (processes; GPUs on CUDA)")


def cmd_generate(args: argparse.Namespace) -> int:
    from cluster.engine.llm import LLM, apply_chat_template
    from cluster.shared.sampling_params import SamplingParams

    llm = LLM(config=_engine_config(args))
    prompt = args.prompt
    if args.chat:
        prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    request_id = llm.engine.add_request(prompt, params)
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.request_id == request_id:
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    llm.engine.worker.close()  # tensor-parallel ranks, if any
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import json

    from cluster.engine.engine import Engine
    from cluster.profiling.profiler import power_of_two_sizes, run_profile

    config = _engine_config(args)
    if args.group:
        # A group's profile is measured on its own device with its engine settings and split.
        config = group_engine_config(config, args.group)
        group_tp = config.serve.groups[0].tensor_parallel_size
        if group_tp > 1:
            config = with_overrides(config, tensor_parallel_size=group_tp)
    if config.speculative.method == "none":
        config = with_overrides(config, method="ngram")
    max_batch = args.max_batch or config.scheduler.max_num_seqs
    if config.engine.backend == "vllm":
        from cluster.profiling.vllm_profile import print_grid, run_vllm_profile

        if args.acceptance_prompts != "calibration":
            raise ConfigError(f"--acceptance-prompts {args.acceptance_prompts}: the vLLM profile measures "
                              "acceptance on the calibration prompts only")

        profile, grid = run_vllm_profile(config, power_of_two_sizes(max_batch), args.max_k, args.output_len,
                                         args.repeats or 1)
        print_grid(profile, grid)
    else:
        # The profile is what the controllers will read: make one with the fixed policy.
        engine = Engine(with_overrides(config, controller="fixed", num_speculative_tokens=args.max_k))
        try:
            profile = run_profile(engine, power_of_two_sizes(max_batch), args.max_k, args.context_len,
                                  args.repeats or 3, args.acceptance_prompts)
        finally:
            engine.worker.close()  # tensor-parallel ranks, if any
    profile.save(args.out)
    print(f"device {profile.device}; draft {profile.draft}; acceptance ({profile.acceptance_prompts} prompts) "
          "per position "
          + ", ".join(f"{a:.2f}" for a in profile.acceptance))
    if profile.coverage is not None:
        print("coverage per position (share of positions asked for that got a draft token) "
              + ", ".join(f"{c:.2f}" for c in profile.coverage))
    print(f"fitted step-time model, mean relative error {profile.fit_error:.1%}")
    print("best k per batch size: " + ", ".join(f"{b}: {k}" for b, k in profile.table.items()))
    if args.vllm_schedule:
        print(json.dumps({"num_speculative_tokens_per_batch_size": profile.vllm_schedule()}))
    print(f"wrote {args.out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    serve_overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("router", args.router),
                                         ("api_key", args.api_key)) if v is not None}
    if serve_overrides:
        config = config.model_copy(update={"serve": config.serve.model_copy(update=serve_overrides)})
        config = TandemConfig.model_validate(config.model_dump())
    from cluster.planning.memory_plan import check_memory
    from deployments.local import start_local  # the only command that needs ray

    check_memory(config)
    start_local(config)
    return 0


def cmd_dashboards_render(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cluster.metrics.dashboards import render

    for path in render(Path(args.out), Path(args.configmap) if args.configmap else None):
        print(f"wrote {path}")
    return 0


def cmd_dashboards_push(args: argparse.Namespace) -> int:
    import os

    from cluster.metrics.dashboards import dashboards
    from cluster.metrics.grafana_push import GrafanaPushError, push_dashboards

    url = args.url or os.environ.get("GRAFANA_URL")
    if not url:
        raise ValueError("--url (or GRAFANA_URL) is needed: Grafana's base URL, e.g. http://localhost:3000")
    token = args.token or os.environ.get("GRAFANA_TOKEN", "")
    try:
        pushed = push_dashboards(url, token, list(dashboards().values()), folder=args.folder)
    except GrafanaPushError as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 1
    for dashboard in pushed:
        print(f"pushed {dashboard.title!r} (uid {dashboard.uid}, version {dashboard.version}): {dashboard.url}")
    return 0


def cmd_k8s_render(args: argparse.Namespace) -> int:
    from cluster.k8s.render import render_to

    stale = render_to(args.config, args.out)
    print(f"rendered {args.config} into {args.out}/ (kubectl apply -f {args.out}/)")
    for path in stale:
        print(f"note: {path} was not rendered from this config; delete it if it is stale")
    return 0


def cmd_k8s_validate(args: argparse.Namespace) -> int:
    from cluster.k8s.validate import ManifestValidator

    validator = ManifestValidator.from_repo()
    num_documents = validator.validate_paths(args.paths)
    print(f"{num_documents} manifests valid (Kubernetes {validator.kubernetes_version}, KubeRay CRDs)")
    return 0


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from cluster.bench.offline import run_offline_bench

    run_offline_bench(args)
    return 0


def cmd_bench_prefix(args: argparse.Namespace) -> int:
    from cluster.bench.prefix import run_prefix_bench

    run_prefix_bench(args)
    return 0


def cmd_bench_spec(args: argparse.Namespace) -> int:
    from cluster.bench.spec import run_spec_bench

    run_spec_bench(args)
    return 0


def cmd_bench_paper(args: argparse.Namespace) -> int:
    from cluster.bench.paper import run_paper_bench

    run_paper_bench(args)
    return 0


def cmd_bench_quant(args: argparse.Namespace) -> int:
    from cluster.bench.quant import run_quant_bench

    run_quant_bench(args)
    return 0


def cmd_bench_served(args: argparse.Namespace) -> int:
    from cluster.bench.served import run_served

    run_served(args)
    return 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from cluster.bench.compare import run_compare

    run_compare(args)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from cluster.bench.serve import run_serve_bench

    run_serve_bench(args)
    return 0


def cmd_bench_router(args: argparse.Namespace) -> int:
    from deployments.bench_router import run_router_bench  # needs ray

    run_router_bench(args)
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    from cluster.sim.cli import run_sim

    run_sim(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: speculative decoding LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt on the local engine")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    prof = sub.add_parser("profile", help="measure step times and acceptance; write the k-per-batch-size profile")
    prof.add_argument("config", nargs="?", help="YAML settings file (e.g. configs/local.yaml)")
    prof.add_argument("--out", default="speculation-profile.json", help="where to write the profile JSON")
    prof.add_argument("--max-k", type=int, default=8, help="largest speculation length to measure")
    prof.add_argument("--max-batch", type=int, help="largest batch size (default: scheduler.max_num_seqs)")
    prof.add_argument("--context-len", type=int, default=128, help="context tokens per sequence while timing")
    prof.add_argument("--repeats", type=int, help="timed passes per cell (median is kept; default 3, vLLM 1)")
    prof.add_argument("--output-len", type=int, default=48,
                      help="engine: vllm only: tokens each request generates while its steps are timed")
    prof.add_argument("--acceptance-prompts", choices=ACCEPTANCE_PROMPT_SETS, default="calibration",
                      help="measure acceptance on the mixed calibration chat prompts or on `tandem bench spec`'s "
                           "edit requests (rewrite / summarize / proofread a passage in the prompt)")
    prof.add_argument("--group", help="profile this serve.groups entry (its engine settings), on its device kind")
    prof.add_argument("--vllm-schedule", action="store_true",
                      help="also print the table as vLLM's num_speculative_tokens_per_batch_size")
    prof.add_argument("--model", help="short name, Hugging Face folder or .gguf file")
    prof.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"])
    prof.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    prof.add_argument("--tensor-parallel-size", type=int, help="split the target over this many ranks")
    prof.set_defaults(func=cmd_profile)

    srv = sub.add_parser("serve", help="serve the OpenAI API on a local Ray Serve cluster")
    srv.add_argument("config", help="YAML settings file (e.g. configs/local.yaml)")
    srv.add_argument("--host", help="default: serve.host (127.0.0.1)")
    srv.add_argument("--port", type=int, help="default: serve.port (8000)")
    srv.add_argument("--router", choices=["tandem", "pow2"], help="default: serve.router")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    srv.set_defaults(func=cmd_serve)

    dash = sub.add_parser("dashboards", help="Tandem's Grafana dashboards").add_subparsers(dest="dashboards",
                                                                                           required=True)
    render = dash.add_parser("render", help="write the dashboards' JSON (and the sidecar ConfigMap)")
    render.add_argument("--out", default="k8s/grafana", help="directory for the JSON files")
    render.add_argument("--configmap", help="also write the Grafana sidecar ConfigMap here "
                        "(k8s/monitoring/grafana-dashboards-configmap.yaml)")
    render.set_defaults(func=cmd_dashboards_render)
    push = dash.add_parser("push", help="create or update the dashboards in a Grafana through its HTTP API")
    push.add_argument("--url", help="Grafana's base URL (default: $GRAFANA_URL)")
    push.add_argument("--token", help="service account token or API key, Editor role (default: $GRAFANA_TOKEN)")
    push.add_argument("--folder", default="Tandem", help="folder to put them in, created if missing "
                      "(\"\" = General)")
    push.set_defaults(func=cmd_dashboards_push)

    k8s = sub.add_parser("k8s", help="KubeRay manifests").add_subparsers(dest="k8s", required=True)
    k8s_render = k8s.add_parser("render", help="write the RayService, monitoring and profiling Jobs of a config")
    k8s_render.add_argument("config", help="YAML settings file, e.g. configs/gpu-single.yaml")
    k8s_render.add_argument("--out", required=True, help="directory for the manifests, e.g. k8s/single-gpu")
    k8s_render.set_defaults(func=cmd_k8s_render)
    k8s_validate = k8s.add_parser("validate", help="check manifests offline against Kubernetes' and KubeRay's schemas")
    k8s_validate.add_argument("paths", nargs="*", default=["k8s"], help="YAML files or directories (default: k8s)")
    k8s_validate.set_defaults(func=cmd_k8s_validate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    offline = bench.add_parser("offline", help="output tok/s at several batch sizes, Tandem vs transformers")
    from cluster.bench.offline import add_offline_args

    add_offline_args(offline)
    offline.set_defaults(func=cmd_bench_offline)
    prefix = bench.add_parser("prefix", help="TTFT and multi-turn chat throughput, prefix cache on vs off")
    from cluster.bench.prefix import add_prefix_args

    add_prefix_args(prefix)
    prefix.set_defaults(func=cmd_bench_prefix)
    spec = bench.add_parser("spec", help="tok/s and TPOT per batch size and k, with acceptance; vLLM as a peer")
    from cluster.bench.spec import add_spec_args

    add_spec_args(spec)
    spec.set_defaults(func=cmd_bench_spec)
    paper = bench.add_parser("paper", help="arXiv 2310.18813 here: TPOT vs k per batch, k policies under traffic")
    from cluster.bench.paper import add_paper_args

    add_paper_args(paper)
    paper.set_defaults(func=cmd_bench_paper)
    quant_bench = bench.add_parser("quant", help="int8 kernels, quality and tok/s against float32")
    from cluster.bench.quant import add_quant_args

    add_quant_args(quant_bench)
    quant_bench.set_defaults(func=cmd_bench_quant)
    serve_bench = bench.add_parser("serve", help="load-test an OpenAI-compatible server (vllm bench serve metrics)")
    from cluster.bench.serve import add_serve_args

    add_serve_args(serve_bench)
    serve_bench.set_defaults(func=cmd_bench_serve)
    served_bench = bench.add_parser("served", help="tandem serve against vLLM's server under vLLM's own client, "
                                    "at 2 requests/s and at saturation, with the offline engine beside")
    from cluster.bench.served import add_served_args

    add_served_args(served_bench)
    served_bench.set_defaults(func=cmd_bench_served)
    compare_bench = bench.add_parser("compare", help="one workload against Tandem and vLLM (servers, or the "
                                     "native and vLLM groups of one cluster): ratios")
    from cluster.bench.compare import add_compare_args

    add_compare_args(compare_bench)
    compare_bench.set_defaults(func=cmd_bench_compare)
    from cluster.bench.structured import add_structured_parser

    add_structured_parser(bench)
    router_bench = bench.add_parser("router", help="Tandem's router vs power-of-two choices on a fast+slow cluster")
    from deployments.bench_router import add_router_args

    add_router_args(router_bench)
    router_bench.set_defaults(func=cmd_bench_router)
    sim = sub.add_parser("sim", help="simulate a large heterogeneous cluster: router and controller policies")
    from cluster.sim.cli import add_sim_args

    add_sim_args(sim)
    sim.set_defaults(func=cmd_sim)
    from cluster.drafts.cli import add_draft_parser
    from cluster.planning.cli import add_config_parser

    add_draft_parser(sub)
    add_config_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError) as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
