"""Router parts that need no Ray: n > 1 choices fail together; error bodies."""

import asyncio

import pytest

from deployments.openai_api import error_body
from deployments.router import all_or_none


def test_one_failing_choice_cancels_its_siblings():
    cancelled = []

    async def sibling(i):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def failing():
        await asyncio.sleep(0.01)
        raise RuntimeError("verifier: UNAVAILABLE")

    async def main():
        with pytest.raises(RuntimeError):
            await all_or_none([sibling(0), failing(), sibling(2)])

    asyncio.run(main())
    assert sorted(cancelled) == [0, 2]


def test_error_bodies_have_openais_types():
    assert error_body("slow down", 429)["error"]["code"] == "rate_limit_exceeded"
    assert error_body("who", 401)["error"]["code"] == "invalid_api_key"
    assert error_body("down", 503)["error"]["type"] == "server_error"
