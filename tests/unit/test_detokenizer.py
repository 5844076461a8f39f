import pytest
from tokenizers import Tokenizer

from executor_svc.model.builtin import byte_level_tokenizer_json
from scheduler_svc.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def stories_tok(stories_path):
    return Tokenizer.from_file(str(stories_path / "tokenizer.json"))


@pytest.fixture(scope="module")
def byte_tok():
    return Tokenizer.from_str(byte_level_tokenizer_json(512))


def stream(tok, prompt_ids, output_ids):
    d = IncrementalDetokenizer(tok, prompt_ids)
    return "".join(d.add_tokens([t]) for t in output_ids) + d.flush()


@pytest.mark.parametrize("text", ["Once upon a time, there was a little girl.", "  spaces  and\nnewlines", "naïve café"])
def test_streamed_text_equals_one_shot_decode_sentencepiece(stories_tok, text):
    prompt = stories_tok.encode("Hello").ids
    out = stories_tok.encode(text, add_special_tokens=False).ids
    full = stories_tok.decode(prompt + out, skip_special_tokens=True)
    assert stream(stories_tok, prompt, out) == full[len(stories_tok.decode(prompt, skip_special_tokens=True)):]


def test_multibyte_characters_are_held_back_until_complete(byte_tok):
    prompt = byte_tok.encode("x").ids
    out = byte_tok.encode("世界é", add_special_tokens=False).ids
    assert len(out) == 8  # 3 + 3 + 2 bytes
    d = IncrementalDetokenizer(byte_tok, prompt)
    deltas = [d.add_tokens([t]) for t in out]
    assert deltas == ["", "", "世", "", "", "界", "", "é"]
    assert "\ufffd" not in "".join(deltas)


def test_flush_emits_an_incomplete_trailing_character(byte_tok):
    d = IncrementalDetokenizer(byte_tok, byte_tok.encode("x").ids)
    assert d.add_tokens(byte_tok.encode("世", add_special_tokens=False).ids[:2]) == ""
    assert d.flush() == "\ufffd"


def test_special_tokens_produce_no_text(byte_tok):
    d = IncrementalDetokenizer(byte_tok, byte_tok.encode("x").ids)
    assert d.add_tokens([2]) == ""


def test_stop_string_is_cut_even_across_deltas():
    m = StopStringMatcher(("STOP",))
    released = [m.feed("hello S"), m.feed("TO"), m.feed("P and more")]
    assert released[-1][1] is True
    assert "".join(t for t, _ in released) == "hello "


def test_stop_matcher_without_stops_releases_everything_at_once():
    m = StopStringMatcher(())
    assert m.feed("abc") == ("abc", False)


def test_text_that_only_looks_like_a_stop_prefix_is_released_at_flush():
    m = StopStringMatcher(("END",))
    assert m.feed("the EN") == ("the ", False)
    assert m.flush() == "EN"


def test_stop_matcher_names_the_earliest_stop_string_hit():
    m = StopStringMatcher(("END", "at"))
    assert m.matched is None
    assert m.feed("the cat sat. END") == ("the c", True)
    assert m.matched == "at"


@pytest.mark.parametrize("per_step", [1, 3, 5], ids=["one-per-step", "three-per-step", "five-per-step"])
def test_a_step_of_several_tokens_stops_at_the_one_completing_a_stop_string(stories_tok, per_step):
    """A speculative step's tokens are searched one at a time: the delta
    keeps the token that completes the stop string and cuts the ones after
    it, and the text and tokens are those of one token per step."""
    from scheduler_svc.core.plan import SampledToken
    from scheduler_svc.output_processor import RequestOutputState
    from tests.factories import make_request

    prompt = stories_tok.encode("Once").ids
    out = stories_tok.encode(" upon a time, there was a girl named Lily. She liked to play.",
                             add_special_tokens=False).ids
    req = make_request(prompt=prompt, max_tokens=100, stop=("Lily",))
    state = RequestOutputState(req, stories_tok)
    tokens, text, cut = [], "", 0
    for i in range(0, len(out), per_step):
        delta = state.on_tokens([SampledToken(req, t) for t in out[i:i + per_step]])
        tokens += delta.token_ids
        text += delta.text
        if state.stopped_by_string:
            cut = delta.num_cut
            break
    # The stop string completes on the token whose text ends "Lily".
    completing = next(j for j in range(len(out)) if "Lily" in stories_tok.decode(prompt + out[:j + 1]))
    assert tokens == out[:completing + 1] and text == " upon a time, there was a girl named "
    assert cut == min(len(out), (completing // per_step + 1) * per_step) - (completing + 1)
