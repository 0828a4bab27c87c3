"""The one rule for a cumulative stream (stoker.protocol.CumulativeStream: TensorRT-LLM's llmapi model sends the whole
output so far in each response): what each response adds, what a revision changed, and the smoke record built on it.

The streams below are what the llmapi model sends: its stand-in (stoker/triton/models/llmapi.py) cuts a stop string
from the final output after streaming part of it, and whole-text detokenization ends a text inside a character with
U+FFFD until the next token completes it."""

from __future__ import annotations

import io

import pytest

from stoker.protocol import ENSEMBLE, LLMAPI, CumulativeStream, Part
from stoker.serving import probe

# Stop string "gam": "alpha ga" streamed, then the final output cut before "gam".
WITHDRAWN = ["alpha", "alpha g", "alpha ga", "alpha "]
# A token ends inside "é" (U+FFFD), the next completes it.
COMPLETED = ["caf\ufffd", "café", "café au lait"]


def _assemble(responses: list[str], interface=LLMAPI) -> str:
    """A client that keeps only the text it received (promotion_kit's and the bench's way before the rule)."""
    out = b""
    for text in responses:
        out += interface.new_part(text.encode(), out)
    return out.decode()


def test_a_revised_response_is_not_counted_twice():
    # Before the rule, new_part returned the whole text when it did not start with what was received, and the
    # caller appended it: "alpha gaalpha " and "caf\ufffdcafé au lait".
    assert _assemble(WITHDRAWN) == "alpha ga"  # what was sent stays sent; nothing is sent twice
    assert _assemble(COMPLETED) == "caf\ufffd au lait"
    assert _assemble(["al", "alpha", "alpha beta"]) == "alpha beta"
    # the ensemble streams new parts: each is all new
    assert _assemble(["tok0 ", "tok1 "], ENSEMBLE) == "tok0 tok1 "


def test_the_rule_hands_each_position_on_once_and_reports_what_a_revision_changed():
    s = CumulativeStream()
    assert [s.push(t) for t in WITHDRAWN[:3]] == [Part("alpha"), Part(" g"), Part("a")]
    assert s.push(WITHDRAWN[3], final=True) == Part("", revised="ga")
    assert (s.received, s.output, s.revisions) == ("alpha ga", "alpha ", ["ga"])
    # a changed character: only what lies beyond the positions already sent is new
    c = CumulativeStream()
    assert [c.push(t) for t in ("abc", "abX", "abXd", "abXde")] == [Part("abc"), Part("", "c"), Part("d"), Part("e")]
    assert c.received == "abcde" and c.output == "abXde" and c.revisions == ["c"]  # reported once, not per response
    # withdrawn, then grown again: the positions already sent are not sent again
    w = CumulativeStream()
    assert [w.push(t).new for t in ("hello wor", "hello", "hello world")] == ["hello wor", "", "ld"]
    assert w.revisions == [" wor"]


def test_an_incomplete_character_waits_for_the_response_that_completes_it():
    s = CumulativeStream()
    assert [s.push(t) for t in COMPLETED] == [Part("caf"), Part("é"), Part(" au lait")]
    assert s.revisions == [] and s.received == s.output == "café au lait"
    # nothing completes it: it comes out at the end, as it stands
    e = CumulativeStream()
    assert e.push("x\ufffd") == Part("x") and e.flush() == Part("\ufffd") and e.received == "x\ufffd"
    assert CumulativeStream().push("x\ufffd", final=True) == Part("x\ufffd")
    assert e.flush() == Part("")  # a second end adds nothing


def test_a_streamed_answer_is_the_models_final_output():
    a = LLMAPI.answer()
    added = [a.add(t.encode()) for t in WITHDRAWN]
    assert added == [b"alpha", b" g", b"a", b""] and a.end() == b""
    assert a.text == b"alpha " and a.revisions == ["ga"]
    u = LLMAPI.answer()
    assert b"".join(u.add(t.encode()) for t in COMPLETED) + u.end() == "café au lait".encode() == u.text
    # the ensemble's parts are joined as bytes: a token may end inside a character
    e = ENSEMBLE.answer()
    assert [e.add(b) for b in (b"caf\xc3", b"\xa9!")] == [b"caf\xc3", b"\xa9!"]
    assert e.end() == b"" and e.text.decode() == "café!" and e.revisions == []


def test_text_of_reads_a_generate_response():
    assert LLMAPI.text_of({"text_output": "é"}) == "é".encode()
    assert LLMAPI.text_of({"text_output": ["a", "b"]}) == b"ab"  # a [-1]-shaped output as a JSON list
    assert LLMAPI.text_of({"finish_reason": "stop"}) == b""


def _sse(events: list[dict]) -> bytes:
    import json

    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


@pytest.fixture
def served(monkeypatch):
    """probe.smoke's HTTP call answered with the SSE body set in ``served.body``."""

    class Served:
        body = b""
        request = None

    def urlopen(request, timeout):
        Served.request = request
        return io.BytesIO(Served.body)

    monkeypatch.setattr(probe.urllib.request, "urlopen", urlopen)
    return Served


def test_the_smoke_record_of_a_cumulative_stream_is_its_final_text(served):
    finish = ["None"] * (len(COMPLETED) - 1) + ["length"]
    served.body = _sse([{"text_output": t, "finish_reason": f} for t, f in zip(COMPLETED, finish)])
    record = probe.smoke("http://backend", LLMAPI)
    # before the rule the record joined the events: "caf\ufffdcafécafé au lait"
    assert record["text"] == "café au lait" and record["events"] == 3 and record["revisions"] == 0
    assert served.request.full_url == "http://backend/v2/models/tensorrt_llm/generate_stream"
    served.body = _sse([{"text_output": t} for t in WITHDRAWN])
    record = probe.smoke("http://backend", LLMAPI)
    assert record["text"] == "alpha " and record["revisions"] == 1
    # the ensemble's events are parts: joined
    served.body = _sse([{"text_output": t} for t in ("tok0 ", "tok1 ")])
    assert probe.smoke("http://backend")["text"] == "tok0 tok1 "
