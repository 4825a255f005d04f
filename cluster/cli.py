"""The ``tandem`` command.

    tandem generate "prompt" [--chat] [--config configs/local.yaml] [--max-tokens N] ...
    tandem bench offline [--json PATH] ...
    tandem bench prefix [--json PATH] ...
    tandem bench spec [--json PATH] ...
    tandem bench paper [--json PATH] [--plots DIR] ...
    tandem bench serve [--url URL] [--endpoint completions|chat] [--dataset NAME] [--json PATH] ...
    tandem bench served [CONFIG] [--datasets ...] [--rates ...] [--vllm-group NAME] [--json PATH] ...
    tandem bench router [CONFIG] [--slow-factor F] [--request-rate R] ...
    tandem bench quant | lora | structured [--json PATH] ...
    tandem bench show RESULT.json [--plots DIR]   (any bench command's saved result, printed again)
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
import importlib
import logging
import sys

from cluster.config import ConfigError, TandemConfig, add_engine_args, engine_config_from_args, load_config
from cluster.drafts.cli import add_draft_parser
from cluster.engine.llm import LLM, apply_chat_template
from cluster.k8s.cli import add_k8s_parser
from cluster.metrics.cli import add_dashboards_parser
from cluster.planning.cli import add_config_parser
from cluster.planning.memory_plan import check_memory
from cluster.profiling.cli import add_profile_parser
from cluster.shared.sampling_params import SamplingParams

# The tools' own dependencies are extras of the package (pyproject.toml): the server runs without
# them, and a tool whose extra is missing says which one to install.
EXTRAS = {"rich": "bench", "matplotlib": "bench", "aiohttp": "bench", "grafana_client": "dashboards"}


def cmd_generate(args: argparse.Namespace) -> int:
    llm = LLM(config=engine_config_from_args(args))
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


def cmd_serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    serve_overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("router", args.router),
                                         ("api_key", args.api_key)) if v is not None}
    if serve_overrides:
        config = config.model_copy(update={"serve": config.serve.model_copy(update=serve_overrides)})
        config = TandemConfig.model_validate(config.model_dump(exclude_unset=True))  # keeps what the file set
    from deployments.local import start_local  # here, not at the top: the only command that loads Ray

    check_memory(config)
    start_local(config)
    return 0


def _missing_extra(err: ModuleNotFoundError) -> str | None:
    """The extra that provides the module ``err`` could not find (None: not an extra's)."""
    return EXTRAS.get((err.name or "").split(".")[0])


def _add_bench_and_sim(sub) -> None:
    """``tandem bench`` (with ``bench router``, which needs Ray) and ``tandem sim``; their modules
    import the bench extra's packages, so they are imported here, and without that extra the
    commands stay listed and say what to install."""
    bench = _add_tool(sub, "bench", "cluster.bench.cli", "add_bench_parser")
    router = _import_tool("deployments.bench_router") if bench is not None else None
    if router is not None:
        importlib.import_module("cluster.bench.cli").register_benchmark(bench, router.ROUTER)
    _add_tool(sub, "sim", "cluster.sim.cli", "add_sim_parser")


def _import_tool(module: str):
    """The tool's module, or None where an extra it needs is missing (any other import error raises)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if _missing_extra(err) is None:
            raise
        return None


def _add_tool(sub, name: str, module: str, adder: str):
    """Register command ``name`` with ``module.adder(sub)`` (its return value is returned); without
    the extra the module needs, register it as a command that says which extra to install."""
    try:
        return getattr(importlib.import_module(module), adder)(sub)
    except ModuleNotFoundError as err:
        extra = _missing_extra(err)
        if extra is None:
            raise
        parser = sub.add_parser(name, help=f"(needs the {extra} extra: pip install 'tandem-serve[{extra}]')")
        parser.add_argument("rest", nargs=argparse.REMAINDER)
        parser.set_defaults(func=lambda args, err=err: _refuse(args.command, err))
        return None


def _refuse(command: str, err: ModuleNotFoundError) -> int:
    extra = _missing_extra(err)
    print(f"tandem: error: `tandem {command}` needs {err.name}, which comes with the {extra} extra: "
          f"pip install 'tandem-serve[{extra}]' (make install installs every extra)", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """Each command's parser is built beside the command (``add_*_parser``); generate, serve and the
    router benchmark (which needs Ray) are here."""
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
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI API on a local Ray Serve cluster")
    srv.add_argument("config", help="YAML settings file (e.g. configs/local.yaml)")
    srv.add_argument("--host", help="default: serve.host (127.0.0.1)")
    srv.add_argument("--port", type=int, help="default: serve.port (8000)")
    srv.add_argument("--router", choices=["tandem", "pow2"], help="default: serve.router")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    srv.set_defaults(func=cmd_serve)

    add_profile_parser(sub)
    _add_bench_and_sim(sub)
    add_dashboards_parser(sub)
    add_k8s_parser(sub)
    add_draft_parser(sub)
    add_config_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = ["tandem", *argv]  # how the command was called, for the results that record it
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError) as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # a tool that imports its extra's packages when it runs
        if _missing_extra(err) is None:
            raise
        return _refuse(args.command, err)


if __name__ == "__main__":
    sys.exit(main())
