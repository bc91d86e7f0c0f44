"""The frameworks' own test files that `make peer-suites` runs, fetched at run time.

They are not in the frameworks' wheels (torch's test/ and DeepSpeed's tests/ never are,
Orbax leaves out its *_test.py), so they are downloaded from GitHub at a pinned commit into a
cache (~/.cache/tiercel/peer-suites/src), once: no copy of them lives in this repository, and
each file stays under its project's license. Where GitHub cannot be reached, `--from-git
NAME=GIT_DIR` takes them from a local clone holding the commit.

The commits are the nearest to the installed versions that this project could read (DeepSpeed
0.19.8, orbax-checkpoint 0.12.8, torch 2.15): where the tests moved ahead of the package, a
test fails with the stock backend too, and the table shows it on both sides.
"""

from __future__ import annotations

import dataclasses
import subprocess
import urllib.error
import urllib.request
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Upstream:
    name: str
    repo: str  # owner/name on GitHub
    commit: str
    files: tuple[str, ...]  # paths inside the repository

    def root(self, cache: Path) -> Path:
        return cache / "src" / f"{self.name}-{self.commit[:12]}"


DEEPSPEED = Upstream(
    "deepspeed",
    "deepspeedai/DeepSpeed",
    "edaa7221267243c7be7fb49c5d5f5c4fb97b4641",  # master after 0.19.5 (version.txt 0.19.6)
    (
        "tests/conftest.py",
        "tests/pytest.ini",
        "tests/unit/__init__.py",
        "tests/unit/common.py",
        "tests/unit/simple_model.py",
        "tests/unit/util.py",
        "tests/unit/checkpoint/common.py",
        "tests/unit/checkpoint/test_latest_checkpoint.py",
        "tests/unit/checkpoint/test_tag_validation.py",
        "tests/unit/checkpoint/test_other_optimizer.py",
        "tests/unit/checkpoint/test_lr_scheduler.py",
        "tests/unit/checkpoint/test_shared_weights.py",
    ),
)

ORBAX = Upstream(
    "orbax",
    "google/orbax",
    "3ff7b24aa0e23db4a575f7dc4bc6f815008ac6fd",  # orbax-checkpoint 0.12.4
    (
        "checkpoint/orbax/checkpoint/_src/handlers/standard_checkpoint_handler_test.py",
        "checkpoint/orbax/checkpoint/checkpoint_manager_test.py",
        "checkpoint/orbax/checkpoint/_src/testing/multiprocess_test.py",
        "checkpoint/orbax/checkpoint/_src/testing/oss/multiprocess_test.py",
    ),
)

TORCH = Upstream(
    "torch",
    "pytorch/pytorch",
    "02dee1ad31d013c458c5071f1710da10a2d50392",
    ("test/distributed/checkpoint/test_file_system_checkpoint_cpu.py",),
)

ALL = {u.name: u for u in (DEEPSPEED, ORBAX, TORCH)}


class FetchError(Exception):
    pass


def fetch(up: Upstream, cache: Path, git_dir: Path | None = None) -> Path:
    """The directory holding `up.files` at `up.commit` (downloaded once)."""
    root = up.root(cache)
    for path in up.files:
        dst = root / path
        if dst.exists():
            continue
        if git_dir is not None:
            r = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{up.commit}:{path}"], capture_output=True)
            if r.returncode != 0:
                raise FetchError(f"{git_dir} has no {path} at {up.commit}: {r.stderr.decode().strip()}")
            data = r.stdout
        else:
            url = f"https://raw.githubusercontent.com/{up.repo}/{up.commit}/{path}"
            try:
                with urllib.request.urlopen(url, timeout=60) as resp:
                    data = resp.read()
            except (urllib.error.URLError, OSError) as e:
                raise FetchError(
                    f"cannot download {url}: {e}. Without access to GitHub, pass a local clone of {up.repo} that "
                    f"holds commit {up.commit}: --from-git {up.name}=PATH/.git (or put the file at {dst})"
                ) from None
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(dst.suffix + ".part")
        tmp.write_bytes(data)
        tmp.rename(dst)
    return root
