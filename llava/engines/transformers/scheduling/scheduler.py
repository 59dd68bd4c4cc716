"""What runs in one engine step: the one place that decides, under a token budget.

Every step first advances each answer that is already decoding by one token (a stream never
waits behind someone else's prefill), then spends what is left of the step's token budget on
work that starts answers, in order:
1. follow-up questions (short prefills; a conversation's next answer is what users wait on),
2. opens and one-shot answers (long prefills: an image's tokens),
each in arrival order. That work is cut into pieces: the vision tower over a request's new
images (costed by the tokens it produces, scaled by the tower's size against the language
model's) and prefill chunks of at most the budget. A forward has a fixed cost whatever its length
(reading the weights: on a CPU about one decode step); `forward_cost` charges it, in tokens, to a
chunk that needs a forward of its own. Where the engine packs a step's pieces into one forward
(`packed.py`), a chunk rides the forward that runs anyway and pays only `rider_cost`, what adding
a sequence to a forward costs; only the first chunk of a step with nothing decoding starts one.
The oldest waiting piece always gets some of the step, so nothing starves; a piece that does not
fit waits for the next step, and nothing behind it overtakes it. This is chunked prefill as vLLM
and SGLang schedule it. A step in which no answer is decoding holds no stream, only requests
arriving meanwhile: it may spend `IDLE_FACTOR` budgets, and its first chunk may fill them
whole, its forward's cost not taken from its room (that forward must run for anything to move;
the cost still counts against what later pieces get), so opens on a quiet server run in fewer,
fuller chunks (each forward's fixed cost paid less often) and a lone follow-up's few tokens in
one forward, not two.

Pure: no torch, so the policy is tested on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# The share of the budget kept for starting answers however many answers are decoding.
MIN_PREFILL_SHARE = 4
# How many budgets a step may spend when no answer is decoding (no stream waits on it).
IDLE_FACTOR = 2


@dataclass(frozen=True)
class Pending:
    """What a turn still needs before its first token, as the scheduler sees it."""

    index: int  # the turn's position in the step's list
    decoding: bool
    tower_cost: int = 0  # budget units of vision-tower work still to run (0: encoded)
    prefill: int = 0  # prompt tokens still to prefill
    follow_up: bool = True  # a question on an open session (not an open or a one-shot answer)
    context: int = 0  # tokens its cache holds: what a chunk's attention reads


# The most tokens a chunk over `context` cached tokens may take in a forward that also runs the
# pieces planned so far ((context, tokens) each, a decoding answer one token): memory's bound.
RoomFor = Callable[[int, list[tuple[int, int]]], int]


@dataclass
class StepPlan:
    """The work of one step, by turn position."""

    decode: list[int] = field(default_factory=list)
    encode: list[int] = field(default_factory=list)
    prefill: dict[int, int] = field(default_factory=dict)  # position -> tokens in this chunk

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(self.prefill.values())


def plan_step(
    work: list[Pending],
    budget: int,
    forward_cost: int = 0,
    rider_cost: int | None = None,
    room_for: RoomFor | None = None,
) -> StepPlan:
    """Choose this step's decodes, tower runs and prefill chunks within `budget` tokens, a
    prefill chunk costing `forward_cost` on top of its tokens, or `rider_cost` where it rides a
    packed forward (None: the engine does not pack; every chunk runs a forward of its own),
    and no chunk larger than `room_for` allows (None: memory is not bounded)."""
    plan = StepPlan(decode=[w.index for w in work if w.decoding])
    planned = [(w.context, 1) for w in work if w.decoding]
    idle = not plan.decode
    if idle:
        budget *= IDLE_FACTOR
    cost = rider_cost if rider_cost is not None and not idle else forward_cost
    share = max(budget // MIN_PREFILL_SHARE, 1)
    left = max(budget - len(plan.decode), share)
    waiting = [w for w in work if not w.decoding]
    waiting.sort(key=lambda w: not w.follow_up)  # stable: arrival order within each class
    first = True
    for w in waiting:
        if w.tower_cost:
            if w.tower_cost > left and not first:
                break
            plan.encode.append(w.index)
            left -= w.tower_cost
        elif w.prefill:
            room = left - cost
            if first:  # the oldest always runs; idle, its forward is not taken from its room
                room = left if idle else max(room, share)
            if room <= 0:
                break
            chunk = min(w.prefill, room)
            if room_for is not None:
                fits = room_for(w.context, planned)
                if fits <= 0 and not first:
                    break
                chunk = max(min(chunk, fits), 1)
                planned.append((w.context, chunk))
            plan.prefill[w.index] = chunk
            left -= cost + chunk
            if rider_cost is not None:  # the step's forward now runs: later chunks ride it
                cost = rider_cost
        first = False
        if left <= 0:
            break
    return plan
