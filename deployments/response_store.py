"""The cluster's one store of Responses API responses, a Serve deployment of one replica.

Every ingress replica reads and writes the same store (``cluster/api/response_store.py``), so a
response continued with ``previous_response_id`` or retrieved by id is found whichever ingress
replica answers (on Kubernetes there are at least two). Kept in the replica's memory: a replica
that restarts starts empty, as vLLM's in-memory store does.
"""

from __future__ import annotations

from cluster.api.response_store import ResponseStore

DEPLOYMENT_NAME = "responses-store"


class ResponseStoreReplica:
    def __init__(self, max_responses: int) -> None:
        self.store = ResponseStore(max_responses)

    def put(self, response: dict, items: list[dict], context: list[dict]) -> None:
        self.store.put(response, items, context)

    def response(self, response_id: str) -> dict | None:
        return self.store.response(response_id)

    def context(self, response_id: str) -> list[dict] | None:
        return self.store.context(response_id)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)

    def input_items(self, response_id: str) -> list[dict] | None:
        return self.store.input_items(response_id)
