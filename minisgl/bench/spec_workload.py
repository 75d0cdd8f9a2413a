"""A workload whose answers copy from the prompt (where speculative decoding by n-gram lookup pays):
repeat or correct a paragraph, edit a piece of code. Chat messages; `python -m minisgl.bench spec`."""

from __future__ import annotations

_PARAGRAPH = (
    "The lighthouse stood at the end of a narrow spit of land, where the river met the sea. Every "
    "evening the keeper climbed the one hundred and twelve steps to light the lamp, and every morning "
    "he climbed them again to put it out. Ships that passed in the night never saw him, but they saw "
    "his light, and that was enough to bring them safely into the harbour."
)
_TYPOS = (
    "Yesterday I went to the libary to borrow a book about astronomy. The librarian recomended a "
    "guide to the night sky, with maps of the constelations for every season. I read the first "
    "chapter on the bus home and learnt that the light from some stars takes thousands of years to "
    "reach us, so we see them as they were long ago."
)
_CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
_EMAIL = (
    "Hi team, the quarterly review has moved from Thursday to Friday at ten o'clock in the main "
    "meeting room. Please bring your project updates, the budget figures for the last three months, "
    "and any questions about the new hiring plan. Lunch will be provided after the meeting. Thanks, Maria"
)

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": f"Repeat the following paragraph exactly, word for word:\n\n{_PARAGRAPH}"}],
    [{"role": "user", "content": f"Correct the spelling mistakes in this paragraph and write it out in full:\n\n{_TYPOS}"}],
    [{"role": "user", "content": f"Rename the variable `total` to `amount` in this Python code and show the whole "
                                 f"code:\n\n```python\n{_CODE}```"}],
    [{"role": "user", "content": f"Add a docstring to each function in this code and show the whole code:\n\n"
                                 f"```python\n{_CODE}```"}],
    [{"role": "user", "content": f"Copy this email, but change Friday to Monday:\n\n{_EMAIL}"}],
    [{"role": "user", "content": f"Rewrite this paragraph in the past tense, keeping everything else the same:\n\n"
                                 f"{_PARAGRAPH}"}],
]
