"""Quick checks: one multiple-choice question with an explanation, shown where a chapter makes its point.

    QuickCheck("Which collective ...?", ["broadcast", "all_reduce"], answer_index=1,
               explanation="all_reduce leaves the sum on every rank.")

In a notebook it shows as a widget: the options, a "Check" button, and feedback. A wrong pick says so
and lets you try again; the second wrong pick shows the answer with its explanation. Anywhere else
(a terminal, a static render of the notebook) it prints the question and options as text; call
`.check(i)` to answer and `.reveal()` to see the answer. Text between backticks is code, as in the chapters'
Markdown: set in code type in the widget (its options, plain-text labels, lose the backticks).
"""
from __future__ import annotations

import html
import re
import sys
from dataclasses import dataclass

REVEAL_AFTER = 2  # wrong picks before the answer is shown
INLINE_CODE = re.compile(r"`([^`]+)`")


def inline_html(text: str) -> str:
    """Text as HTML, escaped, with `code` between backticks set as <code>code</code> (as Markdown does)."""
    return INLINE_CODE.sub(lambda m: f"<code>{m.group(1)}</code>", html.escape(text))


def plain_label(text: str) -> str:
    """Text for a plain-text label (a radio button's): `code` loses its backticks."""
    return INLINE_CODE.sub(r"\1", text)


@dataclass(frozen=True)
class Feedback:
    correct: bool
    text: str  # plain text; html() for the widget

    def html(self) -> str:
        colour = "#2e7d32" if self.correct else "#c62828"
        return f"<div style='color:{colour}'>{inline_html(self.text)}</div>"


class QuickCheck:
    def __init__(self, question: str, options: list[str], answer_index: int, explanation: str):
        if not isinstance(options, (list, tuple)) or len(options) < 2:
            raise ValueError(f"options must be a list of at least 2 answers, got {options!r}")
        if not isinstance(answer_index, int) or not 0 <= answer_index < len(options):
            raise ValueError(f"answer_index must be an int in 0..{len(options) - 1} (an index into options), "
                             f"got {answer_index!r}")
        self.question, self.options = question, [str(o) for o in options]
        self.answer_index, self.explanation = answer_index, explanation
        self.wrong_tries = 0

    def check(self, choice: int) -> Feedback:
        """Feedback for picking options[choice]; counts wrong tries so the answer shows after REVEAL_AFTER."""
        if not isinstance(choice, int) or not 0 <= choice < len(self.options):
            raise ValueError(f"choice must be an option index in 0..{len(self.options) - 1}, got {choice!r}")
        if choice == self.answer_index:
            return Feedback(True, f"Correct. {self.explanation}")
        self.wrong_tries += 1
        if self.wrong_tries >= REVEAL_AFTER:
            return Feedback(False, f"Not quite. The answer is “{self.options[self.answer_index]}”. {self.explanation}")
        return Feedback(False, f"Not quite: “{self.options[choice]}” is not it. Try again.")

    def reveal(self) -> str:
        return f"Answer: {self.options[self.answer_index]}. {self.explanation}"

    # --- display ---------------------------------------------------------------------------------
    def text(self) -> str:
        lines = [f"Quick check: {self.question}"]
        lines += [f"  {i}) {o}" for i, o in enumerate(self.options)]
        lines.append("(In JupyterLab: pick one and press Check. Elsewhere: .check(i) answers, .reveal() shows the answer.)")
        return "\n".join(lines)

    __str__ = text

    def __repr__(self) -> str:
        return f"QuickCheck({self.question!r}, {len(self.options)} options)"

    def widget(self):
        """RadioButtons + Check button + feedback, as one ipywidgets VBox."""
        import ipywidgets as w

        choices = w.RadioButtons(options=[(plain_label(o), i) for i, o in enumerate(self.options)], value=None,
                                 layout=w.Layout(width="max-content"))
        button, feedback = w.Button(description="Check", button_style="primary"), w.HTML()

        def on_click(_):
            if choices.value is None:
                feedback.value = "<i>Pick an answer first.</i>"
            else:
                feedback.value = self.check(choices.value).html()

        button.on_click(on_click)
        title = w.HTML(f"<b>Quick check:</b> {inline_html(self.question)}")
        return w.VBox([title, choices, button, feedback])

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = {"text/plain": self.text()}
        if _in_kernel():
            view = self.widget()._repr_mimebundle_()
            bundle.update({k: v for k, v in view.items() if k != "text/plain"})
        return bundle


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets can render); False in a terminal or plain Python."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython

        return getattr(get_ipython(), "kernel", None) is not None
    except ImportError:
        return False


_in_kernel = in_kernel  # QuickCheck's name for it (its tests replace it)
