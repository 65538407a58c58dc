"""Read deadlines for `hf-dllm serve`: a request's head and its body must arrive within a bounded time.

uvicorn bounds only the idle time between requests (`timeout_keep_alive`); a client sending its head or body one
byte at a time, or declaring a Content-Length it never sends, held a connection (and the request's worker) for as
long as it liked (slowloris). `deadline_protocol` gives uvicorn's h11 protocol two timers, as nginx's
`client_header_timeout` / `client_body_timeout` and Apache's `mod_reqtimeout` do:

- the head (request line and headers) must be complete within `header_timeout` seconds of the connection opening,
  or of the first byte of a later request on a kept-alive connection;
- the body within `body_timeout` seconds of the head.

Past either, the client gets `408 Request Timeout` with an OpenAI-style error body and the connection is closed; a
handler still reading that body sees the client as gone (`http.disconnect`). Both are total deadlines, not idle
ones: a trickle of one byte per second does not extend them. uvicorn and h11 are imported by `deadline_protocol`
only (the `serve` extra).
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger("hf_dllm.serve")

DEFAULT_HEADER_TIMEOUT = 5.0
DEFAULT_BODY_TIMEOUT = 10.0


def timeout_response(what: str, seconds: float) -> bytes:
    """A complete `408` HTTP/1.1 response (OpenAI's error object) that closes the connection."""
    body = json.dumps(
        {
            "error": {
                "message": f"The request {what} did not arrive within {seconds:g} s.",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def deadline_protocol(header_timeout: float = DEFAULT_HEADER_TIMEOUT, body_timeout: float = DEFAULT_BODY_TIMEOUT):
    """The protocol class to pass as uvicorn's `http` (`uvicorn.run(app, http=...)`), with these deadlines in
    seconds (each > 0)."""
    for name, value in (("header_timeout", header_timeout), ("body_timeout", body_timeout)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
            raise ValueError(f"`{name}` must be a number of seconds > 0, got {value!r}.")
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    head_seconds, body_seconds = float(header_timeout), float(body_timeout)

    class DeadlineH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a head and a body deadline (module docstring)."""

        header_timeout = head_seconds
        body_timeout = body_seconds

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            self._arm("head", self.header_timeout)

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and self.conn.their_state is h11.IDLE:
                self._arm("head", self.header_timeout)  # the first byte of a request on a kept-alive connection
            super().data_received(data)
            self._follow_state()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._follow_state()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _follow_state(self) -> None:
            """Move the deadline along with the client's side of the connection: head -> body -> none."""
            state = self.conn.their_state
            if self._deadline is None:
                return
            if self._deadline[0] == "head" and state is not h11.IDLE:
                self._disarm()
                if state is h11.SEND_BODY:
                    self._arm("body", self.body_timeout)
            elif self._deadline[0] == "body" and state is not h11.SEND_BODY:
                self._disarm()

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._deadline = (what, self.loop.call_later(seconds, self._expire, what, seconds))

        def _disarm(self) -> None:
            deadline, self._deadline = getattr(self, "_deadline", None), None
            if deadline is not None:
                deadline[1].cancel()

        def _expire(self, what: str, seconds: float) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            expected = h11.IDLE if what == "head" else h11.SEND_BODY
            if self.conn.their_state is not expected:
                return
            cycle = self.cycle if what == "body" else None
            answered = cycle is not None and cycle.response_started
            logger.info(
                "closing a connection from %s: its request %s did not arrive within %g s", self.client, what, seconds
            )
            if cycle is not None:
                cycle.disconnected = True  # the handler's later sends are dropped; its receive() says the client left
                cycle.message_event.set()
            if not answered:
                self.transport.write(timeout_response(what, seconds))
            self.transport.close()

    return DeadlineH11Protocol
