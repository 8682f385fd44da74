"""The documentation agrees with the code and with itself.

``docs/flags.md`` is the generator's output for the one flag set; every
relative link in ``README.md`` and ``docs/*.md`` names a file that exists; the
README stays a short manual. Nothing else reads the README.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from radixmux.common import flags_doc
from radixmux.common.server_args import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 220
# [text](target) and ![alt](target); the target ends at whitespace or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def test_flags_doc_is_the_generators_output() -> None:
    written = (ROOT / "docs" / "flags.md").read_text()
    assert written == flags_doc.render(), (
        "docs/flags.md is stale: python -m radixmux.common.flags_doc > docs/flags.md"
    )


def test_flags_doc_lists_every_flag_once() -> None:
    text = flags_doc.render()
    for action in build_parser()._actions:
        for name in action.option_strings:
            if name.startswith("--") and name != "--help":
                assert len(re.findall(rf"^\| `{name}[ `]", text, re.M)) == 1, name


def test_flags_doc_refuses_a_group_naming_an_unknown_flag(monkeypatch) -> None:
    monkeypatch.setattr(flags_doc, "GROUPS", (("Models", ("--no-such-flag",)),))
    with pytest.raises(KeyError, match="--no-such-flag"):
        flags_doc.render()


def _relative_links(doc: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code is not a link
    targets = [t.split("#", 1)[0] for t in LINK.findall(text)]
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    missing = [t for t in _relative_links(doc) if not (doc.parent / t).exists()]
    assert missing == [], f"{doc.name} links to missing files: {missing}"


def test_link_check_sees_links_and_skips_urls_and_anchors(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "[a](a.md) ![p](img/p.png) [web](https://example.com/x) [here](#top) [b](b.md#part)\n"
        "```\n[not](code.md)\n```\n"
    )
    assert _relative_links(doc) == ["a.md", "img/p.png", "b.md"]


def test_readme_is_a_short_manual() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
