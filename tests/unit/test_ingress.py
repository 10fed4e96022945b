"""The router's ingress answers a bug with a logged 500, and a request Serve cancelled (its
client went away) with a quiet 499."""

import logging

from fastapi.testclient import TestClient
from ray.exceptions import TaskCancelledError

from deployments.ingress import CLIENT_CLOSED, ingress_app, log


class Records(logging.Handler):
    """The records the ingress logs (its logger, Serve's, does not propagate to pytest's)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> list[logging.LogRecord]:
        log.addHandler(self)
        return self.records

    def __exit__(self, *exc) -> None:
        log.removeHandler(self)


def app_raising(error: Exception) -> TestClient:
    app = ingress_app("test")

    @app.get("/v1/x")
    async def fail():
        raise error

    return TestClient(app, raise_server_exceptions=False)


def test_a_bug_is_a_logged_500():
    with Records() as records:
        response = app_raising(RuntimeError("boom")).get("/v1/x")
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal error"
    assert [r.levelno for r in records] == [logging.ERROR] and records[0].exc_info


def test_a_request_serve_cancelled_is_not_a_bug():
    with Records() as records:
        response = app_raising(TaskCancelledError()).get("/v1/x")
    assert response.status_code == CLIENT_CLOSED == 499
    assert [r.levelno for r in records] == [logging.INFO] and not records[0].exc_info
