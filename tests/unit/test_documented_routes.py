"""docs/serving.md's HTTP API names every path the router serves, and serves every path it
names: the route table (FastAPI's own pages included) against the section's `METHOD /path`s."""

import re
from pathlib import Path

from deployments.router import app

SERVING = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
# a path as the section writes it, in backticks, after its method or not: `GET /v1/models`
DOCUMENTED_PATH = re.compile(r"`(?:(?:GET|POST|DELETE) +)?(/[^`\s*]*)`")
PARAMETER = re.compile(r"\{[^}]*\}")


def http_api_section() -> str:
    return SERVING.read_text().split("\n## The HTTP API\n", 1)[1].split("\n## ", 1)[0]


def served_paths(routes=None) -> list[str]:
    """The router app's paths, those of the routers it includes (the Router class's) too."""
    found = []
    for route in app.routes if routes is None else routes:
        if hasattr(route, "original_router"):
            found += served_paths(route.original_router.routes)
        else:
            found.append(route.path)
    return found


def pattern(path: str) -> re.Pattern:
    """A route's path as a documented one matches it: a parameter is any name in braces (the
    docs' `{id}` for `{response_id}`), a trailing catch-all (`{path:path}`) any tail."""
    catch_all = path.endswith(":path}") and path[path.rindex("{") - 1] != "/"
    head = path[:path.rindex("{")] if catch_all else path
    literal = PARAMETER.sub(lambda _: "\0", head)
    body = re.escape(literal).replace("\0", r"\{\w+\}")
    return re.compile(body + ("(/.*)?" if catch_all else ""))


def documented(section: str) -> set[str]:
    return set(DOCUMENTED_PATH.findall(section)) - {"/v1"}  # /v1: the API key's prefix


def test_every_served_path_is_documented():
    named = documented(http_api_section())
    missing = [path for path in served_paths()
               if not any(pattern(path).fullmatch(doc) for doc in named)]
    assert not missing, f"docs/serving.md's HTTP API does not name {missing}"


def test_every_documented_path_is_served():
    patterns = [pattern(path) for path in served_paths()]
    unserved = sorted(doc for doc in documented(http_api_section())
                      if not any(served.fullmatch(doc) for served in patterns))
    assert not unserved, f"docs/serving.md's HTTP API names paths not served: {unserved}"
