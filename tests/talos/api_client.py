"""A small synchronous client of a running node's loopback HTTP API, for the tests of that API.

The ``talosd`` commands use the local socket (talos/local/call.py); the HTTP API
(talos/api.py) stays for HTTP users and ``/metrics``, and these tests drive it
with the standard library only (urllib).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from talos.config import Home

__all__ = ["ApiClient", "ApiError", "NodeNotRunningError"]


class ApiError(Exception):
    """The API answered with an error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NodeNotRunningError(Exception):
    """No running node answers for this home."""


class ApiClient:
    """Bearer-token JSON calls to one node's API."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token

    @classmethod
    def for_home(cls, home: Home) -> ApiClient:
        """The API of the node running on ``home``, or NodeNotRunningError."""
        info = home.read_node_info()
        url = info.get("api") if info else None
        if not isinstance(url, str):
            raise NodeNotRunningError(f"no node is running on {home.path}")
        client = cls(url, home.api_token())
        try:
            client.call("GET", "/healthz", timeout=2)
        except (OSError, ApiError):
            raise NodeNotRunningError(f"the node of {home.path} does not answer at {url}") from None
        return client

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout: float = 30
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                if resp.headers.get_content_type() == "application/json":
                    return json.loads(raw)
                return raw.decode()
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except (ValueError, AttributeError):
                message = str(exc.reason)
            raise ApiError(exc.code, str(message)) from None
        except urllib.error.URLError as exc:
            raise OSError(f"cannot reach the node API at {self.base_url}: {exc.reason}") from None
