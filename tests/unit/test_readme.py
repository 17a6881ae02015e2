"""README.md's shape (issue 35): short, and every code block either runs as written (the demo
test runs them: tests/integration/test_demo.py) or says why it does not."""

from __future__ import annotations

import pytest

from tests.readme_blocks import LANGUAGES, README, readme_blocks

MAX_LINES = 150


def test_the_readme_fits_on_a_few_screens() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= MAX_LINES


def test_every_block_runs_or_says_why_not() -> None:
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    assert blocks
    for block in blocks:
        assert block.language in LANGUAGES, f"{block}: not sh or python"
    skipped = {block.section: block.skip for block in blocks if block.skip is not None}
    assert set(skipped) == {"The two commands", "Your own model"}, skipped
    assert all(len(reason) > 10 for reason in skipped.values()), skipped
    own = [(b.language, b.skip is None) for b in blocks if b.section == "Your own model"]
    assert ("python", True) in own and ("sh", True) in own  # the export and push..query run
    runnable = "".join(block.code for block in blocks if block.skip is None)
    assert "torch.onnx.export" in runnable and "dynamo=False" in runnable
    assert "--wait" in runnable and "/v2/models/wine/infer" in runnable
    # The token's path and the port come from the settings, never written out.
    assert ".local/share" not in runnable and ":8000" not in runnable.replace(":-8000", "")


def test_the_convention_reads_skips_sections_and_fences() -> None:
    text = "\n".join(
        [
            "## One",
            "<!-- readme-test: skip (runs until Ctrl-C) -->",
            "```sh",
            "make demo",
            "```",
            "## Two",
            "Some text.",
            "```python",
            "print(1)",
            "```",
        ]
    )
    first, second = readme_blocks(text)
    assert (first.section, first.language, first.code, first.skip, first.line) == (
        "One",
        "sh",
        "make demo\n",
        "runs until Ctrl-C",
        3,
    )
    assert (second.section, second.language, second.skip) == ("Two", "python", None)
    with pytest.raises(ValueError, match="never closed"):
        readme_blocks("```sh\nmake demo\n")
