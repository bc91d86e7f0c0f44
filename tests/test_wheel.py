"""The wheel a user installs. `make wheel` builds an abi3 wheel for glibc 2.17 and newer
(manylinux2014), stripped, into dist/ (rebuilt only when a source changed); here it is
checked with auditwheel, installed into a fresh virtualenv with no Rust toolchain on PATH
and no way to reach this checkout, and used as a user would: a save, a restore, and the
`tiercel` command.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from elftools.elf.elffile import ELFFile  # auditwheel's own ELF reader

import tiercel

from conftest import TESTS_DIR, new_shm_root

REPO = TESTS_DIR.parent
DIST = REPO / "dist"
#: glibc 2.17: CentOS 7, Ubuntu 14.04 and everything newer (PEP 599's manylinux2014).
PLATFORM = "manylinux_2_17_x86_64"
#: What the stripped extension must stay under (82 MB with the release profile's debug info).
MAX_SO_BYTES = 40 << 20


@pytest.fixture(scope="module")
def wheel() -> Path:
    venv = Path(sys.prefix)
    # -o: the virtualenv running this test is set up already; never reinstall into it here.
    # A cold build compiles every dependency with zig (minutes); a warm one takes seconds,
    # and none at all when dist/ is newer than every source.
    p = subprocess.run(["make", "-o", str(venv / ".tiercel-deps"), "wheel", f"VENV={venv}"],
                       cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f"make wheel failed\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-8000:]}"
    wheels = sorted(DIST.glob(f"tiercel-{tiercel.__version__}-*.whl"))
    assert len(wheels) == 1, f"expected one tiercel {tiercel.__version__} wheel in {DIST}, found {wheels}"
    return wheels[0]


def test_wheel_is_abi3_manylinux2014_stripped_and_licensed(wheel: Path):
    _name, _version, python, abi, platforms = wheel.name.removesuffix(".whl").split("-")
    assert (python, abi) == ("cp311", "abi3") and PLATFORM in platforms.split("."), wheel.name
    p = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())  # auditwheel wraps its lines
    assert f'is consistent with the following platform tag: "{PLATFORM}"' in text, p.stdout

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        so = z.read("tiercel/_core.abi3.so")
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        licenses = [n for n in names if ".dist-info/" in n and n.endswith("/LICENSE")]
        assert licenses, names
        assert "Apache License" in z.read(licenses[0]).decode()
    for f in ("tiercel/py.typed", "tiercel/_core.pyi", "tiercel/cli/__init__.py"):
        assert f in names, f
    assert "tiercel=tiercel.cli:main" in entry_points.replace(" ", "")
    assert "Apache-2.0" in metadata and "Requires-Python: >=3.11" in metadata

    assert len(so) < MAX_SO_BYTES, f"_core.abi3.so is {len(so) >> 20} MiB: not stripped?"
    so_path = DIST / ".check-core.so"
    so_path.write_bytes(so)
    try:
        with open(so_path, "rb") as f:
            sections = {s.name for s in ELFFile(f).iter_sections()}
    finally:
        so_path.unlink()
    assert not sections & {".symtab", ".debug_info", ".debug_line"}, sorted(sections)


USER_SCRIPT = r"""
import sys, numpy as np, tiercel
policy = sys.argv[1]
assert tiercel.__file__.startswith(sys.prefix), tiercel.__file__  # the installed wheel, not a checkout
state = {"model": {"w": np.arange(300_000, dtype=np.float32), "b": np.full(7, 0.5)}, "meta": {"step": 2, "lr": 1e-3}}
with tiercel.Store(policy) as store:
    store.save(2, state).wait(60)
    back = store.restore()
    assert store.last_restore.step == 2 and back["meta"] == state["meta"]
    disk = store.reader(2, tiers=["disk"]).get("model")  # from the compressed tier alone
    for got in (back["model"], disk):
        assert all(got[k].dtype == state["model"][k].dtype and got[k].tobytes() == state["model"][k].tobytes() for k in "wb")
    print("steps", store.steps())
"""


def test_installed_wheel_saves_restores_and_runs_the_cli(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    # numpy (the one dependency) comes from this interpreter's copy, so the install needs no
    # index: a directory of links to it, on the new environment's path.
    deps = tmp_path / "deps"
    deps.mkdir()
    site = Path(np.__file__).parent.parent
    for p in [site / "numpy", site / "numpy.libs", *site.glob("numpy-*.dist-info")]:
        if p.exists():
            (deps / p.name).symlink_to(p)
    vsite = Path(subprocess.check_output([str(vpy), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True).strip())
    (vsite / "numpy-from-test.pth").write_text(f"{deps}\n")
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-index", "--no-cache-dir",
                        "--quiet", str(wheel)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr

    # What the user's shell has: the new environment and the system's tools, no Rust, a HOME
    # without ~/.cargo, a working directory away from the checkout.
    path = f"{venv / 'bin'}:/usr/bin:/bin"
    for tool in ("cargo", "rustc", "maturin"):
        assert shutil.which(tool, path=path) is None, f"{tool} is on the test's PATH"
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8"}
    shm = new_shm_root("wheel-")
    policy = tmp_path / "tiercel.toml"
    policy.write_text(f'[[tier]]\nname = "ram"\nkind = "memory"\nroot = "{shm}"\n\n'
                      f'[[tier]]\nname = "disk"\nkind = "fs"\nurl = "{tmp_path / "disk"}"\ncompression = "zstd"\n\n'
                      '[store]\nchunk_size = "64KiB"\nthreads = 2\n')

    def run(*cmd: str) -> subprocess.CompletedProcess:
        r = subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        assert r.returncode == 0, f"{cmd} exited {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
        return r

    try:
        r = run(str(vpy), "-c", USER_SCRIPT, str(policy))
        assert "steps {'ram': [2], 'disk': [2]}" in r.stdout, r.stdout
        tiercel_cmd = str(venv / "bin" / "tiercel")
        assert run(tiercel_cmd, "--version").stdout.startswith(f"tiercel {tiercel.__version__} (format ")
        doc = json.loads(run(tiercel_cmd, "ls", "--json").stdout)  # ./tiercel.toml
        assert {t["name"]: [s["step"] for s in t["steps"]] for t in doc["tiers"]} == {"ram": [2], "disk": [2]}
        assert "all checksums hold" in run(tiercel_cmd, "verify", "--policy", str(policy)).stdout
    finally:
        shutil.rmtree(shm, ignore_errors=True)
