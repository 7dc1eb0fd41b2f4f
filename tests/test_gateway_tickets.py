"""The tickets the gateway holds for HTTP clients that cannot send `Plane-Ticket` back
(`plane.gateway.tickets`): the book and the retry key, pure, exact numbers (monotonic
seconds in). Against a real plane with the `openai` package: tests/test_openai_gateway.py."""

from __future__ import annotations

from multidict import CIMultiDict

from plane.contract.headers import read_caller
from plane.gateway.tickets import LATE_S, HeldTickets, retry_key, says_first_try

K, OTHER = b"k" * 20, b"o" * 20


def keep(book: HeldTickets, key: bytes, ticket: str, now_s: float, after_ms: int) -> None:
    """As `keep_ticket` holds a 429's: due at its Retry-After-Ms, or at its Retry-After
    (whole seconds, rounded up, as the gateway says it)."""
    book.keep(key, ticket, due_s=now_s + after_ms / 1000,
              whole_s=now_s + -(-after_ms // 1000), now_s=now_s)


def test_a_ticket_is_given_from_its_time_on_once_and_while_good() -> None:
    book = HeldTickets(max_held=10)
    keep(book, K, "r-1", 9.8, 200)  # due at 10.0 (Retry-After-Ms), or 10.8 (Retry-After: 1)
    assert book.take(OTHER, 10.0) is None  # another request's retry
    assert book.take(K, 9.99) is None  # before its Retry-After: not the retry of it
    assert book.take(K, 10.0) == "r-1"
    assert book.take(K, 10.0) is None and len(book) == 0  # at most once
    keep(book, K, "r-2", 19.8, 200)
    assert book.take(K, 20.8 + LATE_S) is None and len(book) == 0  # no longer good


def test_a_ticket_is_given_only_when_its_holder_comes_back_at_either_of_its_times() -> None:
    """A holder comes at its Retry-After-Ms (the openai package) or its Retry-After (whole
    seconds, curl), each up to LATE_S late; an identical request between the two is a
    newcomer. (Given for a whole second after Retry-After-Ms, any identical newcomer of that
    second took it: found from outside.)"""
    book = HeldTickets(max_held=10)
    keep(book, K, "ms", 10.0, 30)  # due at 10.03, or 11.0
    assert book.take(K, 10.03 + LATE_S + 0.001) is None  # between its times: a newcomer
    assert book.take(K, 10.7) is None and len(book) == 1
    assert book.take(K, 11.0 + LATE_S / 2) == "ms"  # its holder, reading Retry-After
    keep(book, K, "s", 20.0, 30)
    assert book.take(K, 20.03 + LATE_S / 2) == "s"  # its holder, reading Retry-After-Ms
    keep(book, K, "whole", 30.0, 1000)  # both times the same: one window
    assert book.take(K, 31.0 + LATE_S + 0.001) is None and len(book) == 0


def test_of_identical_tickets_due_together_the_one_whose_time_ends_first_is_given() -> None:
    """A retry could be any of their holders: given the one whose time ends first, each of
    the others is still there for its own holder (in its time)."""
    book = HeldTickets(max_held=10)
    keep(book, K, "curl", 10.0, 50)  # due at 10.05, or 11.0 (its Retry-After), till 11.2
    keep(book, K, "fresh", 10.9, 120)  # due at 11.02 till 11.22
    assert book.take(K, 11.05) == "curl" and book.take(K, 11.05) == "fresh"
    keep(book, K, "a", 20.0, 500)  # due at 20.5 till 20.7
    keep(book, K, "b", 20.0, 400)  # due at 20.4 till 20.6: kept after, ends first
    assert book.take(K, 20.55) == "b" and book.take(K, 20.55) == "a"


def test_identical_requests_refused_together_take_a_ticket_each_in_due_order() -> None:
    book = HeldTickets(max_held=10)
    keep(book, K, "late", 10.0, 300)
    keep(book, K, "early", 10.0, 100)
    assert book.take(K, 10.2) == "early"  # the only one due yet
    assert book.take(K, 10.2) is None
    assert book.take(K, 10.35) == "late"


def test_a_ticket_brought_back_by_its_caller_is_not_given_again() -> None:
    book = HeldTickets(max_held=10)
    keep(book, K, "r-1", 0.9, 100)
    keep(book, K, "r-2", 0.9, 100)
    book.forget(K, "r-1")
    assert book.take(K, 1.0) == "r-2" and book.take(K, 1.0) is None


def test_the_book_is_bounded_the_oldest_dropped_first() -> None:
    book = HeldTickets(max_held=3)
    for i in range(5):
        keep(book, bytes([i]) * 20, f"r-{i}", 0.5, 500)
    assert len(book) == 3
    assert book.take(bytes([0]) * 20, 1.0) is None and book.take(bytes([4]) * 20, 1.0) == "r-4"
    keep(book, K, "r-k", 4.9, 100)  # those past their time go as it is kept
    assert len(book) == 1


def test_tickets_given_out_do_not_count_against_the_bound() -> None:
    """Given tickets stay in the book's order until they reach its front: counted against
    `max_held`, they had live tickets dropped early under a flood (found in review)."""
    book = HeldTickets(max_held=3)
    keep(book, b"a" * 20, "r-a", 0.5, 500)
    keep(book, b"b" * 20, "r-b", 0.5, 500)
    keep(book, b"c" * 20, "r-c", 0.5, 500)
    assert book.take(b"b" * 20, 1.0) == "r-b"  # given: the middle of the order
    keep(book, b"d" * 20, "r-d", 1.0, 500)  # three held: none need go
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
    for i in range(1000):  # successive refusals: successive times (1.0 s .. 1.999 s)
        keep(book, K, f"r-{i}", 1.0, i)  # their Retry-After: 1 s (r-0's: 0)
    assert [book.take(K, 1.0) for _ in range(2)] == ["r-0", None]  # the only one due
    assert [book.take(K, 1.5) for _ in range(3)] == ["r-301", "r-302", "r-303"]
    # From 2.0, their Retry-After: those due in the last LATE_S first (their time ends first).
    assert book.take(K, 2.1) == "r-901" and book.take(K, 2.15) == "r-951"
    assert book.take(K, 2.1955) == "r-996" and book.take(K, 2.1995) == "r-1"
    keep(book, OTHER, "o-1", 8.0, 1000)  # the rest go as it is kept
    assert len(book) == 1 and book.take(K, 9.0) is None
