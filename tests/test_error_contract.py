"""One error contract end to end: a failure crosses the reply channel as its class's code and comes
back as the same class, with the status the sender gave; the HTTP body is built in one place."""

from __future__ import annotations

import json

import pytest

from shmgate.gateway.http_errors import error_response, failure_error
from shmgate.shared import errors
from shmgate.shared.errors import (
    Cancelled,
    DescriptorError,
    InvalidRequest,
    ModelError,
    Overloaded,
    RequestTimeout,
    ShmgateError,
    StaleGeneration,
    UnknownModel,
    error_for_code,
)
from shmgate.shared.wire import MAX_DELTA_CHARS, Failed, encoder, failed_reply, gateway_decoder

WORKER_FAILURES = [UnknownModel, InvalidRequest, DescriptorError, RequestTimeout, Cancelled, ModelError]


@pytest.mark.parametrize("cls", WORKER_FAILURES)
def test_a_worker_failure_comes_back_as_its_class_with_its_status(cls: type[ShmgateError]) -> None:
    sent = failed_reply(7, 3, cls("what went wrong"))
    received = gateway_decoder.decode(encoder.encode(sent))
    assert isinstance(received, Failed) and (received.request_id, received.seq) == (7, 3)
    error = failure_error(received)
    assert type(error) is cls
    assert (error.code, error.status_hint, error.message) == (cls.code, cls.status_hint, "what went wrong")


def test_every_code_names_exactly_one_class_and_that_class_carries_it() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        if isinstance(cls, type) and issubclass(cls, ShmgateError):
            assert error_for_code(cls.code, "m").code == cls.code, name


def test_a_subclass_travels_as_its_branch_code() -> None:
    error = failure_error(failed_reply(1, 0, StaleGeneration("the allocation was reused")))
    assert type(error) is DescriptorError and error.code == "bad_descriptor" and error.status_hint == 500


def test_an_instance_status_survives_the_trip() -> None:
    error = failure_error(failed_reply(1, 0, Overloaded("slow down", status_hint=429)))
    assert isinstance(error, Overloaded) and error.status_hint == 429
    response = error_response(error)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"


def test_an_unknown_code_from_a_newer_peer_is_passed_through() -> None:
    error = failure_error(Failed(request_id=1, seq=0, code="brand_new", message="something new", status_hint=422))
    assert (error.code, error.status_hint, error.error_type) == ("brand_new", 422, "invalid_request_error")


def test_the_http_body_is_an_openai_error_object() -> None:
    response = error_response(failure_error(failed_reply(1, 0, UnknownModel("this worker serves x"))))
    assert response.status_code == 404
    assert json.loads(response.body) == {
        "error": {
            "message": "this worker serves x",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }


def test_a_long_message_is_cut_to_one_reply_message() -> None:
    assert len(failed_reply(1, 0, ModelError("x" * 5000)).message) == MAX_DELTA_CHARS
