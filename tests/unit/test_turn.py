"""Turn: the work a loop callback defers runs before it returns, in order, bounded."""

from __future__ import annotations

import asyncio

import pytest

from cachexferd.daemon.turn import MAX_ROUNDS, Turn


def test_deferred_calls_run_before_the_turn_returns_in_order() -> None:
    turn, seen = Turn(), []

    def read() -> None:
        seen.append("read")
        turn.defer(lambda: (seen.append("start"), turn.defer(lambda: seen.append("flush"))))
        turn.defer(lambda: seen.append("refusals"))

    async def main() -> None:
        turn.run(read)
        assert seen == ["read", "start", "refusals", "flush"]  # before any other callback ran

    asyncio.run(main())


def test_a_failing_call_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    turn, seen = Turn(), []

    def broken() -> None:
        raise RuntimeError("boom")

    def read() -> None:
        turn.defer(broken)
        turn.defer(lambda: seen.append("flush"))
        raise ValueError("the read failed too")

    async def main() -> None:
        with pytest.raises(ValueError):
            turn.run(read)
        assert seen == ["flush"]

    asyncio.run(main())
    assert "deferred call" in caplog.text and "boom" in caplog.text


def test_outside_a_turn_one_loop_callback_runs_the_lot() -> None:
    turn, seen = Turn(), []

    async def main() -> None:
        turn.defer(lambda: seen.append(1))
        turn.defer(lambda: seen.append(2))
        assert seen == []
        await asyncio.sleep(0)
        assert seen == [1, 2]

    asyncio.run(main())


def test_a_chain_of_deferrals_yields_to_the_loop_after_max_rounds() -> None:
    turn, seen = Turn(), []

    def link(n: int) -> None:
        seen.append(n)
        if n < 3 * MAX_ROUNDS:
            turn.defer(lambda: link(n + 1))

    async def main() -> None:
        turn.run(lambda: link(0))
        assert seen == list(range(MAX_ROUNDS + 1))  # the first call, then MAX_ROUNDS rounds
        for _ in range(10):
            await asyncio.sleep(0)
        assert seen == list(range(3 * MAX_ROUNDS + 1))  # the rest in later loop iterations

    asyncio.run(main())


def test_a_nested_run_leaves_its_deferrals_to_the_outer_turn() -> None:
    turn, seen = Turn(), []

    def outer() -> None:
        turn.run(lambda: turn.defer(lambda: seen.append("inner's")))
        seen.append("outer")

    async def main() -> None:
        turn.run(outer)
        assert seen == ["outer", "inner's"]

    asyncio.run(main())
