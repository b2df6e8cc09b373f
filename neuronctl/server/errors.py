"""Every refusal the API makes, as an OpenAI error body with its HTTP status: raised as
ApiError or as the engine's and neuronctl's own errors, answered by the handlers here."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from neuronctl.engine.errors import EngineStoppedError, QueueFullError, RequestError
from neuronctl.errors import UsageError
from neuronctl.server.protocol import ERROR_TYPES, error_body


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    close: bool = False,
) -> JSONResponse:
    """`close`: for an answer given before the body was read. The connection then closes
    after it, so the server never reads (and parses, in uvicorn's h11) the rest of a body it
    refused: a 6.6 MB body refused in its first 200 KB cost its whole read on the event loop."""
    body = error_body(message, ERROR_TYPES.get(status, "invalid_request_error"), param, code)
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    if close:
        headers["Connection"] = "close"
    return JSONResponse(body, status_code=status, headers=headers or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestError)
    async def _bad(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, exc.code)

    @app.exception_handler(UsageError)
    async def _usage(_: Request, exc: UsageError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(429, str(exc), code="queue_full")

    @app.exception_handler(EngineStoppedError)
    async def _stopped(_: Request, exc: EngineStoppedError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        param = ".".join(loc[:1] if loc[:1] != ["messages"] else loc[:3]) or None
        return error_response(400, f"{where}: {err.get('msg')}", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))
