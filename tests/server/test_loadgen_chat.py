"""The multi-turn chat load: its plan, and runs against real emulated engines (in-process, loopback)
where later turns hit the cache their earlier turns filled and a new salt shares nothing."""

from __future__ import annotations

import itertools

import pytest

from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.loadgen import BlockText
from kvroute.loadgen.chat import ChatLoad, ChatTurn, run_chat
from kvroute.tokenizer import Tokenizer


def test_plan_offers_the_rate_and_is_a_function_of_the_seed() -> None:
    load = ChatLoad(conversations=20, turns=3, gap_s=0.5, system_prompts=4, user_tokens=(5, 9))
    plan = load.plan(seed=3)
    assert load.rate == 40.0 and plan == load.plan(seed=3) and plan != load.plan(seed=4)
    assert len(plan) == 20 and all(len(turns) == 3 for turns in plan)
    arrivals = sorted(t.arrival for turns in plan for t in turns)
    assert arrivals[0] == 0.0 and arrivals[-1] == pytest.approx(load.duration_s)
    for second in range(3):  # 20 sends in each half-second window: the rate holds from the start
        assert sum(second * 0.5 <= a < (second + 1) * 0.5 for a in arrivals) == 20
    for turns in plan:
        assert [t.turn for t in turns] == [0, 1, 2]
        assert {t.system for t in turns} == {turns[0].system} and 0 <= turns[0].system < 4
        assert all(5 <= t.user_tokens <= 9 for t in turns)
        assert [b.arrival - a.arrival for a, b in itertools.pairwise(turns)] == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize(
    "kw",
    [{"conversations": 0}, {"conversations": 1, "gap_s": 0}, {"conversations": 1, "user_tokens": (5, 4)}],
)
def test_bad_loads_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ChatLoad(**kw)  # type: ignore[arg-type]


async def test_turns_hit_their_history_and_salts_share_nothing(tokenizer: Tokenizer) -> None:
    settings = EmulatorSettings(
        model_name="emu",
        engine=EngineConfig(num_kv_blocks=8192, report_tokens=True, max_model_len=32768),
        time_scale=200.0,
    )
    engines = [EmulatorServer(settings, costmod.get_profile().cost, tokenizer) for _ in range(2)]
    urls = [f"http://127.0.0.1:{await e.start('127.0.0.1', 0)}" for e in engines]
    text = BlockText(tokenizer)
    load = ChatLoad(
        conversations=6, turns=3, gap_s=0.2, system_prompts=2, system_tokens=96, user_tokens=(20, 40)
    )

    def by_system(turn: ChatTurn) -> str:
        return urls[turn.system % 2]

    try:
        first = await run_chat(by_system, load, text, "emu", seed=5, salt=1)
        again = await run_chat(by_system, load, text, "emu", seed=5, salt=1)
        fresh = await run_chat(by_system, load, text, "emu", seed=5, salt=2)
    finally:
        for e in engines:
            await e.stop()
    for res in (first, again, fresh):
        assert (res.requests, res.unfinished, res.errors) == (18, 0, {})
        assert res.recorder.output_tokens == 18 * load.output_tokens
    hit = [r.recorder.summary()["kv_hit_rate"] for r in (first, again, fresh)]
    # system prompts shared by conversations and each turn's history: well above zero on a cold cache
    assert hit[0] > 0.4
    # the same text again is (nearly) all cached; a new salt starts as cold as the first run
    assert hit[1] > hit[0] + 0.15
    assert fresh.recorder.prompt_tokens == first.recorder.prompt_tokens
    assert abs(hit[2] - hit[0]) < 0.05
