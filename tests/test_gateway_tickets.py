"""The tickets the gateway holds for HTTP clients that cannot send `Plane-Ticket` back
(`plane.gateway.tickets`): the book and the retry key, pure, exact numbers (monotonic
seconds in). Against a real plane with the `openai` package: tests/test_openai_gateway.py."""

from __future__ import annotations

from multidict import CIMultiDict

from plane.contract.headers import read_caller
from plane.gateway.tickets import GOOD_FOR_S, HeldTickets, retry_key, says_first_try

K, OTHER = b"k" * 20, b"o" * 20


def test_a_ticket_is_given_from_its_time_on_once_and_while_good() -> None:
    book = HeldTickets(max_held=10)
    book.keep(K, "r-1", due_s=10.0, now_s=9.8)
    assert book.take(OTHER, 10.0) is None  # another request's retry
    assert book.take(K, 9.99) is None  # before its Retry-After: not the retry of it
    assert book.take(K, 10.0) == "r-1"
    assert book.take(K, 10.0) is None and len(book) == 0  # at most once
    book.keep(K, "r-2", due_s=20.0, now_s=19.9)
    assert book.take(K, 20.0 + GOOD_FOR_S) is None and len(book) == 0  # no longer good


def test_identical_requests_refused_together_take_a_ticket_each_in_due_order() -> None:
    book = HeldTickets(max_held=10)
    book.keep(K, "late", due_s=10.3, now_s=10.0)
    book.keep(K, "early", due_s=10.1, now_s=10.0)
    assert book.take(K, 10.2) == "early"  # the only one due yet
    assert book.take(K, 10.2) is None
    assert book.take(K, 10.35) == "late"


def test_a_ticket_brought_back_by_its_caller_is_not_given_again() -> None:
    book = HeldTickets(max_held=10)
    book.keep(K, "r-1", due_s=1.0, now_s=0.9)
    book.keep(K, "r-2", due_s=1.0, now_s=0.9)
    book.forget(K, "r-1")
    assert book.take(K, 1.0) == "r-2" and book.take(K, 1.0) is None


def test_the_book_is_bounded_the_oldest_dropped_first() -> None:
    book = HeldTickets(max_held=3)
    for i in range(5):
        book.keep(bytes([i]) * 20, f"r-{i}", due_s=1.0, now_s=0.5)
    assert len(book) == 3
    assert book.take(bytes([0]) * 20, 1.0) is None and book.take(bytes([4]) * 20, 1.0) == "r-4"
    book.keep(K, "r-k", due_s=5.0, now_s=4.9)  # those past their time go as it is kept
    assert len(book) == 1


def test_tickets_given_out_do_not_count_against_the_bound() -> None:
    """Given tickets stay in the book's order until they reach its front: counted against
    `max_held`, they had live tickets dropped early under a flood (found in review)."""
    book = HeldTickets(max_held=3)
    book.keep(b"a" * 20, "r-a", due_s=1.0, now_s=0.5)
    book.keep(b"b" * 20, "r-b", due_s=1.0, now_s=0.5)
    book.keep(b"c" * 20, "r-c", due_s=1.0, now_s=0.5)
    assert book.take(b"b" * 20, 1.0) == "r-b"  # given: the middle of the order
    book.keep(b"d" * 20, "r-d", due_s=1.5, now_s=1.0)  # three held: none need go
    assert len(book) == 3 and book.take(b"a" * 20, 1.0) == "r-a"


def test_the_retry_key_is_what_a_retry_repeats_and_a_first_try_says_so() -> None:
    def key(path: str = "/v1/completions", body: bytes = b'{"prompt":"x"}',
            **headers: str) -> bytes:
        h = CIMultiDict({"Authorization": "Bearer a-token-1", **headers})
        return retry_key(h, path, read_caller(h), body)

    base = key()
    assert key(**{"x-stainless-retry-count": "1", "User-Agent": "x"}) == base
    assert key(Authorization="Bearer b-token-2") != base  # another client's bearer
    assert key(body=b'{"prompt":"y"}') != base and key("/v1/chat/completions") != base
    assert key(**{"Idempotency-Key": "i-1"}) != base
    assert key(**{"Plane-Request-Id": "r-1"}) != key(**{"Plane-Request-Id": "r-2"})
    for headers, first in [({"x-stainless-retry-count": "0"}, True),
                           ({"x-stainless-retry-count": "1"}, False),
                           ({"Plane-Attempt": "1"}, True), ({"Plane-Attempt": "2"}, False),
                           ({}, False)]:
        h = CIMultiDict(headers)
        assert says_first_try(h, read_caller(h)) is first, headers


def test_a_flood_of_identical_refusals_is_taken_in_order_and_leaves_nothing_behind() -> None:
    book = HeldTickets(max_held=10_000)
    for i in range(1000):  # successive refusals: successive times
        book.keep(K, f"r-{i}", due_s=1.0 + i / 1000, now_s=1.0)
    assert [book.take(K, 1.5) for _ in range(3)] == ["r-0", "r-1", "r-2"]
    assert book.take(K, 1.0 + GOOD_FOR_S + 0.5) == "r-501"  # those before no longer good
    book.keep(OTHER, "o-1", due_s=9.0, now_s=8.0)  # the rest go as it is kept
    assert len(book) == 1 and book.take(K, 9.0) is None
