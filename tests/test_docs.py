"""Every ```python block of README.md and docs/*.md runs, as written.

Each block runs on its own, in a fresh namespace, from the repository root
(the paths in the blocks are relative to it): a block that uses a name must
define or import it. A block preceded by a line `<!-- skip: REASON -->`
(a GPU, torch, AlphaFold2's parameter files) is reported as skipped with
that reason; `<!-- gpu: REASON -->` runs the block on a GPU and skips it
elsewhere; `<!-- devices: N -->` runs the block in a subprocess with N
simulated CPU devices (on a GPU machine too). `test_blocks_are_counted` prints
how many ran.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(
    r"(?:^<!-- (?P<marker>skip|devices|gpu): (?P<arg>[^\n]*?) -->\n)?^```python\n(?P<code>.*?)^```",
    re.S | re.M,
)


def blocks():
    """`(page, line, marker, argument, code)` of every python block, in page order."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code"))
            found.append((page.relative_to(ROOT).as_posix(), line, match["marker"], match["arg"],
                          match["code"]))
    return found


BLOCKS = blocks()


@pytest.mark.parametrize("page, line, marker, arg, code", BLOCKS,
                         ids=[f"{page}:{line}" for page, line, *_ in BLOCKS])
def test_block_runs(page, line, marker, arg, code, monkeypatch):
    if marker == "skip":
        pytest.skip(f"{page}:{line}: {arg}")
    if marker == "gpu" and jax.default_backend() != "gpu":
        pytest.skip(f"{page}:{line}: needs a GPU ({arg})")
    monkeypatch.chdir(ROOT)
    if marker == "devices":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={int(arg)}"
        env["JAX_PLATFORMS"] = "cpu"  # simulated devices, also on a machine with one GPU
        result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{page}:{line}\n{result.stderr[-3000:]}"
        return
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "__doc_block__"})


def test_blocks_are_counted(capsys):
    """Each page that has code has python blocks; prints the counts."""
    skipped = [b for b in BLOCKS if b[2] == "skip" or (b[2] == "gpu" and jax.default_backend() != "gpu")]
    per_page = {}
    for page, *_ in BLOCKS:
        per_page[page] = per_page.get(page, 0) + 1
    assert per_page.get("README.md", 0) >= 3
    for page in PAGES:  # a block the pattern missed (a marker typo, say) would go unrun
        opened = page.read_text().count("\n```python\n") + page.read_text().startswith("```python\n")
        assert opened == per_page.get(page.relative_to(ROOT).as_posix(), 0), page
    with capsys.disabled():
        print(f"\ndoc blocks: {len(BLOCKS)} in {len(per_page)} of {len(PAGES)} pages, {len(BLOCKS) - len(skipped)} run, "
              f"{len(skipped)} skipped: {per_page}")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_and_anchors_exist(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page.name}: {target}"
