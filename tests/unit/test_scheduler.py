"""The step scheduler's policy on its own: decodes first, then bounded pieces of new work."""

from __future__ import annotations

from llava.engines.transformers.scheduling.scheduler import IDLE_FACTOR, Pending, plan_step


def decoding(i: int) -> Pending:
    return Pending(i, decoding=True)


def test_every_decoding_answer_advances_and_counts_against_the_budget() -> None:
    work = [decoding(0), decoding(1), Pending(2, False, prefill=1000, follow_up=False)]
    plan = plan_step(work, budget=64)
    assert plan.decode == [0, 1]
    assert plan.prefill == {2: 62}
    assert plan.tokens == 64


def test_long_prefills_are_cut_into_chunks_that_fill_the_budget_in_order() -> None:
    work = [Pending(0, False, prefill=40, follow_up=False), Pending(1, False, prefill=40)]
    plan = plan_step([*work, decoding(2)], budget=51)
    # The follow-up question (1) goes first, then the open takes what is left.
    assert plan.prefill == {1: 40, 0: 10}


def test_a_step_no_stream_waits_on_spends_more_on_prefill() -> None:
    opens = [Pending(0, False, prefill=500, follow_up=False)]
    assert plan_step(opens, budget=50).prefill == {0: 50 * IDLE_FACTOR}
    assert plan_step([*opens, decoding(1)], budget=50).prefill == {0: 49}


def test_a_tower_run_that_does_not_fit_waits_and_nothing_behind_it_overtakes() -> None:
    work = [
        Pending(0, False, prefill=30),
        Pending(1, False, tower_cost=40, follow_up=False),
        Pending(2, False, prefill=5, follow_up=False),
    ]
    plan = plan_step([*work, decoding(3)], budget=51)
    assert plan.prefill == {0: 30}
    assert plan.encode == []  # 40 > the 20 left: next step


def test_the_oldest_piece_always_runs_even_when_larger_than_the_budget() -> None:
    plan = plan_step([Pending(0, False, tower_cost=500, follow_up=False)], budget=50)
    assert plan.encode == [0]


def test_many_decoders_still_leave_a_share_for_starting_answers() -> None:
    work = [decoding(i) for i in range(100)] + [Pending(100, False, prefill=500)]
    plan = plan_step(work, budget=64)
    assert len(plan.decode) == 100
    assert plan.prefill == {100: 16}  # a quarter of the budget: opens never starve


def test_done_or_empty_work_plans_nothing() -> None:
    assert plan_step([], budget=8).tokens == 0
    assert plan_step([Pending(0, False)], budget=8).prefill == {}


def test_each_prefill_chunk_pays_for_its_forward() -> None:
    work = [Pending(0, False, prefill=20), Pending(1, False, prefill=100, follow_up=False)]
    plan = plan_step(work + [decoding(2)], budget=90, forward_cost=30)
    # 89 left after the decode: the question (30 + 20), then the open's forward and 9 tokens.
    assert plan.prefill == {0: 20, 1: 9}
    plan = plan_step(work + [decoding(2)], budget=80, forward_cost=30)
    assert plan.prefill == {0: 20}  # 29 left: not even the open's forward fits
    plan = plan_step([Pending(1, False, prefill=100, follow_up=False)], budget=45, forward_cost=30)
    assert plan.prefill == {1: 90}  # no decode: twice the budget, the forward paid outside it


def test_a_lone_follow_up_prefills_in_one_forward() -> None:
    """Nothing decoding: a question shorter than the idle step's budgets runs whole, even where
    the forward's fixed cost is most of the budget (a CPU); splitting it would pay that cost
    twice with no stream to protect (the 100-turn chat's late turns took two steps)."""
    question = Pending(0, False, prefill=40)
    assert plan_step([question], budget=28, forward_cost=40).prefill == {0: 40}
    assert plan_step([question, decoding(1)], budget=28, forward_cost=40).prefill == {0: 7}


def test_the_oldest_chunk_runs_however_dear_its_forward() -> None:
    work = [decoding(i) for i in range(100)] + [Pending(100, False, prefill=500)]
    plan = plan_step(work, budget=64, forward_cost=40)
    assert plan.prefill == {100: 16}


def test_packed_chunks_pay_what_they_add_to_a_forward_that_runs_anyway() -> None:
    work = [Pending(0, False, prefill=20), Pending(1, False, prefill=100, follow_up=False)]
    plan = plan_step(work + [decoding(2)], budget=90, forward_cost=30, rider_cost=5)
    # 89 left after the decode: the question (5 + 20), then the open (5 + 59).
    assert plan.prefill == {0: 20, 1: 59}
    # No decode: the first chunk starts the forward (30), the next rides it (5).
    plan = plan_step(work, budget=45, forward_cost=30, rider_cost=5)
    assert plan.prefill == {0: 20, 1: 35}


def test_memory_cuts_a_chunk_to_what_its_forward_has_bytes_for() -> None:
    """`room_for` sees each chunk's cached context and every piece planned before it (the
    decodes, then earlier chunks), and no chunk exceeds what it allows."""
    asked: list[tuple[int, list[tuple[int, int]]]] = []

    def room_for(context: int, planned: list[tuple[int, int]]) -> int:
        asked.append((context, list(planned)))
        return 100 - sum(n for _, n in planned)  # 100 tokens' worth of bytes in the forward

    work = [
        Pending(0, True, context=7),
        Pending(1, False, prefill=60, context=900),
        Pending(2, False, prefill=60, context=30),
    ]
    plan = plan_step(work, budget=1000, room_for=room_for)
    assert plan.prefill == {1: 60, 2: 39}
    assert asked == [(900, [(7, 1)]), (30, [(7, 1), (900, 60)])]


def test_under_memory_the_oldest_piece_still_moves_and_the_rest_wait() -> None:
    work = [Pending(0, False, prefill=60), Pending(1, False, prefill=60)]
    plan = plan_step(work, budget=1000, room_for=lambda context, planned: 0)
    assert plan.prefill == {0: 1}  # nothing fits: a token, so nothing starves
