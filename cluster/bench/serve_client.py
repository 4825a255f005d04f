"""One streamed OpenAI request of ``tandem bench serve``, timed chunk by chunk.

The SSE stream is parsed here: events are separated by blank lines, their ``data:``
lines joined; the stream ends at ``data: [DONE]`` (or when the server closes it). Every
event that arrives in one network read gets that read's time. A chunk *carries text*
when ``choices[0].text`` (completions) or ``choices[0].delta.content`` (chat; also
``reasoning_content``) is non-empty; role-only and usage-only chunks do not. The
request fails, without raising, on a non-200 answer, an error event, a connection
error or timeout, a chunk that is not JSON, or a stream with no text at all.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time

from cluster.bench.serve_metrics import RequestRecord
from cluster.bench.serve_workload import BenchRequest

MAX_ERROR_CHARS = 500


async def _sse_events(content):
    """Yield ``(arrival_time, data)`` for every SSE event of an aiohttp stream."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, data_lines = "", []
    async for raw in content.iter_any():
        now = time.perf_counter()
        pending += decoder.decode(raw)
        *lines, pending = pending.split("\n")
        for line in lines:
            line = line.rstrip("\r")
            if line.startswith("data:"):
                data_lines.append(line[5:].removeprefix(" "))
            elif not line and data_lines:
                yield now, "\n".join(data_lines)
                data_lines = []
    if data_lines:
        yield time.perf_counter(), "\n".join(data_lines)


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choices[0].get("text") or ""


async def send_request(session, url: str, body: dict, endpoint: str, index: int, request: BenchRequest,
                       scheduled_s: float, t0: float) -> RequestRecord:
    """POST one streamed request and record it; never raises for a failed request.
    ``scheduled_s`` is the planned send time and ``t0`` the ``perf_counter`` of the
    benchmark start; the record's times are relative to them (see ``RequestRecord``)."""
    import aiohttp  # here, not at the top: would add ~0.08 s to every tandem command, for this benchmark only

    start = time.perf_counter()
    chunk_times: list[float] = []
    usage: dict = {}
    error = ""
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:MAX_ERROR_CHARS]}"
            else:
                async for arrived, data in _sse_events(resp.content):
                    if data.strip() == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict) or chunk.get("error") or chunk.get("object") == "error":
                        error = f"error event: {data[:MAX_ERROR_CHARS]}"
                        break
                    if _chunk_text(chunk, endpoint):
                        chunk_times.append(arrived - start)
                    usage = chunk.get("usage") or usage
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        error = f"{type(err).__name__}: {err}"[:MAX_ERROR_CHARS]
    end = time.perf_counter()
    if not error and not chunk_times:
        error = "the stream carried no text"
    counted = usage.get("completion_tokens") is not None
    return RequestRecord(
        index=index, scheduled_s=scheduled_s, start_s=start - t0, success=not error, error=error,
        prompt_len=request.prompt_len, output_len=request.output_len,
        prompt_tokens=int(usage.get("prompt_tokens") or request.prompt_len),
        output_tokens=int(usage["completion_tokens"]) if counted else len(chunk_times),
        output_tokens_source="usage" if counted else "chunks", e2e_s=end - start,
        chunk_times_s=tuple(chunk_times),
    )


async def first_model_id(session, base: str) -> str:
    """The first ``id`` that ``GET {base}/v1/models`` lists; ValueError if there is none."""
    import aiohttp  # here, not at the top: would add ~0.08 s to every tandem command, for this benchmark only

    try:
        async with session.get(f"{base}/v1/models") as resp:
            if resp.status != 200:
                raise ValueError(f"GET {base}/v1/models answered HTTP {resp.status}; pass --model")
            models = (await resp.json(content_type=None)).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        raise ValueError(f"cannot list the models of {base} ({type(err).__name__}: {err}); is the server up?") from None
    if not models:
        raise ValueError(f"GET {base}/v1/models lists no model; pass --model")
    return models[0]["id"]
