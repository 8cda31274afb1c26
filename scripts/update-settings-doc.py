#!/usr/bin/env python3
"""Rewrites the settings table in docs/operations.md from cachexferd.config."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cachexferd.config import settings_markdown

doc = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
text = doc.read_text()
new = re.sub(
    r"(<!-- settings:begin -->\n).*?(<!-- settings:end -->)",
    lambda m: m.group(1) + settings_markdown() + "\n" + m.group(2),
    text,
    flags=re.S,
)
doc.write_text(new)
print("docs/operations.md settings table updated" if new != text else "docs/operations.md already current")
