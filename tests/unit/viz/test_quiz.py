"""Quick checks: feedback for right and wrong answers, the answer shown after two misses, bad input refused."""
import pytest

from gpucourse import quiz
from gpucourse.viz.quiz import QuickCheck


def make():
    return QuickCheck("Which collective leaves the sum on every rank?", ["broadcast", "all_reduce", "reduce"], 1,
                      "all_reduce sums and gives everyone the result.")


def test_right_answer_is_confirmed_with_the_explanation():
    fb = make().check(1)
    assert fb.correct and fb.text.startswith("Correct") and "gives everyone the result" in fb.text


def test_wrong_answer_says_so_and_hides_the_answer_the_first_time():
    fb = make().check(2)
    assert not fb.correct and "reduce" in fb.text and "Try again" in fb.text
    assert "all_reduce" not in fb.text  # not given away yet


def test_second_wrong_answer_reveals_answer_and_explanation():
    q = make()
    q.check(0)
    fb = q.check(2)
    assert not fb.correct and "all_reduce" in fb.text and "gives everyone the result" in fb.text


def test_feedback_html_is_coloured_and_escaped():
    q = QuickCheck("a < b?", ["<yes>", "no"], 0, "because a & b")
    assert "#2e7d32" in q.check(0).html() and "&amp;" in q.check(0).html()
    assert "#c62828" in q.check(1).html()


@pytest.mark.parametrize("index", [3, -1, "1", 1.0])
def test_bad_answer_index_raises_value_error(index):
    with pytest.raises(ValueError, match="answer_index"):
        QuickCheck("q", ["a", "b", "c"], index, "e")


def test_too_few_options_raises_value_error():
    with pytest.raises(ValueError, match="at least 2"):
        QuickCheck("q", ["only"], 0, "e")


def test_choice_out_of_range_raises_value_error():
    with pytest.raises(ValueError, match="choice"):
        make().check(5)


def test_text_mode_shows_question_and_options_but_not_the_answer():
    q = make()
    text = str(q)
    assert "Which collective" in text and "0) broadcast" in text and "2) reduce" in text
    assert "gives everyone the result" not in text
    assert q._repr_mimebundle_() == {"text/plain": text}  # no kernel here: text only
    assert "all_reduce" in q.reveal() and "gives everyone the result" in q.reveal()


def test_widget_checks_the_selected_option(monkeypatch):
    q = make()
    box = q.widget()
    title, choices, button, feedback = box.children
    assert "Which collective" in title.value and [label for label, _ in choices.options] == q.options
    button.click()
    assert "Pick an answer" in feedback.value
    choices.value = 1
    button.click()
    assert "Correct" in feedback.value
    monkeypatch.setattr(quiz, "_in_kernel", lambda: True)
    assert "application/vnd.jupyter.widget-view+json" in q._repr_mimebundle_()


def test_inline_code_shows_as_code_not_backticks():
    q = QuickCheck("What does `if not grads: continue` do?", ["`x < y`", "no"], 0, "see `dist.all_reduce`")
    title, choices, _, feedback = q.widget().children
    assert "<code>if not grads: continue</code>" in title.value and "`" not in title.value
    assert choices.options[0][0] == "x < y"  # a plain-text label: the backticks dropped
    assert "<code>dist.all_reduce</code>" in q.check(0).html() and "`" not in q.check(0).html()
    assert "<code>x &lt; y</code>" in QuickCheck("`x < y`?", ["a", "b"], 0, "e").widget().children[0].value
    assert "`if not grads: continue`" in q.text()  # text mode keeps Markdown's backticks
