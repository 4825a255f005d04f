"""The Responses API routes of the ingress (a mixin of ``OpenAIIngress``): ``POST /v1/responses``,
served as the chat completion of its messages after those of its ``previous_response_id``
(``cluster/api/responses_protocol.py``), and the stored responses' ``GET``, ``DELETE``,
``input_items`` and ``cancel``, read from the cluster's store (``deployments/response_store.py``).

The ingress provides ``store`` (a handle, or None: nothing is kept), ``router``, ``_check_key``,
``_prepare`` and ``_answering_model``.
"""

import logging
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse

from cluster.api.errors import UnsupportedFieldError
from cluster.api.response_store import input_items, items_page
from cluster.api.responses_protocol import ResponsesRequest
from cluster.hosting.backend import error_param
from deployments.http_app import answer, app
from deployments.http_app import error_response as _error
from deployments.responses_stream import respond_response
from deployments.streams import ApiError

logger = logging.getLogger(__name__)

# The chat fields a /v1/responses body becomes, by the names its errors give.
_RESPONSES_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                     "messages": "input", "prompt": "input", "response_format": "text.format"}


class ResponsesRoutes:
    @app.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, request: Request):
        """OpenAI's Responses API, served as the chat completion of its messages after those of the
        ``previous_response_id`` (``cluster/api/responses_protocol.py``); kept in the cluster's
        store when ``store`` (``deployments/response_store.py``)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if self.store is None:
            body = body.model_copy(update={"store": False})  # nothing is kept, and the response says so
        try:
            body.check_supported()
            context = await self._previous_context(body.previous_response_id)
            chat = body.as_chat_request(context)
        except ValueError as err:
            return _error(400, str(err), param=error_param(err))
        except ApiError as err:
            return _error(err.status, err.message, err.type, err.param, "previous_response_not_found")
        prepared = self._prepare(chat, request, chat=True, params=_RESPONSES_PARAMS)
        if isinstance(prepared, JSONResponse):
            return prepared
        (stream,), make_parser = prepared
        keep = partial(self._keep_response, input_items(body.input), context) if body.store else None
        return await answer(respond_response(stream, body, self._answering_model(body.model), self.router,
                                              make_parser, keep),
                             _RESPONSES_PARAMS)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request, stream: bool = False):
        """A stored response, as it was answered."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if stream:
            return _error(400, "streaming a stored response again is not supported; retrieve it whole",
                          param="stream")
        stored = await self.store.response.remote(response_id) if self.store is not None else None
        return stored if stored is not None else self._no_response(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request):
        if (denied := self._check_key(request)) is not None:
            return denied
        if self.store is None or not await self.store.delete.remote(response_id):
            return self._no_response(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request):
        """Only background responses can be cancelled, and this server runs none."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if self.store is None or await self.store.response.remote(response_id) is None:
            return self._no_response(response_id)
        return _error(400, "only background responses can be cancelled; this one has finished")

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request, after: str | None = None,
                                   limit: int = 20, order: str = "desc"):
        """One page of a stored response's input items (OpenAI's list object)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        items = await self.store.input_items.remote(response_id) if self.store is not None else None
        if items is None:
            return self._no_response(response_id)
        try:
            return items_page(items, response_id, after, limit, order)
        except ValueError as err:
            return _error(400, str(err), param=error_param(err))

    async def _previous_context(self, response_id: str | None) -> list[dict]:
        """The items a response continuing ``response_id`` starts from (ApiError 404: none stored)."""
        if response_id is None:
            return []
        if self.store is None:
            raise UnsupportedFieldError("previous_response_id", "previous_response_id needs stored responses, and "
                                                                "this server keeps none (serve.responses_store_size)")
        context = await self.store.context.remote(response_id)
        if context is None:
            raise ApiError(404, f"Previous response with id '{response_id}' not found.",
                           param="previous_response_id")
        return context

    async def _keep_response(self, items: list[dict], context: list[dict], response: dict) -> None:
        """Store a finished response; a store that cannot be reached costs the response nothing but
        its later retrieval (logged)."""
        try:
            await self.store.put.remote(response, items, [*context, *items, *response["output"]])
        except Exception as err:
            logger.warning("response %s was not stored: %s: %s", response["id"], type(err).__name__, err)

    def _no_response(self, response_id: str) -> JSONResponse:
        return _error(404, f"Response with id '{response_id}' not found.", param="response_id")
