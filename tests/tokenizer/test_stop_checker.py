from hypothesis import given, settings
from hypothesis import strategies as st

from services.tokenizer.stop_strings import StopChecker


def feed(checker: StopChecker, pieces: list[str]) -> tuple[str, str | None]:
    out = []
    for piece in pieces:
        emit, stop = checker.append(piece)
        out.append(emit)
        if stop is not None:
            return "".join(out), stop
    out.append(checker.flush())
    return "".join(out), None


def test_stop_string_split_across_pieces_is_found_and_not_returned() -> None:
    text, stop = feed(StopChecker(["END"]), ["Hello E", "N", "D and more"])
    assert (text, stop) == ("Hello ", "END")


def test_include_stop_str_in_output() -> None:
    text, stop = feed(StopChecker(["END"], include_stop_str_in_output=True), ["ab", "EN", "Dx"])
    assert (text, stop) == ("abEND", "END")


def test_tail_that_could_start_a_stop_string_is_held_back_then_released() -> None:
    checker = StopChecker(["STOP"])
    assert checker.append("go ST") == ("go", None)  # " ST" might be the start of "STOP"
    assert checker.append("ART") == (" ST", None)   # always len("STOP") - 1 held back
    assert checker.flush() == "ART"


def test_earliest_of_several_stop_strings_wins() -> None:
    assert feed(StopChecker(["world", "lo"]), ["hello world"]) == ("hel", "lo")


@settings(max_examples=300, derandomize=True)
@given(text=st.text(alphabet="abcXY", max_size=40), stop=st.text(alphabet="abXY", min_size=1,
       max_size=4), cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_streaming_equals_matching_on_the_whole_text(text: str, stop: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, matched = feed(StopChecker([stop]), pieces)
    index = text.find(stop)
    if index == -1:
        assert (emitted, matched) == (text, None)
    else:
        assert (emitted, matched) == (text[:index], stop)


def test_min_tokens_holds_back_stop_strings_until_then() -> None:
    """vLLM's rule: a stop string counts only if it ends after the first min_tokens' text."""
    checker = StopChecker(["."], min_tokens=3)
    assert checker.append("a.", 1) == ("a.", None)
    assert checker.append("b.", 2) == ("b.", None)
    assert checker.append("c", 3) == ("c", None)
    assert checker.append("d.e", 4) == ("d", ".")


def test_min_tokens_lets_a_stop_string_straddle_the_boundary() -> None:
    checker = StopChecker(["END"], min_tokens=1)
    assert checker.append("xEN", 1) == ("x", None)   # "EN" might start a stop string
    assert checker.append("D", 2) == ("", "END")     # it ends after the first token's text


def test_min_tokens_survive_a_resume() -> None:
    checker = StopChecker(["!"], min_tokens=2)
    checker.resume("hi!", num_emitted=3, min_end=3)  # both tokens of "hi!" were under min
    assert checker.append("x!", 3) == ("x", "!")
