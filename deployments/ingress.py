"""The OpenAI-compatible HTTP front (FastAPI through ``serve.ingress``).

Parses and validates each request (bad input is a 400 in OpenAI's error shape before
anything is queued), tokenizes it (chat template from the model), picks a replica
group (:class:`GroupRouter`), and streams the replica's deltas back as one JSON body
or as server-sent events. Errors: 400 bad input, 401 wrong or missing API key, 404
unknown model, 429 a replica's queue is full, 503 Serve's queue is full. vLLM's
``/tokenize`` and ``/detokenize`` answer from the ingress's tokenizer, rendering chat
messages exactly as ``/v1/chat/completions`` does. ``/v1/responses`` (OpenAI's Responses API)
and the stored responses are the routes of ``deployments/responses_routes.py`` (a mixin), and
``/health``, ``/metrics`` and ``/debug`` those of ``deployments/operations_routes.py``; the FastAPI
app and OpenAI's error shape are ``deployments/http_app.py``. Once the application drains
(``tandem serve`` stopping), new API calls get a 503 while those in flight finish.

A request may pin its replica group with the header ``X-Tandem-Group: NAME`` (benchmarks
and tests send the same workload to each group, e.g. a native and a vLLM one); the
router then ranks only that group's replicas.

Structured outputs and tools (docs/structured-outputs.md): ``response_format``,
``structured_outputs`` and forced tool calls become the request's one
``SamplingParams.structured_outputs``; tools are rendered into the prompt in the model's
tool-call format (``ModelConfig.tool_call_format``, ``auto`` read from the chat template)
and calls are parsed out of the output.
"""

import importlib.metadata
import logging
import re
import time
import uuid
from functools import partial
from pathlib import Path

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.api.auth import ApiKeys
from cluster.api.errors import renamed_error
from cluster.api.engine_requests import GroupShape, choice_requests, truncated_prompt
from cluster.api.openai_protocol import (
    ChatCompletionRequest,
    ChatPromptFields,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnsupportedFieldError,
)
from cluster.api.openai_responses import Echo, token_id_name
from cluster.api.tool_calls import ToolCallParser
from cluster.api.tool_formats import choose_tool_format, render_chat
from cluster.api.tool_request import NO_TOOLS, ToolPlan, plan_tools
from cluster.config import config_from_dict, group_engine_config
from cluster.hosting.backend import error_param
from cluster.errors import require_unicode
from cluster.kv.prefix_cache import engine_hash_seed
from cluster.metrics.prometheus_sink import PrometheusSink
from cluster.models.loader import load_hf_config, load_tokenizer_if_present, resolve_model
from cluster.models.registry import engine_max_model_len
from cluster.routing.group_router import GroupRouter
from cluster.shared.lora_dir import adapter_folder, is_adapter_name, listed_adapters
from cluster.structured.constraint import StructuredOutputs
from deployments.app_hub import HubReporter
from deployments.feeds import DeltaFeeds
from deployments.http_app import answer, app
from deployments.http_app import error_response as _error
from deployments.ingress_port import reuse_address
from deployments.operations_routes import OperationsRoutes
from deployments.readiness import GroupWatch
from deployments.responses_routes import ResponsesRoutes
from deployments.streams import ChoiceStream, respond

logger = logging.getLogger(__name__)

_REQUEST_KEY = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_key(request: Request) -> str | None:
    """The HTTP request's id: the client's ``X-Request-Id`` (Ray Serve makes one where the client
    sent none, logs it with the request and returns it in the response's header), when it is
    short and plain enough to name engine requests; else None (a fresh id is made)."""
    key = request.headers.get("x-request-id")
    return key if key is not None and _REQUEST_KEY.match(key) else None


@serve.deployment
@serve.ingress(app)
class OpenAIIngress(OperationsRoutes, ResponsesRoutes):
    def __init__(self, config: dict, groups: dict[str, DeploymentHandle],
                 store: DeploymentHandle | None = None) -> None:
        """``store``: the cluster's Responses API store (None: responses are not kept)."""
        reuse_address()  # under direct ingress, Serve starts this replica's listener after this constructor
        self.config = config_from_dict(config, "ingress config")
        serve_config = self.config.serve
        self.groups = groups
        self.store = store
        self.model_name = serve_config.served_model_name or self.config.model.model
        self.api_keys = ApiKeys.from_settings(serve_config.api_key, serve_config.api_key_env, serve_config.api_key_file)
        source = resolve_model(self.config.model.model, self.config.model.cache_dir)
        self.tokenizer = load_tokenizer_if_present(source)
        self.tool_format = choose_tool_format(self.config.model.tool_call_format,
                                              getattr(self.tokenizer, "chat_template", None))
        self.shapes: dict[str, GroupShape] = {}
        self.adapters: dict[str, dict[str, str]] = {}  # LoRA adapter -> {group that serves it: its folder}
        self.lora_dirs: dict[str, str] = {}  # group -> the folder it loads adapters from on demand (model.lora_dir)
        self.priority_groups: set[str] = set()  # groups whose engines schedule by priority (scheduler.policy)
        sizes = {}
        for group in serve_config.groups:
            engine_config = group_engine_config(self.config, group.name)
            model = engine_config.model
            for adapter, folder in model.lora_modules.items():
                self.adapters.setdefault(adapter, {})[group.name] = folder
            if model.lora_dir is not None:
                self.lora_dirs[group.name] = model.lora_dir
            if engine_config.scheduler.policy == "priority":
                self.priority_groups.add(group.name)
            # A group that sets max_model_len needs no model files here (its replicas check it).
            max_model_len = model.max_model_len or engine_max_model_len(
                None, load_hf_config(resolve_model(model.model, model.cache_dir)))
            self.shapes[group.name] = GroupShape(engine_config.cache.block_size,
                                                 engine_hash_seed(model.model, model.dtype, model.seed), max_model_len)
            sizes[group.name] = group.autoscaling.min_replicas if group.autoscaling else group.num_replicas
        decisions = PrometheusSink("ingress")
        for group in sizes:  # every group's retry count from zero, so a rate over it exists before the first
            decisions.inc("tandem_router_retries", 0, (("group", group),))
        # Groups autoscaled to zero replicas do not count against readiness (a request starts one).
        self.required_groups = [name for name, size in sizes.items() if size > 0]
        self._reporter = None
        self.draining = False  # set when the application drains: new API calls get a 503
        try:
            replica = serve.get_replica_context()
        except Exception:  # constructed outside Serve (unit tests)
            self.app_name = None
        else:
            self.app_name = replica.app_name
            self._reporter = HubReporter(self.app_name, {
                "application": self.app_name, "deployment": replica.deployment,
                "replica": replica.replica_id.unique_id}, decisions.exposition,
                in_flight=lambda: sum(self.router.inflight.values()), draining=lambda: self.draining,
                on_drain=self._drain)
        self.router = GroupRouter(sizes, serve_config.router, staleness_seconds=60.0,
                                  on_decision=lambda group: decisions.inc("tandem_router_decisions", 1,
                                                                          (("group", group),)),
                                  on_retry=lambda group: decisions.inc("tandem_router_retries", 1,
                                                                       (("group", group),)))
        self._group_watch = None
        if self.app_name is not None and len(self.required_groups) > 1:
            self._group_watch = GroupWatch(serve.status, self.app_name, self.required_groups,
                                           self.router.set_unavailable)
        self.prefix_blocks = serve_config.prefix_affinity_blocks
        # Tokens come by one feed per replica where Tandem's router can send a feed to the replica it names.
        self.feeds = DeltaFeeds() if serve_config.router == "tandem" else None
        self.created = int(time.time())

    # ---- routes -------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self, request: Request):
        """The served model, then its LoRA adapters (those of ``lora_modules``, then those in each
        ``lora_dir`` this replica can read)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        names = dict.fromkeys([self.model_name, *self.adapters])
        for lora_dir in self.lora_dirs.values():
            names.update(dict.fromkeys(listed_adapters(lora_dir)))
        return {"object": "list", "data": [self._model_card(name) for name in names]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        """OpenAI's retrieve: the served model's or an adapter's card, or 404."""
        if (denied := self._check_key(request)) is not None:
            return denied
        return self._unknown_model(model, required=True) or self._model_card(model)

    def _model_card(self, name: str) -> dict:
        """OpenAI's model object, with vLLM's ``root`` (the model served, or an adapter's folder),
        ``parent`` (an adapter's base model) and ``max_model_len``."""
        groups = self._adapter_groups(name) or self.shapes
        root, parent = self.config.model.model, None
        if name != self.model_name:
            root, parent = next(iter(groups.values())), self.model_name
        return {"id": name, "object": "model", "created": self.created, "owned_by": "tandem", "root": root,
                "parent": parent, "max_model_len": max(self.shapes[group].max_model_len for group in groups)}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self._serve(body, request, chat=True)

    @app.post("/tokenize")
    async def tokenize(self, body: dict, request: Request):
        """vLLM's ``/tokenize``: a ``prompt``, or ``messages`` rendered as chat completions would."""
        if (denied := self._check_key(request)) is not None:
            return denied
        chat = "messages" in body
        try:
            parsed = (TokenizeChatRequest if chat else TokenizeCompletionRequest).model_validate(body)
        except ValidationError as err:
            raise RequestValidationError(err.errors()) from None
        if (unknown := self._unknown_model(parsed.model)) is not None:
            return unknown
        try:
            if chat:
                parsed.check_prompt_fields()
                text = self._chat_text(parsed, plan_tools(parsed.tools, None, True, self.tool_format))
                tokens = self._encode(text, parsed.add_special_tokens, "messages", allow_empty=True)
            else:
                tokens = self._encode(parsed.prompt, parsed.add_special_tokens, allow_empty=True)
        except ValueError as err:
            return _error(400, str(err), param=error_param(err))
        strings = self.tokenizer.convert_ids_to_tokens(tokens) if parsed.return_token_strs else None
        return {"count": len(tokens), "max_model_len": max(s.max_model_len for s in self.shapes.values()),
                "tokens": tokens, "token_strs": strings}

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request):
        """vLLM's ``/detokenize``: token ids to text."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if (unknown := self._unknown_model(body.model)) is not None:
            return unknown
        if self.tokenizer is None:
            return _error(400, "this model has no tokenizer", param="tokens")
        bad = [t for t in body.tokens if not 0 <= t < len(self.tokenizer)]
        if bad:
            return _error(400, f"tokens must be ids in [0, {len(self.tokenizer)}), got {bad[:3]}", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    @app.get("/version")
    async def version(self):
        return {"version": importlib.metadata.version("tandem-serve")}

    # ---- the work -----------------------------------------------------------------
    async def _serve(self, body, request: Request, chat: bool):
        prepared = self._prepare(body, request, chat)
        if isinstance(prepared, JSONResponse):
            return prepared
        streams, make_parser = prepared
        spec_metrics = body.return_spec_decode_metrics or self.config.serve.per_request_spec_decode_metrics != "none"
        return await answer(respond(streams, body, chat, self._answering_model(body.model), self.router,
                                     make_parser, spec_metrics))

    def _prepare(self, body, request: Request, chat: bool, params: dict[str, str] | None = None):
        """The request's choice streams (not started) and its tool-call parser factory, or the
        error response that refuses it (key, model, group pin, any invalid field; ``params`` renames
        the field an error names, for a body that ``body`` was made from)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if (unknown := self._unknown_model(body.model, required=True)) is not None:
            return unknown
        pinned = request.headers.get("x-tandem-group")
        if pinned is not None and pinned not in self.shapes:
            return _error(400, f"X-Tandem-Group names no replica group: {pinned!r}; groups: {', '.join(self.shapes)}")
        adapter_groups = self._adapter_groups(body.model)
        if pinned is not None and adapter_groups and pinned not in adapter_groups:
            return _error(400, f"the replica group {pinned!r} does not serve the LoRA adapter {body.model!r}; groups "
                               f"that do: {', '.join(adapter_groups)}", param="model")
        try:
            body.check_supported()
            plan = body.tool_plan(self.tool_format) if chat else NO_TOOLS
            constraint = body.chat_constraint(plan) if chat else body.output_constraint()
            prompts = self._prompt_token_ids(body, chat, plan)
            widest = max(shape.max_model_len for name, shape in self.shapes.items() if pinned in (None, name))
            truncated = [truncated_prompt(ids, body.truncate_prompt_tokens, widest) for ids in prompts]
            echoes = self._echoes(body, chat, prompts, truncated)
            streams = self._make_requests(body, truncated, chat, pinned, constraint, echoes, request_key(request))
        except ValueError as err:  # a ParamError (most) names its field; error_param reads it
            message, param = renamed_error(str(err), error_param(err), params or {})
            return _error(400, message, param=param)
        # Calls are parsed when tools are offered and the output is free or forced into calls;
        # under a response_format or structured_outputs constraint the output is that format's text.
        make_parser = None
        if plan.parse_calls and constraint is plan.constraint:
            make_parser = partial(ToolCallParser, self.tool_format, plan.max_calls)
        return streams, make_parser

    def _answering_model(self, model: str) -> str:
        """The ``model`` a response names: the adapter asked for, else the served model."""
        return model if self._adapter_groups(model) else self.model_name

    def _adapter_groups(self, name: str | None) -> dict[str, str]:
        """{group: folder} of the groups that serve ``name`` as a LoRA adapter: those whose
        ``lora_modules`` name it, and those whose ``lora_dir`` holds it, or that cannot be read here
        (their engines then answer 404 for a folder that is not there); empty: not an adapter."""
        if name is None or name == self.model_name:
            return {}
        groups = dict(self.adapters.get(name, {}))
        for group, lora_dir in self.lora_dirs.items():
            folder = adapter_folder(lora_dir, name)
            if folder is None and is_adapter_name(name) and not Path(lora_dir).expanduser().is_dir():
                folder = Path(lora_dir).expanduser() / name
            if folder is not None:
                groups.setdefault(group, str(folder))
        return groups

    def _unknown_model(self, model: str | None, required: bool = False) -> JSONResponse | None:
        """The 404 for a model this server does not serve, the base model or an adapter (None may
        be left out where not ``required``)."""
        if model == self.model_name or (model is None and not required) or self._adapter_groups(model):
            return None
        served = ", ".join(repr(name) for name in [self.model_name, *self.adapters])
        if self.lora_dirs:
            served += f" and the adapter folders of {', '.join(sorted(set(self.lora_dirs.values())))}"
        return _error(404, f"the model {model!r} does not exist; this server serves {served}",
                      "not_found_error", "model", "model_not_found")

    def _drain(self) -> None:
        self.draining = True

    def _check_key(self, request: Request) -> JSONResponse | None:
        """The refusal of a call: a 503 once draining (an API call), a 401 without a valid key."""
        if self.draining and request.url.path.startswith("/v1/"):
            return _error(503, "the server is shutting down: send the request again (another replica of the service "
                          "will take it)", "server_error", code="shutting_down")
        reason = self.api_keys.refusal(request.headers.get("authorization", ""))
        if reason is not None:
            return _error(401, f"API key {reason}: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        return None

    def _prompt_token_ids(self, body, chat: bool, plan: ToolPlan) -> list[list[int]]:
        if chat:
            return [self._encode(self._chat_text(body, plan), body.add_special_tokens, "messages")]
        result = []
        for prompt in body.prompts():
            result.append(self._encode(prompt, body.add_special_tokens) if isinstance(prompt, str) else list(prompt))
        return result

    def _echoes(self, body, chat: bool, prompts: list[list[int]], truncated: list[list[int]]) -> list[Echo | None]:
        """Per prompt, what ``echo`` puts before its choices' outputs: a completion's prompt as sent
        (decoded from its ids when they were sent, or truncated), a chat's last message content. With
        ``return_token_ids`` a completion echoes no text (the prompt's ids come instead), as vLLM."""
        if not body.echo:
            return [None] * len(truncated)
        if chat:
            return [Echo(body.echo_text())]
        if self.tokenizer is None:
            raise UnsupportedFieldError("echo", "echo needs a tokenizer; this model has none")
        echoes = []
        for sent, ids, kept in zip(body.prompts(), prompts, truncated, strict=True):
            text = sent if isinstance(sent, str) and len(kept) == len(ids) else self.tokenizer.decode(kept)
            first = token_id_name(kept[0]) if body.return_tokens_as_token_ids else self.tokenizer.decode(kept[:1])
            echoes.append(Echo("" if body.return_token_ids else text, first, body.echo_only))
        return echoes

    def _chat_text(self, body: ChatPromptFields, plan: ToolPlan) -> str:
        """The prompt text of a chat (completion or ``/tokenize``) body, with the plan's tools."""
        messages = [m.as_template_message() for m in body.messages]
        return render_chat(self.tokenizer, messages, plan.tools, self.tool_format, body.template_options())

    def _encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt",
                allow_empty: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise UnsupportedFieldError("prompt", "this model has no tokenizer; send prompt token ids")
        if not text and not allow_empty:
            raise UnsupportedFieldError("prompt", "the prompt is empty; send at least one token")
        require_unicode(text, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _make_requests(self, body, prompts: list[list[int]], chat: bool, pinned: str | None = None,
                       constraint: StructuredOutputs | None = None, echoes: list[Echo | None] | None = None,
                       key: str | None = None) -> list[ChoiceStream]:
        """``key``: the HTTP request's id, which the engine requests' ids (and so their log lines) carry."""
        num_logprobs = body.num_logprobs if chat else body.logprobs
        adapter_groups = self._adapter_groups(body.model)
        lora = body.model if adapter_groups else None
        shapes = {group: shape for group, shape in self.shapes.items()
                  if pinned in (None, group) and (lora is None or group in adapter_groups)}
        if body.priority and shapes.keys() & self.priority_groups:  # else every group's engine refuses it by name
            shapes = {group: shape for group, shape in shapes.items() if group in self.priority_groups}
        # The key, then a suffix that keeps engine ids apart when a client sends one id twice.
        base_id = f"{'chatcmpl' if chat else 'cmpl'}-{key or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"
        streams = []
        for p_index, token_ids in enumerate(prompts):
            for j in range(body.n):
                index = p_index * body.n + j
                requests = choice_requests(body, chat, f"{base_id}-{index}", token_ids, j, shapes,
                                           self.prefix_blocks, num_logprobs, constraint, lora)
                streams.append(ChoiceStream(index, p_index, requests, self.groups,
                                            echoes[p_index] if echoes else None,
                                            bool(body.return_tokens_as_token_ids), self.feeds))
        return streams
