"""The plain-text refusal the edge writes before any HTTP parser holds the request."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from websockets.http11 import Response
from websockets.streams import StreamReader

from duplex_actors.server import raw_http


def _parse(data: bytes) -> Response:
    reader = StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    parser = Response.parse(reader.read_line, reader.read_exact, reader.read_to_eof)
    try:
        next(parser)
    except StopIteration as done:
        return done.value
    raise AssertionError("the response did not parse whole")


@given(text=st.text(), retry_after=st.none() | st.integers(0, 3600))
def test_a_refusal_is_one_complete_response_that_a_client_parses(text, retry_after):
    response = _parse(raw_http.refusal(503, "Service Unavailable", text, retry_after))
    assert response.status_code == 503
    assert response.body == (text + "\n").encode()
    assert response.headers["Connection"] == "close"
    assert response.headers.get("Retry-After") == (None if retry_after is None else str(retry_after))
