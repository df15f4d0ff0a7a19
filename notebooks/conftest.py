"""The tutorials run under nbval; the Ray one only where Ray is installed (the optional extra nbddp[ray])."""
import importlib.util
import os
import tempfile

collect_ignore = [] if importlib.util.find_spec("ray") else ["10-ray-cluster.ipynb"]
# a keepers' directory of this test process's own (as tests/conftest.py gives each): %load_ext and %ddp pools in a
# tutorial list only the pools it kept, never one another test or notebook left waiting for a kernel
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="nbx-", dir="/tmp")
