"""The ingress's FastAPI application and OpenAI's error shape: ``app`` (every route of the ingress
and its mixins is declared on it), ``error_response``, ``answer`` (a replica's or Serve's refusal
as an error response) and the handlers that turn FastAPI's own errors into OpenAI's 400s and 404s."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.api.errors import renamed_error
from cluster.api.openai_responses import error_body
from deployments.streams import ApiError

app = FastAPI(title="Tandem", description="OpenAI-compatible API of a Tandem cluster")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape."""
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


async def answer(answering, params: dict[str, str] | None = None):
    """The response ``answering`` gives, or the error a replica or Serve refused it with (``params``
    renames the field an error names)."""
    try:
        return await answering
    except ApiError as err:
        message, param = renamed_error(err.message, err.param, params or {})
        return error_response(err.status, message, err.type, param)
    except BackPressureError as err:
        return error_response(503, f"the server is overloaded, retry later ({err})", "server_error")


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON", code="invalid_json")
    where = ".".join(loc) or "body"
    return error_response(400, f"{where}: {first.get('msg', 'invalid value')} (got {first.get('input')!r:.80})",
                          param=loc[0] if loc else None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), type_)
