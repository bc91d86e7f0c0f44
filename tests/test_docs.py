"""Every snippet in the README and the docs runs, so none can go stale.

Fenced blocks must name their language. `python` and `sh` blocks run, in document order, in
one fresh interpreter per document (one namespace for its Python blocks; `sh` blocks in bash
with `set -euo pipefail`, the `tiercel` command on PATH). `toml` blocks are policies: each is
opened by a real Store (a lone non-memory tier gets a memory tier in front). A `json` block
marked `<!-- shape-of: COMMAND -->` documents a command's output: the command runs at that
point and its JSON must have the same keys at every level (values and list lengths may
differ). Other `json` blocks, `text` and `yaml` blocks are shown, not run (tests/test_environment.py
checks docs/deploy.md's manifests against its policy).

The world a document runs in (WORLD_POLICY): a working directory holding `tiercel.toml` with a
memory tier `ram` at /dev/shm/tiercel/run1 and an fs tier `disk` at /mnt/ckpt/run1 (`every =
10`, `keep = 3`), and, in Python, the names PRELUDE defines (np, torch, tiercel, a small
`model` and its optimizer `opt`, `step = 40`). The example paths /dev/shm/tiercel and
/mnt/ckpt in every snippet are mapped to directories of the test.

A block that cannot run here (a cluster, credentials, minutes of benchmark) is marked in the
markdown on the line before its fence: `<!-- not-run: why -->`; each shows up here as a
skipped test with that reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from conftest import TESTS_DIR, new_shm_root, run_isolated

REPO = TESTS_DIR.parent
#: The documents whose snippets run here: every document in docs/ and the README.
DOCS = [
    "README.md",
    "docs/api.md",
    "docs/architecture.md",
    "docs/benchmarks.md",
    "docs/cli.md",
    "docs/config.md",
    "docs/deepspeed.md",
    "docs/deploy.md",
    "docs/format.md",
    "docs/object-store.md",
    "docs/orbax.md",
    "docs/peer-suites.md",
    "docs/performance.md",
    "docs/pytorch.md",
    "docs/reliability.md",
    "docs/restore.md",
    "docs/scale.md",
    "docs/tiers.md",
    "docs/traffic.md",
    "docs/troubleshooting.md",
]
LANGUAGES = {"python", "sh", "toml", "json", "text", "yaml"}
RUNS = {"python", "sh", "toml", "json"}

WORLD_POLICY = """\
[[tier]]
name = "ram"
kind = "memory"
root = "/dev/shm/tiercel/run1"
keep = 2

[[tier]]
name = "disk"
kind = "fs"
url = "/mnt/ckpt/run1"
every = 10
keep = 3
compression = "zstd:3"

[store]
chunk_size = "64KiB"
threads = 2
io_threads = 2
"""

PRELUDE = """\
import numpy as np
import torch
import tiercel

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 64)).sum().backward()
opt.step()
step = 40
"""

FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(.*?)\s*-->\s*$")
SHAPE_OF = re.compile(r"^\s*<!--\s*shape-of:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    doc: str
    line: int  # of the first line of code (1-based)
    lang: str
    code: str
    not_run: str | None
    shape_of: str | None = None

    @property
    def runs(self) -> bool:
        return self.lang in RUNS and self.not_run is None and (self.lang != "json" or self.shape_of is not None)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    """The fenced blocks of a markdown file, with their language and not-run mark."""
    lines = (REPO / doc).read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m.group(1), m.group(2), m.group(3).strip()
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark, shape = NOT_RUN.match(prev), SHAPE_OF.match(prev)
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            j += 1
        assert j < len(lines), f"{doc}:{i + 1}: unclosed code block"
        code = "\n".join(l[len(indent):] if l.startswith(indent) else l for l in lines[i + 1:j]) + "\n"
        out.append(Block(doc, i + 2, lang, code, mark.group(1) if mark else None, shape.group(1) if shape else None))
        i = j + 1
    return out


ALL = [b for d in DOCS for b in blocks(d)]


def test_every_block_names_its_language():
    bad = [f"{b.where}: ```{b.lang}" for b in ALL if b.lang not in LANGUAGES]
    assert not bad, f"fenced blocks must be one of {sorted(LANGUAGES)}:\n" + "\n".join(bad)
    marked_but_shown = [b.where for b in ALL if b.not_run is not None and b.lang not in RUNS - {"json"}]
    assert not marked_but_shown, f"not-run marks on blocks that never run: {marked_but_shown}"
    misplaced = [b.where for b in ALL if b.shape_of is not None and b.lang != "json"]
    assert not misplaced, f"shape-of marks belong on json blocks: {misplaced}"
    assert all(b.not_run for b in ALL if b.not_run is not None), "a not-run mark must say why"


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    heads = re.findall(r"^#+\s+(.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_between_documents_resolve():
    bad = []
    for d in DOCS:
        path = REPO / d
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{d}: ({target}): no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{d}: ({target}): no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("block", [b for b in ALL if b.not_run is not None], ids=lambda b: b.where)
def test_not_run(block: Block):
    pytest.skip(f"{block.where} not run: {block.not_run}")


@pytest.mark.parametrize("doc", [d for d in DOCS if any(b.runs for b in blocks(d))])
def test_snippets_run(doc: str, tmp_path: Path):
    shm = new_shm_root("docs-")
    try:
        ran = run_isolated("test_docs", "run_document", [asdict(b) for b in blocks(doc)], str(tmp_path), str(shm),
                           timeout=600)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert ran == [b.where for b in blocks(doc) if b.runs]


def test_the_readme_policy_works_on_one_machine(tmp_path: Path):
    """The README's snippets against the README's own policy, whose peer tier wants two hosts:
    on this one machine it runs degraded, and every save, wait and restore still succeeds."""
    readme = blocks("README.md")
    policy = next(b for b in readme if b.lang == "toml").code
    assert 'kind = "peer"' in policy
    shm = new_shm_root("docs-readme-")
    try:
        ran = run_isolated("test_docs", "run_document", [asdict(b) for b in readme], str(tmp_path), str(shm), policy,
                           timeout=600)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert ran == [b.where for b in readme if b.runs]


# -- in the child interpreter ------------------------------------------------------------------


def map_paths(text: str, world: Path, shm: Path) -> str:
    """The documents' example paths, moved into the test's directories."""
    return text.replace("/dev/shm/tiercel", str(shm)).replace("/mnt/ckpt", str(world / "mnt-ckpt"))


def same_shape(documented: object, real: object, path: str) -> None:
    """The documented JSON has the keys the real output has, at every level (lists: their
    first elements, when both have one)."""
    if isinstance(real, dict):
        assert isinstance(documented, dict), f"{path}: documented {type(documented).__name__}, is an object"
        missing, extra = set(real) - set(documented), set(documented) - set(real)
        assert not missing and not extra, f"{path}: keys not documented {sorted(missing)}, documented but absent {sorted(extra)}"
        for k in real:
            same_shape(documented[k], real[k], f"{path}.{k}")
    elif isinstance(real, list):
        assert isinstance(documented, list), f"{path}: documented {type(documented).__name__}, is a list"
        if real and documented:
            same_shape(documented[0], real[0], f"{path}[0]")


def check_policy(b: Block, text: str, world: Path, shm: Path) -> None:
    doc = tomllib.loads(text)  # a syntax error names the line
    tiers = doc.get("tier", [])
    if not tiers or tiers[0].get("kind") != "memory":
        text = f'[[tier]]\nname = "front"\nkind = "memory"\nroot = "{shm}/front"\n\n' + text
    path = world / "policy-check.toml"
    path.write_text(text)
    import tiercel

    tiercel.Store(path, rank=0, world_size=1).close()


def run_document(block_dicts: list[dict], world_dir: str, shm_dir: str, policy: str = WORLD_POLICY) -> list[str]:
    """Runs a document's blocks in order in `world_dir` (its ./tiercel.toml: `policy`);
    returns where each one that ran is. Raises, naming the block, at the first that fails."""
    world, shm = Path(world_dir), Path(shm_dir)
    os.chdir(world)
    (world / "tiercel.toml").write_text(map_paths(policy, world, shm))
    bin_dir = world / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "tiercel"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tiercel "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    namespace: dict = {"__name__": "__docs__"}
    exec(PRELUDE, namespace)
    ran = []
    for b in (Block(**d) for d in block_dicts):
        if not b.runs:
            continue
        code = map_paths(b.code, world, shm)
        print(f"--- {b.where} ({b.lang})", flush=True)
        try:
            if b.lang == "python":
                # Padded so that tracebacks show the markdown file's own line numbers.
                exec(compile("\n" * (b.line - 1) + code, b.doc, "exec"), namespace)
            elif b.lang == "sh":
                p = subprocess.run(["bash", "-euo", "pipefail", "-c", code], env=env, capture_output=True, text=True,
                                   timeout=300)
                print(p.stdout + p.stderr, flush=True)
                if p.returncode != 0:
                    raise RuntimeError(f"exit code {p.returncode}")
            elif b.lang == "json":
                assert b.shape_of is not None
                p = subprocess.run(["bash", "-c", b.shape_of], env=env, capture_output=True, text=True, timeout=300)
                print(p.stdout + p.stderr, flush=True)
                same_shape(json.loads(code), json.loads(p.stdout), "$")
            else:
                check_policy(b, code, world, shm)
        except BaseException as e:
            raise RuntimeError(f"{b.where}: this {b.lang} block failed: {e}\n{traceback.format_exc()}") from None
        sys.stdout.flush()
        ran.append(b.where)
    namespace.clear()  # close stores the snippets left open before the shared memory goes
    return ran
