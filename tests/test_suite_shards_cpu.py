"""bench/gpu_suite.sh runs the GPU suite in shards: every GPU test file is in exactly one shard."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_gpu_test_file_is_in_one_shard():
    script = (ROOT / "bench" / "gpu_suite.sh").read_text()
    named = [n for line in re.findall(r'^\s*[1-4]\) files="([^"]*)"', script, re.M) for n in line.split()]
    files = sorted(p.stem[len("test_gpu_"):] for p in (ROOT / "tests").glob("test_gpu_*.py"))
    assert sorted(named) == files
