"""The LLM judge's text side: its prompt filled from the template, and its answer read as a score in [0, 1].

No torch here, so both are tested in milliseconds and the judge's parser is the same wherever it runs.
"""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
"""A number as a judge writes it: 7, 8.5, .5, -1 (an exponent or a thousands separator is not read)."""


def fill(template: str, request: dict[str, Any]) -> str:
    """``template`` (task.judge_template) with {prompt}, {completion} and {answer} of a reward service request."""
    return template.format(prompt=str(request.get("prompt") or ""), completion=str(request["completion"]),
                           answer=str(request.get("answer") or ""))  # fmt: skip


def parse_score(answer: str, max_score: float) -> tuple[float | None, str]:
    """The first number of the judge's ``answer`` over ``max_score``, clipped to [0, 1], and ""; or None and the
    reason when the answer holds no number."""
    found = NUMBER.search(answer)
    if found is None:
        return None, f"the judge's answer holds no number: {answer[:80]!r}"
    return min(1.0, max(0.0, float(found.group()) / max_score)), ""
