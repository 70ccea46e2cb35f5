"""The fast-BLAS finder, the preload decision, the slow-BLAS warning and the BLAS report (Linux CPU backend)."""

import json
import os
import subprocess
import sys

import pytest

from dflash2_mlx import blas as _blas


def test_reexec_decision_respects_platform_opt_out_and_existing_preload():
    assert _blas.should_reexec({}, platform="darwin") == (False, "not Linux (Accelerate/Metal on macOS)")
    assert _blas.should_reexec({"DFLASH2_NO_OPENBLAS": "1"}, platform="linux")[1].startswith("disabled by")
    assert not _blas.should_reexec({"LD_PRELOAD": "/x/libopenblas.so.0"}, platform="linux")[0]
    reexec, why = _blas.should_reexec({}, platform="linux")
    expected = _blas.bundled_reference_blas() is not None and _blas.find_fast_blas({}) is not None
    assert reexec == expected, why


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD interposition is Linux-only")
def test_active_blas_sees_a_preloaded_fast_blas():
    """In a child process with the found BLAS preloaded, the report names it; without, the bundled one."""
    found = _blas.find_fast_blas()
    if found is None or _blas.bundled_reference_blas() is None:
        pytest.skip("needs the mlx-cpu wheel's bundled BLAS and a fast BLAS (system OpenBLAS or faiss-cpu)")
    code = "import mlx.core; from dflash2_mlx import blas as _blas; print(_blas.active_blas()['name'])"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin"}, check=True)
    fast = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_blas.reexec_env(found, {"PATH": "/usr/bin:/bin"}), check=True)
    assert plain.stdout.strip() == "reference" and fast.stdout.strip() == found.name


# -- finder: fake file trees ----------------------------------------------------------------


def touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """A system OpenBLAS, a pip site-packages with faiss-cpu's bundled OpenBLAS and a prefix with MKL."""
    system = touch(tmp_path / "usr/lib/libopenblas.so.0")
    libs = tmp_path / "site/faiss_cpu.libs"
    deps = [touch(libs / n) for n in ("libquadmath-2284e583.so.0.0.0", "libgfortran-83c28eba.so.5.0.0",
                                        "libgomp-e985bcbb.so.1.0.0")]
    faiss = touch(libs / "libopenblaso-r0-d77a1985.3.15.so")
    mkl = touch(tmp_path / "prefix/lib/libmkl_rt.so.3")
    monkeypatch.setattr(_blas, "OPENBLAS_CANDIDATES", (str(tmp_path / "nope.so"), str(system)))
    roots = {"site": [tmp_path / "missing", tmp_path / "site"], "data": [tmp_path / "prefix/lib"]}
    return {"system": system, "deps": deps, "faiss": faiss, "mkl": mkl, "roots": roots}


def test_finder_order_override_mkl_system_then_wheel_openblas(fake_tree, tmp_path):
    roots = fake_tree["roots"]
    mkl = _blas.find_fast_blas({}, roots)
    assert (mkl.name, mkl.library, mkl.source) == ("mkl", str(fake_tree["mkl"]), f"pip ({tmp_path / 'prefix/lib'})")
    fake_tree["mkl"].unlink()
    system = _blas.find_fast_blas({}, roots)
    assert (system.library, system.source) == (str(fake_tree["system"]), "system")
    pip = _blas.find_fast_blas({"DFLASH2_BLAS_IGNORE_SYSTEM": "1"}, roots)
    assert pip.library == str(fake_tree["faiss"]) and pip.source == f"pip ({tmp_path / 'site'})"
    override = _blas.find_fast_blas({"DFLASH2_OPENBLAS": str(fake_tree["system"])}, roots)
    assert override.source == "DFLASH2_OPENBLAS"
    assert _blas.find_fast_blas({"DFLASH2_OPENBLAS": str(tmp_path / "gone.so")}, roots) is None
    empty = {"site": [tmp_path / "none"], "data": []}
    assert _blas.find_fast_blas({"DFLASH2_BLAS_IGNORE_SYSTEM": "1"}, empty) is None


def test_wheel_openblas_preloads_its_bundled_runtime_first_and_runs_one_openmp_thread(fake_tree):
    fake_tree["mkl"].unlink()
    found = _blas.find_pip_blas(fake_tree["roots"])
    assert found.name == "openblas" and dict(found.env) == {"OMP_NUM_THREADS": "1"}
    assert found.preload == (*map(str, fake_tree["deps"]), str(fake_tree["faiss"]))
    plain = _blas.blas_from_path(str(fake_tree["system"]), "system")
    assert plain.preload == (str(fake_tree["system"]),) and plain.env == ()


def test_mkl_runs_sequential_unless_the_user_chose_a_layer(fake_tree):
    found = _blas.find_pip_blas(fake_tree["roots"])
    assert found.name == "mkl" and found.preload == (str(fake_tree["mkl"]),)
    env = _blas.reexec_env(found, {"LD_PRELOAD": "/x/libother.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == f"{fake_tree['mkl']}:/x/libother.so"
    assert env["MKL_THREADING_LAYER"] == "SEQUENTIAL" and env["DFLASH2_BLAS_REEXEC"] == "1"
    assert _blas.reexec_env(found, {"MKL_THREADING_LAYER": "GNU"})["MKL_THREADING_LAYER"] == "GNU"


def test_preloaded_fast_blas_recognises_every_kind():
    for preload in ("/a/libopenblas.so.0", "/a/libgomp-1.so:/b/libopenblaso-r0-d77a1985.3.15.so",
                    "/p/lib/libmkl_rt.so.3"):
        assert _blas.preloaded_fast_blas({"LD_PRELOAD": preload}), preload
    assert not _blas.preloaded_fast_blas({"LD_PRELOAD": "/a/libasan.so"})
    assert not _blas.preloaded_fast_blas({})


def test_reexec_needs_some_fast_blas(fake_tree, monkeypatch):
    fake_tree["mkl"].unlink()
    monkeypatch.setattr(_blas, "bundled_reference_blas", lambda: "/m/mlx_cpu.libs/libblas.so")
    monkeypatch.setattr(_blas, "pip_roots", lambda: fake_tree["roots"])
    assert _blas.should_reexec({"DFLASH2_BLAS_IGNORE_SYSTEM": "1"}, platform="linux") == (
        True, f"preloading {fake_tree['faiss']} (pip ({fake_tree['roots']['site'][1]}))")
    monkeypatch.setattr(_blas, "pip_roots", lambda: {})
    reexec, why = _blas.should_reexec({"DFLASH2_BLAS_IGNORE_SYSTEM": "1"}, platform="linux")
    assert not reexec and "apt install libopenblas0-pthread" in why and "pip install" in why


# -- the slow-BLAS warning ------------------------------------------------------------------

REFERENCE = {"name": "reference", "library": "/m/mlx_cpu.libs/libblas-x.so.3", "fast": False}
OPENBLAS = {"name": "openblas", "library": "/usr/lib/libopenblas.so.0", "fast": True}


def test_warning_only_for_the_reference_blas(monkeypatch):
    monkeypatch.setattr(_blas, "find_fast_blas", lambda environ=None, roots=None: None)
    monkeypatch.setattr(_blas, "active_blas", lambda: REFERENCE)
    line = _blas.slow_blas_warning()
    assert line.startswith("warning: ") and "\n" not in line
    assert "tok/s" in line and "apt install libopenblas0-pthread" in line and "pip install" in line
    monkeypatch.setattr(_blas, "active_blas", lambda: OPENBLAS)
    assert _blas.slow_blas_warning() is None
    monkeypatch.setattr(_blas, "active_blas", lambda: {"name": "unknown", "library": None, "fast": None})
    assert _blas.slow_blas_warning() is None


@pytest.mark.parametrize("active", [REFERENCE, OPENBLAS])
def test_run_and_bench_print_the_warning_once_and_only_on_the_reference_blas(active, pair, isolated, monkeypatch):
    from typer.testing import CliRunner

    from dflash2_mlx.cli import app

    monkeypatch.setattr(_blas, "active_blas", lambda: active)
    target, drafter = pair
    run = ["run", str(target), "Hello", "--drafter", str(drafter), "-n", "6"]
    bench = ["bench", str(target), "--drafter", str(drafter), "--modes", "ar,dflash2", "--suite", "mtbench",
             "--n", "1", "--max-tokens", "4", "--bundled", "--no-warmup"]
    for args in (run, bench):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert result.stderr.count("slow reference BLAS") == (0 if active["fast"] else 1), result.stderr


def test_serve_prints_the_warning_before_serving(pair, isolated, monkeypatch):
    """The server itself is stubbed out: only the lines `dflash2 serve` prints first matter here."""
    from typer.testing import CliRunner

    import dflash2_mlx.server
    from dflash2_mlx.cli import app, serve

    def stop(code):
        raise SystemExit(code)

    monkeypatch.setattr(_blas, "active_blas", lambda: REFERENCE)
    monkeypatch.setattr(dflash2_mlx.server, "serve", lambda session, config, on_ready: None)
    monkeypatch.setattr(serve.os, "_exit", stop)
    monkeypatch.setattr(serve.faulthandler, "enable", lambda *a, **k: None)  # CliRunner's stderr has no fileno
    target, drafter = pair
    result = CliRunner().invoke(app, ["serve", str(target), "--drafter", str(drafter), "--port", "0"])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("slow reference BLAS") == 1, result.stderr


# -- a real process on a machine without a system OpenBLAS ----------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD interposition is Linux-only")
def test_doctor_finds_the_pip_blas_without_a_system_openblas():
    """What a fresh machine gets: the system libraries hidden, nothing preloaded, no override."""
    if _blas.bundled_reference_blas() is None:
        pytest.skip("MLX here does not use the mlx-cpu wheel's bundled reference BLAS")
    pip = _blas.find_pip_blas()
    if pip is None:
        pytest.skip(f"no pip-installed fast BLAS ({_blas.PIP_HINT}; a default dependency on Linux x86_64)")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DFLASH2_OPENBLAS",
                                                            "DFLASH2_NO_OPENBLAS", "DFLASH2_BLAS_REEXEC")}
    env.update(DFLASH2_BLAS_IGNORE_SYSTEM="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "dflash2_mlx", "doctor", "--json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    blas = json.loads(done.stdout)["environment"]["blas"]
    assert blas["active"]["fast"] is True, blas
    assert os.path.realpath(blas["active"]["library"]) == os.path.realpath(pip.library), blas
    assert blas["found"]["source"].startswith("pip")
