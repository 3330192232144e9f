import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")


def run_py(code, config=None, env=None, timeout=120):
    """Runs `code` in a fresh interpreter (what DATAMEM_CONFIG affects happens at
    start-up, so it is tested in a subprocess with its own environment)."""
    e = dict(os.environ)
    e.pop("DATAMEM_CONFIG", None)
    if config is not None:
        e["DATAMEM_CONFIG"] = config
    if env:
        e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def demo_policy():
    return os.path.join(CONFIGS, "demo.yaml")


@pytest.fixture
def write_policy(tmp_path):
    def w(text, name="policy.yaml"):
        p = tmp_path / name
        p.write_text(text)
        return str(p)
    return w
