"""The cluster policy, the simulator, the scheduler and its queues import in an environment without torch (or
any installed package): `python -S` runs without site-packages, with only the repository on its path."""

import subprocess
import sys
from pathlib import Path

MODULES = ("punica", "punica.cluster.policy", "punica.cluster.placement", "punica.cluster.simulator",
           "punica.cluster.step_time", "punica.engine.scheduler", "punica.engine.scheduler_output",
           "punica.engine.request", "punica.engine.tenancy", "punica.engine.waiting", "punica.engine.fair_share",
           "punica.config")
CHECK = """
import importlib.util, sys
sys.path.insert(0, {root!r})
assert importlib.util.find_spec("torch") is None, "torch is importable here"
for name in {modules!r}:
    __import__(name)
assert "torch" not in sys.modules and "numpy" not in sys.modules, sorted(sys.modules)
"""


def test_torch_free_modules_import_without_site_packages():
    code = CHECK.format(root=str(Path(__file__).parents[1]), modules=MODULES)
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
