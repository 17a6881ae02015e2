"""``heteroplane fleet --app``: which stage (model) each instance serves, from the serving
loop's status (its stages' per-instance states)."""

from __future__ import annotations

from typing import Any

from controlplane.cli.client import ApiClientError
from controlplane.cli.operate import _served_models


class Client:
    def __init__(self, answer: dict[str, Any] | None) -> None:
        self.answer = answer

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        assert path == "/v1/apps/demo/serving"
        if self.answer is None:
            raise ApiClientError("this service runs no serving loop", 503, "serving_unavailable")
        return self.answer


def test_each_instance_lists_the_models_placed_on_it() -> None:
    status = {
        "stages": [
            {"model": "tiny", "states": {"1": "active", "2": "active"}},
            {"model": "large", "states": {"3": "overloaded"}},
        ]
    }
    assert _served_models(Client(status), "demo") == {"1": ["tiny"], "2": ["tiny"], "3": ["large"]}


def test_no_serving_loop_leaves_the_column_out() -> None:
    assert _served_models(Client(None), "demo") == {}
