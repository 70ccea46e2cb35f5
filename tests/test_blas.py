"""The OpenBLAS preload decision and the BLAS report (Linux CPU backend)."""

import subprocess
import sys

import pytest

from dflash2_mlx import blas as _blas


def test_reexec_decision_respects_platform_opt_out_and_existing_preload():
    assert _blas.should_reexec({}, platform="darwin") == (False, "not Linux (Accelerate/Metal on macOS)")
    assert _blas.should_reexec({"DFLASH2_NO_OPENBLAS": "1"}, platform="linux")[1].startswith("disabled by")
    assert not _blas.should_reexec({"LD_PRELOAD": "/x/libopenblas.so.0"}, platform="linux")[0]
    reexec, why = _blas.should_reexec({}, platform="linux")
    expected = _blas.bundled_reference_blas() is not None and _blas.find_openblas() is not None
    assert reexec == expected, why


def test_override_path_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH2_OPENBLAS", str(tmp_path / "nope.so"))
    assert _blas.find_openblas() is None
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setenv("DFLASH2_OPENBLAS", str(lib))
    assert _blas.find_openblas() == str(lib)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD interposition is Linux-only")
def test_active_blas_sees_a_preloaded_openblas():
    """In a child process with OpenBLAS preloaded, the report names it; without, the bundled one."""
    lib = _blas.find_openblas()
    if lib is None or _blas.bundled_reference_blas() is None:
        pytest.skip("needs the mlx-cpu wheel's bundled BLAS and a system OpenBLAS")
    code = "import mlx.core; from dflash2_mlx import blas as _blas; print(_blas.active_blas()['name'])"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin"}, check=True)
    fast = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "LD_PRELOAD": lib}, check=True)
    assert plain.stdout.strip() == "reference" and fast.stdout.strip() == "openblas"
