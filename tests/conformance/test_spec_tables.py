"""The suite's transcription of the spec (spec.py) still matches docs/protocol.md."""

from __future__ import annotations

import re

import pytest

from .daemons import REPO
from .spec import CLIENT_ONLY, E, T

pytestmark = pytest.mark.conformance

PROTOCOL = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The text of the '## N. <title>' section (numbers may change; titles do not)."""
    match = re.search(
        rf"^## \d+\. {re.escape(title)}[^\n]*\n(.*?)(?=^## \d+\. )", PROTOCOL + "\n## 0. end", re.S | re.M
    )
    assert match, f"docs/protocol.md has no section '{title}'"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-:| ]+\|$", line):
            rows.append([cell.strip().strip("`") for cell in line.strip().strip("|").split("|")])
    return rows


def test_message_types_match_the_spec() -> None:
    rows = [r for r in table_rows(section("Message types")) if r[0].isdigit()]
    assert {r[1]: int(r[0]) for r in rows} == {t.name: int(t) for t in T}


def test_error_codes_match_the_spec() -> None:
    """Every code the daemon may send is in the table with the suite's number; codes the
    suite does not know are client-side only (they are never on the wire)."""
    rows = [r for r in table_rows(section("Error codes")) if r[0].isdigit()]
    daemon_codes = {r[1]: int(r[0]) for r in rows if "client-side only" not in r[2]}
    assert daemon_codes == {e.name: int(e) for e in E if e not in CLIENT_ONLY}
    client_codes = {r[1]: int(r[0]) for r in rows if "client-side only" in r[2]}
    assert client_codes.items() >= {e.name: int(e) for e in CLIENT_ONLY}.items()
    assert all(code >= 64 for code in client_codes.values())
