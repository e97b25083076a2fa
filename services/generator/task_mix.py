"""Openers that steer prompt synthesis across the tasks users bring, where free Magpie sampling from a small
target mostly writes small talk and requests for help ("Can you help me ...").

A candidate's user turn starts with an opener and the target writes the rest, so the request is still the
target's own words. The categories are Magpie's task taxonomy (Xu et al., 2024, §3: information seeking,
reasoning, planning, editing, coding, math, role play, data analysis, creative writing, advice, brainstorming);
the openers are generic task phrasings, not taken from any evaluation set. An empty opener is free sampling, so
the mix keeps some of the target's own choice of topic.
"""
from __future__ import annotations

import itertools

TASK_OPENERS: dict[str, tuple[str, ...]] = {
    "information seeking": ("What is", "How does", "Why do", "Explain the difference between"),
    "reasoning": ("If", "Is the following argument valid?", "Which is more likely:", "Three friends"),
    "planning": ("Help me plan", "Create a schedule for", "What steps should I take to"),
    "editing": ("Rewrite the following paragraph", "Proofread this text:", "Make this email more formal:"),
    "coding": ("Write a Python function that", "Why does this code", "Write a SQL query", "Implement a"),
    "math": ("Solve", "Calculate", "What is the probability that", "Find the derivative of"),
    "role play": ("You are a", "Pretend you are", "Act as a"),
    "data analysis": ("Given the following data,", "Summarize the main points of", "Extract"),
    "creative writing": ("Write a short story", "Write a poem about", "Write a blog post", "Compose a"),
    "advice seeking": ("How can I", "What should I do", "I'm"),
    "brainstorming": ("Give me ideas for", "List", "Suggest"),
    "free": ("",),
}


def task_openers() -> list[str]:
    """The openers round-robin across categories, so any run of consecutive candidates spans every category."""
    cols = itertools.zip_longest(*TASK_OPENERS.values())
    return [o for row in cols for o in row if o is not None]
