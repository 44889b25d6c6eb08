"""``GET /docs``: the interactive page for ``/openapi.json``, on a real ``shmgate serve --api-key``.

Like the document it shows, the page is open without the key; the document tells the page's
"Authorize" button that the API routes take the key as a bearer token.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import _serve
from tests.serving import Server

KEY = "sk-docs-test-3b9d"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve("checksum", tmp_path_factory, "--frontends", "1", "--workers", "1", "--api-key", KEY)


@pytest.mark.parametrize("authorization", [None, f"Bearer {KEY}"])
def test_docs_is_an_html_page_that_loads_the_openapi_document_with_or_without_the_key(
    keyed_server: Server, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    page = httpx.get(keyed_server.base_url + "/docs", headers=headers, timeout=10)
    assert page.status_code == 200, page.text[:300]
    assert page.headers["content-type"].startswith("text/html")
    assert "url: '/openapi.json'" in page.text and "SwaggerUIBundle" in page.text
    document = httpx.get(keyed_server.base_url + "/openapi.json", headers=headers, timeout=10)
    assert document.status_code == 200  # what the page loads is open too


def test_the_openapi_document_lists_docs_beside_the_other_non_api_routes(keyed_server: Server) -> None:
    document = httpx.get(keyed_server.base_url + "/openapi.json", timeout=10).json()
    assert {"/health", "/ready", "/metrics", "/docs"} <= set(document["paths"])
    docs = document["paths"]["/docs"]["get"]
    assert set(docs["responses"]["200"]["content"]) == {"text/html"}
    assert "security" not in docs  # open, as /health is


def test_the_document_says_which_routes_take_the_key_and_the_key_it_describes_works(keyed_server: Server) -> None:
    document = httpx.get(keyed_server.base_url + "/openapi.json", timeout=10).json()
    scheme = document["components"]["securitySchemes"]["apiKey"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    models = document["paths"]["/v1/models"]["get"]
    assert {"apiKey": []} in models["security"] and "401" in models["responses"]
    url = keyed_server.base_url + "/v1/models"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
