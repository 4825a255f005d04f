"""The operator's routes of the ingress (a mixin of ``OpenAIIngress``): ``/health`` (readiness,
and draining before a stop), ``/metrics`` (every process's metrics of the application,
merged) and the ``/debug`` views of the router, the engines and their step timelines.

The ingress provides ``app_name`` (None outside Serve), ``draining``, ``required_groups``,
``groups``, ``router`` and ``_check_key``.
"""

import asyncio

from fastapi import Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve

from cluster.metrics.exposition import merge
from cluster.routing import choice_counts
from deployments.app_hub import application_hub
from deployments.http_app import app
from deployments.readiness import unready_groups


class OperationsRoutes:
    @app.get("/health")
    async def health(self):
        """200 once every replica group that keeps replicas has one running; 503 naming the
        groups that have none (still loading their models, or being replaced), or while the
        server drains before it stops."""
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.app_name is None:
            return {"status": "ok"}
        problems = await asyncio.to_thread(lambda: unready_groups(serve.status(), self.app_name,
                                                                  self.required_groups))
        if problems:
            return JSONResponse({"status": "unavailable", "groups": problems}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(self):
        """Every engine replica's and ingress's metrics of this application, in Prometheus' text
        format: vLLM's series (``vllm:...``) and Tandem's (``tandem:...``), as the processes last
        pushed them (every few seconds). No API key, as vLLM's server and Ray's metrics port."""
        if self.app_name is None:
            return PlainTextResponse("", media_type=CONTENT_TYPE_LATEST)
        sources = await application_hub(self.app_name).metrics.remote()
        return PlainTextResponse(merge(sources), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/router")
    async def debug_router(self, request: Request):
        if (denied := self._check_key(request)) is not None:
            return denied
        return {**self.router.snapshot(), "replica_choices": dict(choice_counts.CHOICES)}

    @app.get("/debug/engines")
    async def debug_engines(self, request: Request):
        """Engine counters of one replica per group (all of them when each group has one)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        results = {}
        for name, handle in self.groups.items():
            results[name] = await handle.engine_stats.remote()
        return results

    @app.get("/debug/timeline")
    async def debug_timeline(self, request: Request, last_seconds: float | None = Query(None, gt=0)):
        """The step timeline of one replica per group (``cluster/engine/step_timeline.py``), its summary
        over the last ``last_seconds`` (a query parameter; default: every step kept)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        return {name: await handle.step_timeline.remote(last_seconds) for name, handle in self.groups.items()}
